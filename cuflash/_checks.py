"""Argument checks shared by forward and backward. Every check runs before any kernel."""
from __future__ import annotations

import math

import numpy as np

from . import head_dims
from ._overlap import extent, shares_memory

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

SUPPORTED_DTYPES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}
if BFLOAT16 is not None:
    SUPPORTED_DTYPES[BFLOAT16] = "bfloat16"

ALIGN_BYTES = 16


def _cupy():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover
        raise ImportError("cuflash needs CuPy: pip install 'cuflash[cuda12]' (or [cuda13])") from e
    return cupy


def dtype_name(dtype) -> str:
    return SUPPORTED_DTYPES[np.dtype(dtype)]


def check_array(name: str, x, *, ndim: int = 4, aligned: bool = True) -> None:
    """``x`` is a CuPy array of a supported dtype with ``ndim`` dims and a contiguous last dim."""
    cupy = _cupy()
    if not isinstance(x, cupy.ndarray):
        hint = f"; convert with cupy.asarray({name})" if isinstance(x, np.ndarray) or hasattr(x, "__array__") else ""
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}{hint}")
    if x.ndim != ndim:
        dims = "(batch, seqlen, heads, head_dim)" if ndim == 4 else "(total, heads, head_dim): packed sequences"
        raise ValueError(f"{name} must have {ndim} dimensions {dims}, got shape {tuple(x.shape)}")
    if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    check_strides_nonnegative(name, x)
    if x.size and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {x.itemsize} bytes), "
                         f"got strides {x.strides}")
    if aligned:
        check_aligned(name, x)


def check_aligned(name: str, x) -> None:
    """Kernels load 16-byte chunks: the pointer and every stride of a non-trivial dim align to 16."""
    if x.size:
        misaligned = x.data.ptr % ALIGN_BYTES or any(
            s % ALIGN_BYTES for s, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)
        if misaligned:
            raise ValueError(f"{name} must start on a {ALIGN_BYTES}-byte boundary and have strides that are "
                             f"multiples of {ALIGN_BYTES} bytes (got pointer offset {x.data.ptr % ALIGN_BYTES}, "
                             f"strides {x.strides}); pass a contiguous copy")


def check_same(name: str, x, ref_name: str, ref) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {x.dtype}")
    if x.device.id != ref.device.id:
        raise ValueError(f"{name} is on device {x.device.id} but {ref_name} is on device {ref.device.id}")


def check_qkv(q, k, v, allow_dv: bool = False,
              head_dims_checked: bool = False) -> tuple[int, int, int, int, int, int]:
    """Validate q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D) (``allow_dv``: v (B, Nk, Hkv, Dv)), the head dims as
    head_dims.check says (``head_dims_checked``: not again, for arrays that the API zero-padded after checking
    the caller's, head_dims.padded). Returns (B, Nq, Nk, Hq, Hkv, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x, aligned=False)  # shape errors first: they say more than alignment
    check_same("k", k, "q", q)
    check_same("v", v, "q", q)
    dims = check_qkv_shapes(q, k, v, allow_dv)
    if not head_dims_checked:
        head_dims.check(dims[-1], v.shape[3])
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_aligned(name, x)
    return dims


def check_heads(heads_q: int, heads_kv: int) -> None:
    """At least one head each, and heads_q a multiple of heads_kv (GQA / MQA); ValueError otherwise."""
    if heads_q < 1 or heads_kv < 1:
        raise ValueError(f"heads must be >= 1, got heads_q={heads_q}, heads_kv={heads_kv}")
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) for GQA/MQA")


def check_qkv_shapes(q, k, v, allow_dv: bool = False) -> tuple[int, int, int, int, int, int]:
    """q (B, Nq, Hq, D) and k, v (B, Nk, Hkv, D) agree (``allow_dv``: v's head dim may differ), with Hq % Hkv
    == 0. Returns (B, Nq, Nk, Hq, Hkv, D)."""
    b, nq, hq, d = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape in (batch, seqlen_k, heads_kv), got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if not allow_dv and k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape here, got k {tuple(k.shape)} and v {tuple(v.shape)} (a "
                         f"head dim of v's own is taken by cuflash.forward / backward, not by this entry point)")
    bk, nk, hkv, dk = k.shape
    if bk != b:
        raise ValueError(f"k and v must have the batch size of q ({b}), got {bk}")
    if dk != d:
        raise ValueError(f"k and v must have the head_dim of q ({d}), got {dk}")
    check_heads(hq, hkv)
    check_limits(b, nq, nk, hq, hkv)
    return b, nq, nk, hq, hkv, d


# The kernels' limits (every family, forward and backward, fp8 and the ring's steps):
# - batch and heads are the y and z dimensions of the 3-D grids (launch.py: fwd_grid, bwd_row_grid,
#   bwd_dkdv_grid; the pre/post-processing kernels and fp8's V^T pass always), which CUDA caps at 65535.
# - seqlen_q, seqlen_k, batch and heads are int32 fields (kernels_cu/common/params.cuh). Row and key
#   indices and the causal bounds are int arithmetic on them: (m_block + 1) * block_m - 1 + seqlen_k - seqlen_q
#   (block_range.cuh) reaches seqlen_q + seqlen_k plus a tile before the subtraction, hence the bound on
#   the sum with a margin of the largest tile. Element offsets are 64-bit (batch, row and head strides
#   are i64 fields and every pointer offset is formed in i64), so strides have no limit of their own.
# - Tile counts are int / unsigned: the sm90 forward's tiles (query tiles x heads_q x batch, plus the grid
#   for the persistent counter), the sm90 backward's dQ semaphores (2 per query tile and head, the int32
#   field dq_semaphores) and its 1-D grids (key tiles x heads_kv x batch, grid x <= 2^31 - 1); counted
#   with the smallest tile of any family (16 rows), so no tile override can pass them. These need more
#   memory than a GPU has today (2^34 query rows); checked all the same.
GRID_YZ_MAX = 65535
INT32_MAX = 2**31 - 1
SEQLEN_MARGIN = 1024                 # >= 2 x the largest tile (block_m, block_n <= 256) of any family
MIN_TILE = 16
TILE_COUNT_MAX = INT32_MAX - 65536   # room for the persistent kernels' grid (one CTA per SM, clusters)


def check_limits(batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int) -> None:
    """ValueError naming the argument and the limit when a shape passes what the kernels index (above)."""
    if batch > GRID_YZ_MAX:
        raise ValueError(f"batch must be <= {GRID_YZ_MAX} (the kernels' grid y/z limit), got {batch}; "
                         f"split the batch into calls of at most {GRID_YZ_MAX}")
    if heads_q > GRID_YZ_MAX:
        raise ValueError(f"heads_q must be <= {GRID_YZ_MAX} (the kernels' grid y/z limit), got {heads_q}")
    if seqlen_q + seqlen_k > INT32_MAX - SEQLEN_MARGIN:
        raise ValueError(f"seqlen_q + seqlen_k must be <= {INT32_MAX - SEQLEN_MARGIN} (2^31 - 1 less "
                         f"{SEQLEN_MARGIN}: the kernels index rows in int32), got {seqlen_q} + {seqlen_k}")
    query_tiles = 2 * batch * heads_q * -(-seqlen_q // MIN_TILE)
    if query_tiles > TILE_COUNT_MAX:
        raise ValueError(f"batch * heads_q * seqlen_q = {batch * heads_q * seqlen_q} is past the kernels' int32 "
                         f"tile counts (2 * batch * heads_q * ceil(seqlen_q / {MIN_TILE}) must be <= "
                         f"{TILE_COUNT_MAX}); split the batch")
    key_tiles = batch * heads_kv * -(-seqlen_k // MIN_TILE)
    if key_tiles > TILE_COUNT_MAX:
        raise ValueError(f"batch * heads_kv * seqlen_k = {batch * heads_kv * seqlen_k} is past the kernels' int32 "
                         f"tile counts (batch * heads_kv * ceil(seqlen_k / {MIN_TILE}) must be <= "
                         f"{TILE_COUNT_MAX}); split the batch")


def check_strides_nonnegative(name: str, x) -> None:
    """Views with a negative stride (``x[:, ::-1]``) are refused: the kernels and the overlap checks
    take each dimension to run forward from the pointer."""
    if any(s < 0 for s in x.strides):
        raise ValueError(f"{name} has a negative stride (strides {x.strides}): pass a view with non-negative "
                         f"strides or a copy (cupy.ascontiguousarray({name}))")


# Signatures of (q, k, v) already validated -> their dims: a training or serving loop calls with the
# same shapes, strides and dtypes again and again, and the full checks cost several microseconds.
_validated_qkv: dict = {}
_VALIDATED_MAX = 1024


def check_qkv_cached(q, k, v, allow_dv: bool = False,
                     head_dims_checked: bool = False) -> tuple[int, int, int, int, int, int]:
    """``check_qkv`` remembered per signature: everything the checks read (types, shapes, strides,
    dtypes, devices, pointer alignment) is in the key, so a hit is exactly a call that passed."""
    cupy = _cupy()
    if type(q) is not cupy.ndarray or type(k) is not cupy.ndarray or type(v) is not cupy.ndarray:
        return check_qkv(q, k, v, allow_dv, head_dims_checked)
    qm, km, vm = q.data, k.data, v.data
    key = (q.shape, q.strides, q.dtype, qm.device_id, k.shape, k.strides, k.dtype, km.device_id,
           v.shape, v.strides, v.dtype, vm.device_id, (qm.ptr | km.ptr | vm.ptr) % ALIGN_BYTES, allow_dv,
           head_dims_checked)
    dims = _validated_qkv.get(key)
    if dims is None:
        dims = check_qkv(q, k, v, allow_dv, head_dims_checked)
        if len(_validated_qkv) >= _VALIDATED_MAX:
            _validated_qkv.clear()
        _validated_qkv[key] = dims
    return dims


def check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"softmax_scale must be a positive finite float or None, got {type(softmax_scale).__name__}")
    s = float(softmax_scale)
    if not (math.isfinite(s) and s > 0.0):
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale}")
    return s


def check_flag(name: str, value) -> bool:
    """A boolean option (causal, return_lse, deterministic): bool or numpy.bool_. A string such as
    "false" would otherwise read as True, and a call cache keyed on the flag must not take it."""
    if type(value) is bool:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__module__}.{type(value).__name__}")


def check_out(name: str, out, shape: tuple, dtype, device_id: int) -> None:
    """A caller-supplied output buffer of exactly this shape, dtype and device."""
    check_array(name, out, ndim=len(shape))
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    check_distinct_elements(name, out)
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {out.dtype}")
    if out.device.id != device_id:
        raise ValueError(f"{name} is on device {out.device.id}, expected device {device_id}")


_validated_out: dict = {}


def check_out_cached(name: str, out, shape: tuple, dtype, device_id: int) -> None:
    """``check_out`` remembered per signature of the buffer and of what it must match."""
    cupy = _cupy()
    if type(out) is not cupy.ndarray:
        return check_out(name, out, shape, dtype, device_id)
    mem = out.data
    key = (name, out.shape, out.strides, out.dtype, mem.device_id, mem.ptr % ALIGN_BYTES, tuple(shape),
           dtype, device_id)
    _remember(_validated_out, key, check_out, name, out, shape, dtype, device_id)


def _remember(cache: dict, key: tuple, check, *args) -> None:
    """Runs ``check(*args)`` unless ``key`` (everything the check reads) passed before, then remembers it."""
    if key not in cache:
        check(*args)
        if len(cache) >= _VALIDATED_MAX:
            cache.clear()
        cache[key] = True


def check_like(name: str, x, ref_name: str, ref, shape: tuple | None = None) -> None:
    """``x`` is a CuPy array of exactly ``ref``'s shape (or ``shape``: the backward's dout and out with v's head
    dim), dtype and device (dout, out in backward; dense or packed varlen, as ``ref``)."""
    check_array(name, x, ndim=ref.ndim)
    check_same(name, x, ref_name, ref)
    if shape is None:
        if tuple(x.shape) != tuple(ref.shape):
            raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(x.shape)}")
    elif tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of {ref_name} with v's head_dim, {tuple(shape)}, got "
                         f"{tuple(x.shape)}")


def check_lse(lse, shape: tuple, device_id: int, name: str = "lse", layout: str = "(batch, heads_q, seqlen_q)") -> None:
    """The forward's log-sum-exp (or its gradient, ``name`` "dlse"): a float32 CuPy array of shape ``shape``
    (``layout`` names its dimensions: varlen's is (heads_q, total_q))."""
    cupy = _cupy()
    if not isinstance(lse, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray (float32, shape {layout} = {tuple(shape)}), "
                        f"got {type(lse).__module__}.{type(lse).__name__}")
    if lse.dtype != np.float32:
        raise TypeError(f"{name} must be float32 (as the forward returns it with return_lse=True), got {lse.dtype}")
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(lse.shape)}")
    if lse.device.id != device_id:
        raise ValueError(f"{name} is on device {lse.device.id} but q is on device {device_id}")


_validated_like: dict = {}


def check_like_cached(name: str, x, ref_name: str, ref, shape: tuple | None = None) -> None:
    """``check_like`` remembered per signature of ``x`` and of what it must match (the backward's dout
    and out, checked on every call of a training loop)."""
    cupy = _cupy()
    if type(x) is not cupy.ndarray or type(ref) is not cupy.ndarray:
        return check_like(name, x, ref_name, ref, shape)
    mem, ref_mem = x.data, ref.data
    key = (name, ref_name, x.shape, x.strides, x.dtype, mem.device_id, mem.ptr % ALIGN_BYTES, ref.shape, ref.dtype,
           ref_mem.device_id, shape)
    _remember(_validated_like, key, check_like, name, x, ref_name, ref, shape)


def check_lse_cached(lse, shape: tuple, device_id: int, name: str = "lse") -> None:
    """``check_lse`` remembered per signature."""
    cupy = _cupy()
    if type(lse) is not cupy.ndarray:
        return check_lse(lse, shape, device_id, name)
    key = (name, lse.shape, lse.dtype, lse.data.device_id, tuple(shape), device_id)
    _remember(_validated_like, key, check_lse, lse, shape, device_id, name)


def check_distinct_elements(name: str, x) -> None:
    """An output view whose elements all have addresses of their own: a stride-0 dimension (a broadcast)
    or strides that fold rows onto each other would have several results land in one place, whichever
    came last. Dimensions sorted by stride must each step past everything the smaller ones span (a
    sufficient test, exact for the nested layouts that slices and transposes make)."""
    if x.size == 0:
        return
    span = x.itemsize   # bytes covered by one element of the dimensions taken so far
    for stride, n in sorted((abs(s), n) for s, n in zip(x.strides, x.shape) if n > 1):
        if stride < span:
            raise ValueError(f"{name} must not overlap itself: its strides {x.strides} (shape {tuple(x.shape)}) "
                             f"put several elements at one address (a broadcast or stride-0 view?); pass a "
                             f"buffer of distinct elements")
        span += stride * (n - 1)


def check_no_overlap(outputs, inputs) -> None:
    """No output buffer shares memory with an array the call reads, nor with another output: the
    kernels read the inputs while they write the outputs, so an overlap gives wrong results or races.
    ``outputs`` and ``inputs`` are ``(name, array or None)`` pairs; None and non-arrays are skipped.
    Decided from the arrays' metadata (``_overlap.shares_memory``); not cached, since it depends on
    the addresses, which every call may change. Each array's byte extent is computed once and the pairs
    compared inline; only pairs whose extents intersect (views of one buffer) reach NumPy's solver."""
    ndarray = _cupy().ndarray
    given = [(n, x, extent(x)) for n, x in outputs if isinstance(x, ndarray)]
    if not given:
        return
    read = [(n, x, extent(x)) for n, x in inputs if isinstance(x, ndarray)]
    for i, (name, buf, e) in enumerate(given):
        if e is None:
            continue
        dev, lo, hi = e
        for others, doing in ((read, "reading"), (given[:i], "writing")):
            for other, x, ex in others:
                # Separate buffers (the usual case) are told apart here, without a call.
                if ex is None or ex[0] != dev or ex[2] <= lo or hi <= ex[1]:
                    continue
                if shares_memory(buf, x, e, ex):
                    raise ValueError(f"{name} overlaps {other} in memory: the kernels would write {name} while "
                                     f"{doing} {other}; pass a separate buffer")
