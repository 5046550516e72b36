"""Argument checks of variable-length (packed) attention, as flash-attn's ``flash_attn_varlen_func`` takes
its arguments (issue #43): every check runs before any kernel. The varlen kernels and their public
entry points (``forward_varlen`` / ``backward_varlen``) come later; their host side calls
:func:`check_varlen` first and launches with the :class:`VarlenLayout` it returns.

Layout. A batch of ``batch`` sequences is packed along the first axis: q ``(total_q, heads_q, head_dim_qk)``,
k ``(total_k, heads_kv, head_dim_qk)``, v ``(total_k, heads_kv, head_dim_v)``. Sequence ``b``'s queries are
rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and its keys rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of
k and v (int32 CuPy arrays of length ``batch + 1``). ``seqused_q`` / ``seqused_k`` (int32, ``(batch,)``,
optional) say how many of a sequence's packed rows are used (a KV cache's filled part, say); rows past
them are neither read (keys) nor written (queries). ``max_seqlen_q`` / ``max_seqlen_k`` are Python ints at
least every sequence's length: the kernels' grid covers ``max_seqlen_q`` rows of every sequence, so they
must be known on the host without a copy.

Checks without a device-to-host copy, always: the types, dtypes, shapes, strides, devices and alignment
of q, k, v, the offsets and seqused arrays (never their values), the ints, the kernels' index limits, and
what the shapes alone imply of the offsets (one offset with a non-empty q or k; ``total <= batch *
max_seqlen``, since the lengths sum to the total).

Checks that need a device-to-host copy (``check_offsets``), on the values of the offsets and of seqused
(:func:`validate_offsets`): offsets start at 0, never decrease and end at the total (``q.shape[0]``,
``k.shape[0]``); every sequence's length is at most its max_seqlen; ``0 <= seqused[b] <=`` sequence b's
packed length. They cost one copy of ``2 * (batch + 1)`` (up to ``4 * batch + 2``) int32s and a wait for
the work queued on the current stream, which waits for the host.

- Eager calls: ``check_offsets=None`` (the default) turns them on.
- Under CUDA graph capture they are off: ``None`` resolves to False when the current stream of q's device
  is capturing (``capture.stream_is_capturing``), since a capture allows no synchronization and a replay
  reads whatever offsets the arrays hold then, which a check at capture time would not see anyway.
- Under ``torch.compile`` and ``jax.jit`` (the wrappers that will come) no sync is allowed either, and
  the offsets are traced values: the wrappers must pass ``check_offsets=False``.
- ``check_offsets=True`` forces them (a capture then fails in the copy: CUDA refuses the sync).

The kernels' obligation with the offset checks off (and so always, since a replayed graph is never
checked): a bad offset or seqused gives wrong results for the sequences it touches, never a read or a
write outside the arrays. Each kernel, per sequence ``b``, before it forms an address, clamps on the
device: ``start = clamp(cu_seqlens[b], 0, total)``, ``end = clamp(cu_seqlens[b + 1], start, total)``,
``len = min(end - start, max_seqlen)`` (so ``len`` is in ``[0, max_seqlen]`` and ``start + len <= total``),
and ``used = clamp(seqused[b], 0, len)`` where seqused is given; it reads and writes only rows
``start .. start + used - 1`` (``len`` without seqused) of q, k, v, out, their gradients and lse. The
clamps are int32 arithmetic on values in ``[0, total]``, which :func:`check_varlen` bounds by 2^31 - 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from . import _checks, capture
from . import head_dims as head_dims_rule

INDEX_DTYPE = np.dtype(np.int32)


# eq=False: the arrays' == is elementwise, so a generated __eq__ would raise; layouts compare by identity.
@dataclass(frozen=True, eq=False)
class VarlenLayout:
    """A varlen call's checked arguments.

    q ``(total_q, heads_q, head_dim_qk)``, k ``(total_k, heads_kv, head_dim_qk)``, v ``(total_k, heads_kv,
    head_dim_v)``; ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 CuPy arrays ``(batch + 1,)``, C-contiguous, on
    ``device_id``; ``seqused_q`` / ``seqused_k`` int32 ``(batch,)`` or None. ``offsets_checked``: whether
    the values of the offsets (and seqused) were copied to the host and validated; when False the
    kernels' clamps (module docstring) are all that keeps a bad offset inside the arrays."""

    batch: int
    total_q: int
    total_k: int
    heads_q: int
    heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    seqused_q: Any = None
    seqused_k: Any = None
    device_id: int = 0
    offsets_checked: bool = False


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                 seqused_q=None, seqused_k=None, check_offsets: Optional[bool] = None, allow_dv: bool = False,
                 head_dims: Optional[range | tuple] = None, head_dims_checked: bool = False) -> VarlenLayout:
    """Checks a varlen call's arguments (shapes in the module docstring) and returns their layout.

    Always, without touching the device: TypeError for a wrong type or dtype, ValueError for a wrong
    shape, stride, device or value, each naming the argument and what it must be. Then, when
    ``check_offsets`` is True (None: True unless the current stream of q's device is capturing a CUDA
    graph), one device-to-host copy of the offsets and seqused and :func:`validate_offsets` on it.
    The head dims as head_dims.check says (q / k up to 576, v up to 512); ``allow_dv``: v's head dim may
    differ from q's; ``head_dims``: where given, the only head dims of q and k the caller's kernels support;
    ``head_dims_checked``: the rule not applied again (arrays the API zero-padded after checking the caller's).
    A max_seqlen above the total is accepted: flash-attn takes it as an upper bound, and a captured graph
    passes a fixed one (only the grid grows)."""
    for name, x, rows, heads in (("q", q, "total_q", "heads_q"), ("k", k, "total_k", "heads_kv"),
                                 ("v", v, "total_k", "heads_kv")):
        _check_packed(name, x, rows, heads)
    _checks.check_same("k", k, "q", q)
    _checks.check_same("v", v, "q", q)
    total_q, hq, d = q.shape
    total_k, hkv, dk = k.shape
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"k and v must have the same (total_k, heads_kv), got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    if dk != d:
        raise ValueError(f"k must have the head_dim of q ({d}), got {dk}")
    _checks.check_heads(hq, hkv)
    dv = v.shape[2]
    if head_dims is not None and d not in head_dims:
        raise ValueError(f"head_dim must be {_describe(head_dims)}, got {d}")
    if not _checks.check_flag("allow_dv", allow_dv) and dv != d:
        raise ValueError(f"v must have the head_dim of q ({d}), got {dv}")
    if not head_dims_checked:
        head_dims_rule.check(d, dv)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_aligned(name, x)   # after the shapes, as the dense checks: those say more

    dev = q.data.device_id
    _check_index_array("cu_seqlens_q", cu_seqlens_q, dev, "(batch + 1,)")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have length batch + 1 >= 1 (offsets of the sequences and the "
                         "end of the last), got length 0")
    batch = cu_seqlens_q.shape[0] - 1
    _check_index_array("cu_seqlens_k", cu_seqlens_k, dev, "(batch + 1,)")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must have the length of cu_seqlens_q (batch + 1 = {batch + 1}), "
                         f"got {cu_seqlens_k.shape[0]}")
    for name, x in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if x is not None:
            _check_index_array(name, x, dev, "(batch,)")
            if x.shape != (batch,):
                raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(x.shape)}")
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)

    check_totals(batch, total_q, total_k, max_q, max_k)
    _checks.check_limits(batch, max_q, max_k, hq, hkv)

    if check_offsets is None:
        check_offsets = not _capturing(dev)
    elif not _checks.check_flag("check_offsets", check_offsets):
        check_offsets = False
    if check_offsets:
        given = [x for x in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) if x is not None]
        host = iter(_copy_to_host(given, dev))
        cu_q, cu_k = next(host), next(host)
        su_q = None if seqused_q is None else next(host)
        su_k = None if seqused_k is None else next(host)
        validate_offsets(cu_q, cu_k, total_q, total_k, max_q, max_k, su_q, su_k)
    return VarlenLayout(batch, total_q, total_k, hq, hkv, d, dv, max_q, max_k, cu_seqlens_q, cu_seqlens_k,
                        seqused_q, seqused_k, dev, bool(check_offsets))


def check_totals(batch: int, total_q: int, total_k: int, max_q: int, max_k: int) -> None:
    """What the shapes alone say of the offsets (no copy): int32 offsets reach the totals, and ``batch`` lengths of
    at most max_seqlen each sum to them. ValueError naming the argument otherwise (the JAX wrapper's trace-time
    checks call it too)."""
    for side, total, mx in (("q", total_q, max_q), ("k", total_k, max_k)):
        if total > _checks.INT32_MAX:
            raise ValueError(f"total_{side} ({side}.shape[0]) must be <= {_checks.INT32_MAX}: cu_seqlens_{side} "
                             f"is int32, got {total}")
        if batch == 0 and total:
            raise ValueError(f"cu_seqlens_{side} has length 1 (no sequences), so its one offset must be 0 and "
                             f"total_{side} = {side}.shape[0] = {total}: pass {side} with 0 rows or the offsets "
                             f"of its sequences")
        if total > batch * mx:
            raise ValueError(f"max_seqlen_{side} ({mx}) is smaller than a sequence: {batch} sequences of at most "
                             f"{mx} tokens cannot pack total_{side} = {side}.shape[0] = {total} "
                             f"(cu_seqlens_{side} has length {batch + 1})")


def validate_offsets(cu_q: np.ndarray, cu_k: np.ndarray, total_q: int, total_k: int, max_seqlen_q: int,
                     max_seqlen_k: int, seqused_q: Optional[np.ndarray] = None,
                     seqused_k: Optional[np.ndarray] = None) -> None:
    """The offsets' values, on the host (NumPy integer arrays): ``cu_q`` / ``cu_k`` ``(batch + 1,)`` start at
    0, never decrease and end at ``total_q`` / ``total_k``; every length ``cu[b + 1] - cu[b]`` is at most its
    max_seqlen; ``seqused_q`` / ``seqused_k`` ``(batch,)`` are in ``[0, cu[b + 1] - cu[b]]``. ValueError
    naming the argument, the first bad index and the values otherwise."""
    cu_q, cu_k = _host_ints("cu_seqlens_q", cu_q), _host_ints("cu_seqlens_k", cu_k)
    if cu_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have length batch + 1 >= 1, got length 0")
    if cu_k.shape != cu_q.shape:
        raise ValueError(f"cu_seqlens_k must have the length of cu_seqlens_q ({cu_q.shape[0]}), got {cu_k.shape[0]}")
    lengths = {}
    for side, cu, total, mx in (("q", cu_q, total_q, max_seqlen_q), ("k", cu_k, total_k, max_seqlen_k)):
        name = f"cu_seqlens_{side}"
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
        n = np.diff(cu)   # int64 (from _host_ints): no wrap-around for offsets of any int32 values
        bad = np.flatnonzero(n < 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name} must be non-decreasing: {name}[{i + 1}] = {cu[i + 1]} < {name}[{i}] = {cu[i]} "
                             f"(sequence {i} would have length {n[i]})")
        if cu[-1] != total:
            raise ValueError(f"{name} must end at total_{side} = {side}.shape[0] = {total}, "
                             f"got {name}[{cu.shape[0] - 1}] = {cu[-1]}")
        bad = np.flatnonzero(n > mx)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"max_seqlen_{side} ({mx}) is smaller than sequence {i}: its length is {name}[{i + 1}] "
                             f"- {name}[{i}] = {cu[i + 1]} - {cu[i]} = {n[i]}")
        lengths[side] = n
    for side, used in (("q", seqused_q), ("k", seqused_k)):
        if used is None:
            continue
        name, n = f"seqused_{side}", lengths[side]
        used = _host_ints(name, used)
        if used.shape != n.shape:
            raise ValueError(f"{name} must have shape (batch,) = ({n.shape[0]},), got {used.shape}")
        bad = np.flatnonzero((used < 0) | (used > n))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i}] = {used[i]} must be in [0, {n[i]}] (sequence {i}'s packed length, "
                             f"cu_seqlens_{side}[{i + 1}] - cu_seqlens_{side}[{i}])")


def _check_packed(name: str, x, rows: str, heads: str) -> None:
    """``x`` is a CuPy array of a supported dtype, (rows, heads, head_dim), contiguous in its last dim
    (the dense ``check_array`` with the packed layout's wording; alignment is checked after the shapes)."""
    cupy = _checks._cupy()
    if not isinstance(x, cupy.ndarray):
        hint = f"; convert with cupy.asarray({name})" if isinstance(x, np.ndarray) or hasattr(x, "__array__") else ""
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}{hint}")
    if x.ndim != 3:
        raise ValueError(f"{name} must have 3 dimensions ({rows}, {heads}, head_dim): the sequences packed "
                         f"along the first, got shape {tuple(x.shape)}")
    if np.dtype(x.dtype) not in _checks.SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    _checks.check_strides_nonnegative(name, x)
    if x.size and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {x.itemsize} bytes), "
                         f"got strides {x.strides}")


def _check_index_array(name: str, x, device_id: int, shape: str) -> None:
    """An int32 CuPy array, 1-D, C-contiguous and 4-byte aligned (the kernels read element b at
    ``ptr + 4 * b``), on ``device_id``."""
    cupy = _checks._cupy()
    if not isinstance(x, cupy.ndarray):
        hint = f"; convert with cupy.asarray({name}, dtype=cupy.int32)" if hasattr(x, "__array__") or isinstance(
            x, (list, tuple)) else ""
        raise TypeError(f"{name} must be a cupy.ndarray of int32 {shape}, got "
                        f"{type(x).__module__}.{type(x).__name__}{hint}")
    if np.dtype(x.dtype) != INDEX_DTYPE:
        raise TypeError(f"{name} must be int32, got {x.dtype}; convert with {name}.astype(cupy.int32)")
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D {shape}, got shape {tuple(x.shape)}")
    if x.data.device_id != device_id:
        raise ValueError(f"{name} is on device {x.data.device_id} but q is on device {device_id}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous (stride 4 bytes), got strides {x.strides}; pass "
                         f"cupy.ascontiguousarray({name})")
    if x.size and x.data.ptr % INDEX_DTYPE.itemsize:
        raise ValueError(f"{name} must start on a 4-byte boundary (int32), got pointer offset "
                         f"{x.data.ptr % INDEX_DTYPE.itemsize}; pass a copy")


def _check_max_seqlen(name: str, value: Any) -> int:
    """A host int >= 0 (a device scalar would need the copy the offsets checks make optional)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int >= 0 (a bound on every sequence's length, known on the "
                        f"host), got {type(value).__module__}.{type(value).__name__}")
    value = int(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _describe(dims: range | Sequence[int]) -> str:
    if isinstance(dims, range) and len(dims) and dims.step > 0:
        if dims.start == dims.step:
            return f"a multiple of {dims.step} from {dims.start} to {dims[-1]}"
        return f"one of {dims.start}, {dims.start + dims.step}, ... {dims[-1]}"
    return "one of " + ", ".join(str(d) for d in dims)


def _host_ints(name: str, x) -> np.ndarray:
    """A 1-D NumPy integer array as int64 (so differences of int32 values cannot wrap)."""
    x = np.asarray(x)
    if x.ndim != 1 or not (np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got {x.dtype} of shape {x.shape}")
    return x.astype(np.int64)


def _capturing(device_id: int) -> bool:
    """Whether the current stream of ``device_id`` is capturing a CUDA graph."""
    import cupy

    return capture.stream_is_capturing(cupy.cuda.get_current_stream(device_id).ptr)


def _copy_to_host(arrays: list, device_id: int) -> list[np.ndarray]:
    """The arrays' values on the host, with one wait: their copies queued on the current stream of
    ``device_id`` (after the work that writes them) into one pinned buffer, then one synchronization."""
    import cupy
    import cupyx

    with cupy.cuda.Device(device_id):
        stream = cupy.cuda.get_current_stream()
        buf = cupyx.empty_pinned((sum(x.size for x in arrays),), INDEX_DTYPE)
        views, at = [], 0
        for x in arrays:
            view = buf[at:at + x.size]
            at += x.size
            x.get(stream=stream, out=view, blocking=False)
            views.append(view)
        stream.synchronize()
    # Copies, so that the pinned block goes back to CuPy's pool now.
    return [v.copy() for v in views]
