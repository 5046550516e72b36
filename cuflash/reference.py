"""Float64 NumPy reference for attention and its gradients.

Used by every GPU test and by the self-check of ``python -m cuflash``. Same
conventions as the kernels: layout (batch, seqlen, heads, head_dim), GQA by
sharing K/V heads, causal aligned to the bottom-right corner, lse in natural
log, rows that see no key give output 0 and lse -inf.

v's head dim Dv may differ from q's and k's Dqk (out and dout (B, Nq, Hq, Dv);
the default softmax_scale stays 1/sqrt(Dqk)), ahead of the kernels (issue #43).

Packed variable-length batches (flash-attn's ``flash_attn_varlen_func`` layout):
:func:`attention_reference_varlen` and :func:`attention_reference_varlen_backward`
take q (total_q, Hq, Dqk), k (total_k, Hkv, Dqk), v (total_k, Hkv, Dv), int32
cu_seqlens_q / cu_seqlens_k (batch + 1,) and optional seqused_q / seqused_k
(batch,); lse is packed (Hq, total_q). Each sequence is the dense reference on
its own slice; packed rows outside every used range give 0 and lse -inf.

Decoding over a KV cache (flash-attn's ``flash_attn_with_kvcache``, issue #44):
:func:`attention_reference_kvcache` appends the new keys and values to a contiguous or paged cache (after
:func:`rotary_reference`) and runs the dense reference on each sequence's keys; :func:`combine_reference`
merges split-KV partial results by their log-sum-exp.
"""
from __future__ import annotations

import math

import numpy as np


def _as_f64(x, name: str = "x") -> np.ndarray:
    """``x`` (NumPy, CuPy or array-like of real numbers) as a float64 NumPy array; TypeError naming
    the argument otherwise."""
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be an array of real numbers, got {type(x).__name__}")
    if hasattr(x, "get") and not isinstance(x, np.ndarray):  # a CuPy array
        x = x.get()
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:   # ragged nested lists and the like
        raise TypeError(f"{name} must be an array of real numbers: {e}") from None
    # Complex, objects, strings, dates and records are refused (ml_dtypes' bfloat16 / fp8 are kind 'V'
    # without fields, and convert).
    if a.dtype.kind in "cOSUMm" or a.dtype.fields is not None:
        raise TypeError(f"{name} must hold real numbers, got dtype {a.dtype}")
    try:
        return a.astype(np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must hold real numbers, got dtype {a.dtype}: {e}") from None


def _check_real_array(x, name: str) -> None:
    """An array (CuPy or NumPy: anything with a shape and a dtype) of real numbers, for the GPU reference,
    which reads its inputs where they are; TypeError naming the argument otherwise."""
    if not (hasattr(x, "shape") and hasattr(x, "ndim") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array of real numbers, got {type(x).__name__}")
    dtype = np.dtype(x.dtype)
    if dtype.kind in "cOSUMm" or dtype.fields is not None:
        raise TypeError(f"{name} must hold real numbers, got dtype {dtype}")


def _check_dims(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, int, int, int, int, int, int]:
    """The layout the kernels take, with v's head dim free: q (B, Nq, Hq, Dqk), k (B, Nk, Hkv, Dqk),
    v (B, Nk, Hkv, Dv), Hq % Hkv == 0. Returns (B, Nq, Nk, Hq, Hkv, Dqk, Dv).

    The references already take Dv != Dqk (issue #43) while the kernels' API still requires equal head
    dims, so v is checked here and the rest by the kernels' own shape checks on (q, k, k): the messages
    stay the kernels' where the rules are shared, and check_qkv_shapes keeps its meaning for the API."""
    from ._checks import check_qkv_shapes

    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), "
                             f"got shape {tuple(x.shape)}")
    if tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise ValueError(f"k and v must have the same shape (batch, seqlen_k, heads_kv) (their head dims may "
                         f"differ), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k must have the head_dim of q ({q.shape[3]}), got {k.shape[3]}")
    return (*check_qkv_shapes(q, k, k), int(v.shape[3]))


def _options(causal, softmax_scale, head_dim: int) -> tuple[bool, float]:
    from ._checks import check_flag, check_scale

    return check_flag("causal", causal), check_scale(softmax_scale, head_dim)


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool, window_size=(-1, -1), attention_chunk: int = 0,
                 xp=np, rows=None) -> np.ndarray:
    """(seqlen_q, seqlen_k) bool: key j visible from query i (``rows``: only those query rows).

    Query i sits at key position p = i + seqlen_k - seqlen_q (bottom-right alignment); it sees keys
    p - left <= j <= p + right (-1: unbounded; causal: right = 0) and, with ``attention_chunk`` c > 0, only
    keys of its own chunk: j // c == p // c."""
    left, right = window_size
    if causal:
        right = 0
    i = (xp.arange(seqlen_q) if rows is None else xp.asarray(rows))[:, None]
    j = xp.arange(seqlen_k)[None, :]
    pos = i + (seqlen_k - seqlen_q)
    ok = xp.ones((i.shape[0], seqlen_k), dtype=bool)
    if right >= 0:
        ok &= j <= pos + right
    if left >= 0:
        ok &= j >= pos - left
    if attention_chunk:
        ok &= (j // attention_chunk) == (pos // attention_chunk)   # floor division: negative positions too
    return ok


def _variant_args(causal, softmax_scale, head_dim: int, window_size, attention_chunk, softcap):
    from . import variants

    causal, scale = _options(causal, softmax_scale, head_dim)
    return (causal, scale, variants.check_window(window_size), variants.check_chunk(attention_chunk),
            variants.check_softcap(softcap))


def attention_reference(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                        window_size=None, attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes=None,
                        sinks=None, **programmable):
    """Float64 attention. q (B, Nq, Hq, Dqk), k (B, Nk, Hkv, Dqk), v (B, Nk, Hkv, Dv) -> ``(out, lse)``:
    out (B, Nq, Hq, Dv), lse (B, Hq, Nq); Dv may differ from Dqk, softmax_scale defaults to 1/sqrt(Dqk). The variants as :func:`cuflash.forward` takes them: the scaled score s = softmax_scale q.k
    becomes softcap * tanh(s / softcap), then s - slope * |i + Nk - Nq - j| (ALiBi; slopes (Hq,) or (B, Hq)),
    then the window / chunk / causal masks; a sink (Hq,) joins each row's denominator (lse includes it).
    ``programmable``: :class:`Programmable`'s fields (bias, dropout, block mask, score and mask modifiers)."""
    q, k, v = _as_f64(q, "q"), _as_f64(k, "k"), _as_f64(v, "v")
    return _reference_by_chunks(np, q, k, v, None, causal, softmax_scale, q.shape[1] or 1, window_size,
                                attention_chunk, softcap, alibi_slopes, sinks, programmable=programmable)


def attention_reference_backward(dout, q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                                 window_size=None, attention_chunk: int = 0, softcap: float = 0.0,
                                 alibi_slopes=None, sinks=None, dlse=None, **programmable):
    """Float64 gradients ``(dq, dk, dv)`` of attention, shaped like q, k, v (GQA heads summed), then
    ``dsinks`` (Hq,) with ``sinks`` and ``dbias`` (the bias's shape, summed over its broadcast dims) with a
    bias; dout (B, Nq, Hq, Dv) (v's head dim); ``dlse`` (B, Hq, Nq): the gradient of lse too. Variants and
    ``programmable`` as in :func:`attention_reference`."""
    dout, q, k, v = _as_f64(dout, "dout"), _as_f64(q, "q"), _as_f64(k, "k"), _as_f64(v, "v")
    res = _reference_by_chunks(np, q, k, v, dout, causal, softmax_scale, q.shape[1] or 1, window_size,
                               attention_chunk, softcap, alibi_slopes, sinks, dlse, programmable=programmable)
    return res[2:]


def attention_reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_q=None, seqused_k=None,
                               causal: bool = False, softmax_scale: float | None = None, window_size=None,
                               attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes=None, sinks=None,
                               **programmable):
    """Float64 attention on a packed variable-length batch (flash-attn's ``flash_attn_varlen_func`` layout)
    -> ``(out, lse)``.

    q (total_q, Hq, Dqk), k (total_k, Hkv, Dqk), v (total_k, Hkv, Dv); cu_seqlens_q / cu_seqlens_k
    (batch + 1,) integer cumulative offsets (NumPy or CuPy), non-decreasing, within total_q / total_k;
    seqused_q / seqused_k (batch,): sequence b uses only the first seqused[b] rows / keys of its packed
    range (default: all of it). Sequence b is :func:`attention_reference` on its own slices, rows
    [cu_seqlens_q[b], + used_q) and keys [cu_seqlens_k[b], + used_k), shaped (1, n, H, D): causal, windows
    and chunks aligned bottom-right per sequence; alibi_slopes (Hq,) or (batch, Hq) (row b for sequence b),
    sinks (Hq,). Returns out (total_q, Hq, Dv) and lse (Hq, total_q), both float64. Packed rows that belong
    to no sequence's used range get out 0 and lse -inf: the kernels leave them untouched, so tests compare
    the used rows alone. ``programmable``: :class:`Programmable`'s fields at the padded shape (batch, Hq,
    max_q, max_k) (max_q, max_k: the longest used lengths, or the bias's / dropout mask's / block mask's own):
    sequence b is the dense reference with bias, dropout mask and block mask at batch index b over its own
    positions, and modifiers called with b."""
    q, k, v = _as_f64(q, "q"), _as_f64(k, "k"), _as_f64(v, "v")
    return _varlen(None, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, None,
                   dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                        attention_chunk=attention_chunk, softcap=softcap), alibi_slopes, sinks, programmable)


def attention_reference_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_q=None,
                                        seqused_k=None, causal: bool = False, softmax_scale: float | None = None,
                                        window_size=None, attention_chunk: int = 0, softcap: float = 0.0,
                                        alibi_slopes=None, sinks=None, dlse=None, **programmable):
    """Float64 gradients of :func:`attention_reference_varlen` -> ``(dq, dk, dv)``, packed like q, k, v
    ((total_q, Hq, Dqk), (total_k, Hkv, Dqk), (total_k, Hkv, Dv)), and with ``sinks`` ``(dq, dk, dv,
    dsinks)``, dsinks (Hq,) summed over the sequences. dout (total_q, Hq, Dv); ``dlse`` (Hq, total_q): the
    gradient of the packed lse too. Rows and keys outside every sequence's used range get zero gradients.
    Each sequence is :func:`attention_reference_backward` on its own slices; with a bias, ``dbias`` (its shape,
    summed over the sequences) follows, as the dense reference returns it."""
    dout, q, k, v = _as_f64(dout, "dout"), _as_f64(q, "q"), _as_f64(k, "k"), _as_f64(v, "v")
    dlse = None if dlse is None else _as_f64(dlse, "dlse")
    return _varlen(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, dlse,
                   dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                        attention_chunk=attention_chunk, softcap=softcap), alibi_slopes, sinks, programmable)


def _int_array(x, name: str, ndim: int | None, kind: str = "an array") -> np.ndarray:
    """``x`` (NumPy, CuPy or a list) as an int64 NumPy array of ``ndim`` dimensions (None: any); TypeError / ValueError
    naming it (``kind``: how the messages call it). Any integer dtype is taken here (the kernels' int32 is the API's
    rule, not the reference's); bool, floats and objects are refused: offsets and positions are exact integers."""
    if hasattr(x, "get") and not isinstance(x, np.ndarray):  # a CuPy array
        x = x.get()
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be {kind} of integers: {e}") from None
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be {kind} of integers (int32 for the kernels), got dtype {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    return a.astype(np.int64)


def _index_array(x, name: str) -> np.ndarray:
    """``x`` (NumPy, CuPy or a list) as a 1-D int64 NumPy array; TypeError / ValueError naming it."""
    return _int_array(x, name, 1, "a 1-D array")


def _varlen_ranges(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, total_q: int,
                   total_k: int) -> list[tuple[int, int, int, int]]:
    """Per sequence (first row, used rows, first key, used keys), after the light checks on the offsets."""
    cus = {}
    for name, x, total in (("cu_seqlens_q", cu_seqlens_q, total_q), ("cu_seqlens_k", cu_seqlens_k, total_k)):
        cu = _index_array(x, name)
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must have length batch + 1 >= 1, got length 0")
        if cu[0] < 0:
            raise ValueError(f"{name} must start at an offset >= 0, got {int(cu[0])}")
        if np.any(np.diff(cu) < 0):
            raise ValueError(f"{name} must be non-decreasing (cumulative offsets), got {cu.tolist()}")
        if cu[-1] > total:
            raise ValueError(f"{name} ends at {int(cu[-1])}, past the {total} packed rows of its tensor")
        cus[name] = cu
    cu_q, cu_k = cus["cu_seqlens_q"], cus["cu_seqlens_k"]
    batch = cu_q.shape[0] - 1
    if cu_k.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_k must have length batch + 1 = {batch + 1} (that of cu_seqlens_q), "
                         f"got {cu_k.shape[0]}")
    used = {}
    for name, x, cu in (("seqused_q", seqused_q, cu_q), ("seqused_k", seqused_k, cu_k)):
        lens = np.diff(cu)
        if x is None:
            used[name] = lens
            continue
        u = _index_array(x, name)
        if u.shape[0] != batch:
            raise ValueError(f"{name} must have length batch = {batch}, got {u.shape[0]}")
        if np.any(u < 0) or np.any(u > lens):   # a sequence uses a prefix of its own packed range
            raise ValueError(f"{name} must lie in [0, the packed lengths {lens.tolist()}], got {u.tolist()}")
        used[name] = u
    return [(int(cu_q[b]), int(used["seqused_q"][b]), int(cu_k[b]), int(used["seqused_k"][b]))
            for b in range(batch)]


def _batch_row(x4: np.ndarray, b: int) -> slice:
    """Batch index b of a (B or 1, ...) array as a slice (its one row where broadcast)."""
    return slice(b, b + 1) if x4.shape[0] > 1 else slice(0, 1)


def _sequence_programmable(given: dict, b: int, nq: int, nk: int) -> dict:
    """The dense reference's programmable fields for sequence ``b`` of a varlen batch (nq rows, nk keys): the
    bias, dropout mask and block mask at batch index b (or their broadcast 1) over the sequence's own positions,
    the modifiers called with b."""
    seq = dict(given)
    for name in ("bias", "dropout_mask"):
        if given.get(name) is not None:
            x = _as_f64(given[name], name) if name == "bias" else np.asarray(
                given[name].get() if hasattr(given[name], "get") else given[name])
            x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
            seq[name] = x4[_batch_row(x4, b), :, :nq if x4.shape[2] > 1 else 1, :nk if x4.shape[3] > 1 else 1]
    if given.get("block_mask") is not None:
        bs = 128 if given.get("block_size") is None else given["block_size"]
        bq, bk = (bs, bs) if isinstance(bs, int) else tuple(bs)
        m = np.asarray(given["block_mask"].get() if hasattr(given["block_mask"], "get") else given["block_mask"])
        seq["block_mask"] = m[_batch_row(m, b), :, :-(-nq // bq), :-(-nk // bk)]
    for name in ("score_mod", "score_mod_grad", "dscore_hook", "mask_mod"):
        f = given.get(name)
        if f is not None:
            seq[name] = (lambda f_: lambda *a: f_(*a[:-4], b, *a[-3:]))(f)
    return seq


def _varlen(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, dlse, options: dict,
            alibi_slopes, sinks, programmable: dict | None = None):
    """The varlen references (forward when ``dout`` is None): the dense reference sequence by sequence,
    so that their semantics are the dense ones by construction."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_seqlen, heads, head_dim), "
                             f"got shape {tuple(x.shape)}")
    _, total_q, total_k, hq, hkv, d, dv_ = _check_dims(q[None], k[None], v[None])
    _variant_args(options["causal"], options["softmax_scale"], d, options["window_size"],
                  options["attention_chunk"], options["softcap"])   # checked even when no sequence runs
    ranges = _varlen_ranges(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, total_q, total_k)
    batch = len(ranges)
    slopes = None if alibi_slopes is None else _as_f64(alibi_slopes, "alibi_slopes")
    if slopes is not None and slopes.shape not in ((hq,), (batch, hq)):
        raise ValueError(f"alibi_slopes must have shape ({hq},) or ({batch}, {hq}), got {slopes.shape}")
    sink = None if sinks is None else _as_f64(sinks, "sinks")
    if sink is not None and sink.shape != (hq,):
        raise ValueError(f"sinks must have shape ({hq},), got {sink.shape}")
    if dout is not None and dout.shape != (total_q, hq, dv_):
        raise ValueError(f"dout must have the shape of q with v's head_dim, {(total_q, hq, dv_)}, "
                         f"got {dout.shape}")
    if dlse is not None and dlse.shape != (hq, total_q):
        raise ValueError(f"dlse must have the packed shape of lse (heads_q, total_q) = {(hq, total_q)}, "
                         f"got {dlse.shape}")
    programmable = programmable or {}
    bias = None if programmable.get("bias") is None else _as_f64(programmable["bias"], "bias")
    out, lse = np.zeros((total_q, hq, dv_)), np.full((hq, total_q), -np.inf)
    if dout is not None:
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        dsinks = None if sink is None else np.zeros(hq)
        dbias4 = None if bias is None else np.zeros((1,) * (4 - bias.ndim) + bias.shape)
    for b, (r0, nq, c0, nk) in enumerate(ranges):
        rows, keys = slice(r0, r0 + nq), slice(c0, c0 + nk)
        kw = dict(options, sinks=sink,
                  alibi_slopes=None if slopes is None else slopes if slopes.ndim == 1 else slopes[b:b + 1],
                  **_sequence_programmable(programmable, b, nq, nk))
        qs, ks, vs = q[None, rows], k[None, keys], v[None, keys]
        if dout is None:
            o, l_ = attention_reference(qs, ks, vs, **kw)
            out[rows], lse[:, rows] = o[0], l_[0]
            continue
        g = attention_reference_backward(dout[None, rows], qs, ks, vs,
                                         dlse=None if dlse is None else dlse[None, :, rows], **kw)
        # The used ranges are disjoint (non-decreasing offsets, prefixes of each range): plain stores.
        dq[rows], dk[keys], dv[keys] = g[0][0], g[1][0], g[2][0]
        if dsinks is not None:
            dsinks += g[3]
        if dbias4 is not None:   # the sequence's dbias, in its slice's shape, summed into the whole
            part = g[-1]
            dbias4[_batch_row(dbias4, b), :, :part.shape[2], :part.shape[3]] += part
    if dout is None:
        return out, lse
    return (dq, dk, dv) + ((dsinks,) if dsinks is not None else ()) + \
        ((dbias4.reshape(bias.shape),) if bias is not None else ())


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64; NaN or inf anywhere in x gives inf."""
    x, ref = _as_f64(x), _as_f64(ref)
    if not np.all(np.isfinite(x)):
        return math.inf
    denom = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((x - ref).ravel())
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return float(num / denom)


def _chunk_rows(seqlen_k: int, chunk_rows: int | None) -> int:
    """Query rows per chunk: about 2^26 scores (512 MiB of float64) at a time unless told."""
    if chunk_rows is not None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        return chunk_rows
    return max(1, min(4096, (1 << 26) // max(seqlen_k, 1)))


def attention_reference_chunked(q, k, v, dout=None, *, causal: bool = False, softmax_scale: float | None = None,
                                chunk_rows: int | None = None, window_size=None, attention_chunk: int = 0,
                                softcap: float = 0.0, alibi_slopes=None, sinks=None, dlse=None):
    """Float64 attention (and, given ``dout``, its gradients) on the GPU, a chunk of query rows at a time,
    so that long sequences never hold the whole score matrix.

    Inputs are CuPy arrays in the kernels' layout (any float dtype; strided views are fine; v's head dim
    may differ from q's and k's, out and dout then have v's) and the
    conventions (variants included) are :func:`attention_reference`'s. Returns CuPy float64 ``(out, lse)``,
    or ``(out, lse, dq, dk, dv)`` with ``dout`` (and ``dsinks`` last with ``sinks``); rows that see no key
    give 0, lse -inf (or their sink) and zero gradients. ``chunk_rows``: query rows per chunk (default: about
    2^26 scores a chunk). Its products are CuPy's matmuls where cuBLAS is installed (the bench extras);
    without it the same chunks are computed with NumPy on the host (slower, the same results), so that no
    check needs cuBLAS.
    """
    import cupy

    from .bench import cublas_missing

    args = (causal, softmax_scale, chunk_rows, window_size, attention_chunk, softcap, alibi_slopes, sinks)
    if cublas_missing() is None:
        return _reference_by_chunks(cupy, q, k, v, dout, *args, dlse)
    _reference_by_chunks(np, *(_meta(x) for x in (q, k, v, dout)), *args)   # the checks, before any copy
    host = [None if x is None else cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else x for x in (q, k, v, dout, dlse)]
    return tuple(cupy.asarray(x) for x in _reference_by_chunks(np, *host[:4], *args, host[4]))


class _Meta:
    """An array's shape and dtype alone: the references' argument checks run on it without data."""

    def __init__(self, x):
        self.shape, self.ndim, self.dtype = tuple(x.shape), x.ndim, x.dtype


def _meta(x):
    """A stand-in with x's metadata; anything that is not an array as it is (the checks reject it)."""
    return _Meta(x) if hasattr(x, "shape") and hasattr(x, "ndim") and hasattr(x, "dtype") else x


def _broadcast_4d(x: np.ndarray, name: str, full: tuple) -> np.ndarray:
    """``x`` as 4 dims, each 1 or that of ``full`` (B, Hq, Nq, Nk), NumPy's rule (missing leading dims are 1)."""
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dimensions (batch, heads_q, seqlen_q, seqlen_k), "
                         f"got shape {x.shape}")
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if any(n not in (1, f) for n, f in zip(x4.shape, full)):
        raise ValueError(f"{name} must broadcast to (batch, heads_q, seqlen_q, seqlen_k) = {full} (each dim 1 or "
                         f"that size), got shape {x.shape}")
    return x4


class Programmable:
    """The reference's programmable attention (issue #45), checked once; every field optional.

    - ``bias``: float, broadcastable to (B, Hq, Nq, Nk); added to the score after softcap and ALiBi. The
      backward returns dbias in its own shape (summed over the broadcast dims).
    - ``dropout_p`` with ``dropout_mask``: bool keep mask broadcastable to (B, Hq, Nq, Nk) (the kernels' own:
      :func:`cuflash.philox.dropout_keep_mask`); kept probabilities are divided by 1 - dropout_p, lse is that
      of the undropped ones.
    - ``block_mask``: bool (B or 1, Hq or 1, ceil(Nq / bq), ceil(Nk / bk)) with ``block_size`` bq or (bq, bk)
      (default 128): keys in off blocks are hidden.
    - ``score_mod(score, b, h, q_idx, kv_idx)``: the modified score (float64 arrays: score (rows, Nk), q_idx
      (rows, 1), kv_idx (1, Nk); b, h ints), after the bias; ``score_mod_grad`` (same arguments): its
      derivative by the score, for the backward; ``dscore_hook(dscore, b, h, q_idx, kv_idx)``: called by the
      backward with the gradient of the modifier's output (zero where hidden), for the gradients of the tensors
      a modifier reads.
    - ``mask_mod(b, h, q_idx, kv_idx)``: bool, True where key kv_idx is visible from row q_idx.
    """

    FIELDS = ("bias", "dropout_p", "dropout_mask", "block_mask", "block_size", "score_mod", "score_mod_grad",
              "dscore_hook", "mask_mod")

    def __init__(self, given: dict, full: tuple):
        unknown = sorted(set(given) - set(self.FIELDS))
        if unknown:
            raise TypeError(f"unknown argument(s) {unknown}; the reference takes {list(self.FIELDS)}")
        g = {name: given.get(name) for name in self.FIELDS}
        b, hq, nq, nk = full
        self.bias_shape = None
        self.bias = None
        if g["bias"] is not None:
            bias = _as_f64(g["bias"], "bias")
            self.bias_shape = bias.shape
            self.bias = _broadcast_4d(bias, "bias", full)
        p = 0.0 if g["dropout_p"] is None else float(g["dropout_p"])
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {g['dropout_p']!r}")
        self.keep = None
        if p > 0.0:
            if g["dropout_mask"] is None:
                raise ValueError("dropout_p > 0 needs dropout_mask (cuflash.philox.dropout_keep_mask gives the "
                                 "kernels' own)")
            mask = np.asarray(g["dropout_mask"].get() if hasattr(g["dropout_mask"], "get") else g["dropout_mask"])
            if mask.dtype != np.bool_:
                raise TypeError(f"dropout_mask must be a bool array, got dtype {mask.dtype}")
            self.keep = _broadcast_4d(mask, "dropout_mask", full) / (1.0 - p)
        self.block = None
        if g["block_mask"] is not None:
            bs = 128 if g["block_size"] is None else g["block_size"]
            bq, bk = (bs, bs) if isinstance(bs, int) else tuple(bs)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (bq, bk)):
                raise ValueError(f"block_size must be a positive int or a pair of them, got {bs!r}")
            mask = np.asarray(g["block_mask"].get() if hasattr(g["block_mask"], "get") else g["block_mask"])
            want = (-(-nq // bq), -(-nk // bk))
            if mask.dtype != np.bool_ or mask.ndim != 4 or mask.shape[0] not in (1, b) or \
                    mask.shape[1] not in (1, hq) or mask.shape[2:] != want:
                raise ValueError(f"block_mask must be bool ({b} or 1, {hq} or 1, {want[0]}, {want[1]}), got "
                                 f"{mask.dtype} {mask.shape}")
            self.block, self.block_size = mask, (bq, bk)
        for name in ("score_mod", "score_mod_grad", "dscore_hook", "mask_mod"):
            if g[name] is not None and not callable(g[name]):
                raise TypeError(f"{name} must be callable, got {type(g[name]).__name__}")
        self.score_mod, self.score_mod_grad = g["score_mod"], g["score_mod_grad"]
        self.dscore_hook, self.mask_mod = g["dscore_hook"], g["mask_mod"]
        self.dbias = None

    def start_backward(self) -> None:
        if self.score_mod is not None and self.score_mod_grad is None:
            raise ValueError("the backward of a score_mod needs score_mod_grad (its derivative by the score)")
        if self.bias is not None:
            self.dbias = np.zeros(self.bias.shape)

    @staticmethod
    def _rows(x4: np.ndarray, bi: int, h: int, r0: int, r1: int) -> np.ndarray:
        """x4's (rows, Nk or 1) slice for (bi, h, rows r0:r1), broadcast dims at index 0."""
        return x4[bi if x4.shape[0] > 1 else 0, h if x4.shape[1] > 1 else 0,
                  slice(r0, r1) if x4.shape[2] > 1 else slice(0, 1)]

    def modify(self, xp, s, bi: int, h: int, r0: int, r1: int, keys):
        """(scores after the bias and the score modifier, the modifier's input or None)."""
        if self.bias is not None:
            s = s + xp.asarray(self._rows(self.bias, bi, h, r0, r1))
        before = None
        if self.score_mod is not None:
            before = s
            s = xp.asarray(self.score_mod(s, bi, h, xp.arange(r0, r1)[:, None], keys), dtype=xp.float64)
        return s, before

    def visible(self, xp, vis, bi: int, h: int, r0: int, r1: int, nk: int, keys):
        if self.block is not None:
            bq, bk = self.block_size
            blk = xp.asarray(self.block[bi if self.block.shape[0] > 1 else 0, h if self.block.shape[1] > 1 else 0])
            vis = vis & blk[(xp.arange(r0, r1) // bq)[:, None], (xp.arange(nk) // bk)[None, :]]
        if self.mask_mod is not None:
            vis = vis & xp.asarray(self.mask_mod(bi, h, xp.arange(r0, r1)[:, None], keys), dtype=bool)
        return vis

    def dropped(self, xp, p, bi: int, h: int, r0: int, r1: int):
        return p if self.keep is None else p * xp.asarray(self._rows(self.keep, bi, h, r0, r1))

    def backward_scores(self, xp, ds, before, vis, bi: int, h: int, r0: int, r1: int, keys):
        """The gradient of the score before the bias from that of the modifier's output ``ds``; dbias summed."""
        if self.dscore_hook is not None:
            self.dscore_hook(ds, bi, h, xp.arange(r0, r1)[:, None], keys)
        if self.score_mod is not None:
            grad = xp.asarray(self.score_mod_grad(before, bi, h, xp.arange(r0, r1)[:, None], keys), dtype=xp.float64)
            ds = xp.where(vis, ds * grad, 0.0)
        if self.dbias is not None:
            shape = self.bias.shape
            part = ds.sum(axis=0, keepdims=True) if shape[2] == 1 else ds
            part = part.sum(axis=1, keepdims=True) if shape[3] == 1 else part
            part = part.get() if hasattr(part, "get") else part
            self.dbias[bi if shape[0] > 1 else 0, h if shape[1] > 1 else 0,
                       slice(r0, r1) if shape[2] > 1 else slice(0, 1)] += part
        return ds

    def dbias_result(self) -> np.ndarray:
        return self.dbias.reshape(self.bias_shape)


def _reference_by_chunks(xp, q, k, v, dout, causal, softmax_scale, chunk_rows, window_size=None,
                         attention_chunk=0, softcap=0.0, alibi_slopes=None, sinks=None, dlse=None, programmable=None):
    """attention_reference_chunked with the array module ``xp`` (CuPy; NumPy for the CPU references)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if x is not None or name != "dout":
            _check_real_array(x, name)
    b, nq, nk, hq, hkv, d, dv_ = _check_dims(q, k, v)
    causal, scale, window, chunk, cap = _variant_args(causal, softmax_scale, d, window_size, attention_chunk,
                                                      softcap)
    if dout is not None and tuple(dout.shape) != (b, nq, hq, dv_):
        raise ValueError(f"dout must have the shape of q with v's head_dim, {(b, nq, hq, dv_)}, "
                         f"got {tuple(dout.shape)}")
    slopes = None if alibi_slopes is None else _host_f64(alibi_slopes, "alibi_slopes")
    if slopes is not None:
        if slopes.shape not in ((hq,), (b, hq)):
            raise ValueError(f"alibi_slopes must have shape ({hq},) or ({b}, {hq}), got {slopes.shape}")
        slopes = np.broadcast_to(slopes, (b, hq))
    sink = None if sinks is None else _host_f64(sinks, "sinks")
    if sink is not None and sink.shape != (hq,):
        raise ValueError(f"sinks must have shape ({hq},), got {sink.shape}")
    dlse_h = None if dlse is None else xp.asarray(dlse, xp.float64)
    rows = _chunk_rows(nk, chunk_rows)
    prog = Programmable(programmable or {}, (b, hq, nq, nk))
    if isinstance(q, _Meta):   # the checks alone (attention_reference_chunked without cuBLAS)
        return None
    f64, group = xp.float64, hq // hkv
    out, lse = xp.zeros((b, nq, hq, dv_), f64), xp.full((b, hq, nq), -xp.inf, f64)
    grads = None if dout is None else (xp.zeros((b, nq, hq, d), f64), xp.zeros((b, nk, hkv, d), f64),
                                       xp.zeros((b, nk, hkv, dv_), f64))
    dsinks = np.zeros(hq) if (grads is not None and sink is not None) else None
    if grads is not None:
        prog.start_backward()
    keys = xp.arange(nk)[None, :]
    for bi in range(b):
        for h in range(hq):
            kh, vh = xp.asarray(k[bi, :, h // group], f64), xp.asarray(v[bi, :, h // group], f64)
            qh = xp.asarray(q[bi, :, h], f64)
            for r0 in range(0, nq, rows):
                r1 = min(nq, r0 + rows)
                s = (qh[r0:r1] @ kh.T) * scale
                grad_mod = None
                if cap:
                    t = xp.tanh(s / cap)
                    s = cap * t
                    grad_mod = 1.0 - t * t
                if slopes is not None:
                    pos = xp.arange(r0, r1)[:, None] + (nk - nq)
                    s = s - float(slopes[bi, h]) * xp.abs(pos - keys)
                s, before_mod = prog.modify(xp, s, bi, h, r0, r1, keys)
                vis = visible_mask(nq, nk, causal, window, chunk, xp=xp, rows=xp.arange(r0, r1))
                vis = prog.visible(xp, vis, bi, h, r0, r1, nk, keys)
                s = xp.where(vis, s, -xp.inf)
                m = s.max(axis=1, keepdims=True) if nk else xp.full((r1 - r0, 1), -xp.inf, f64)
                if sink is not None:
                    m = xp.maximum(m, float(sink[h]))
                m = xp.where(xp.isfinite(m), m, 0.0)   # rows that see no key (and no sink): every p is 0
                p = xp.exp(s - m)
                total = p.sum(axis=1, keepdims=True)
                if sink is not None:
                    total = total + xp.exp(float(sink[h]) - m)
                seen = total > 0
                p /= xp.where(seen, total, 1.0)
                p_dropped = prog.dropped(xp, p, bi, h, r0, r1)
                o = p_dropped @ vh
                out[bi, r0:r1, h] = o
                row_lse = xp.where(seen, xp.log(xp.where(seen, total, 1.0)) + m, -xp.inf)[:, 0]
                lse[bi, h, r0:r1] = row_lse
                if grads is not None:
                    dq, dk, dv = grads
                    do = xp.asarray(dout[bi, r0:r1, h], f64)
                    dv[bi, :, h // group] += p_dropped.T @ do
                    delta = (do * o).sum(axis=1, keepdims=True)
                    if dlse_h is not None:
                        delta = delta - dlse_h[bi, h, r0:r1][:, None]
                    # dP through the dropout mask: d out / d p = keep / (1 - p) * (dout . v); delta = rowsum(dP * p).
                    ds = p * (prog.dropped(xp, do @ vh.T, bi, h, r0, r1) - delta)
                    if sink is not None:   # d lse / d sink = P(sink); d out / d sink = -P(sink) out
                        p_sink = xp.exp(float(sink[h]) - row_lse)
                        dsinks[h] -= float((p_sink * delta[:, 0]).sum())
                    ds = prog.backward_scores(xp, ds, before_mod, vis, bi, h, r0, r1, keys)
                    if grad_mod is not None:
                        ds = ds * grad_mod
                    dq[bi, r0:r1, h] = scale * (ds @ kh)
                    dk[bi, :, h // group] += scale * (ds.T @ qh[r0:r1])
    if grads is None:
        return out, lse
    return ((out, lse, *grads) + ((dsinks,) if dsinks is not None else ())
            + ((prog.dbias_result(),) if prog.dbias is not None else ()))


def _host_f64(x, name: str) -> np.ndarray:
    return _as_f64(x, name)


# ---------------------------------------------------------------------------
# Decoding with a KV cache (issue #44): flash-attn 2's ``flash_attn_with_kvcache``, and the combination of
# split-KV partial results.


def rotary_reference(x, cos, sin, positions, interleaved: bool = True) -> np.ndarray:
    """Rotary embedding in float64: x (..., seqlen, heads, d), cos / sin (seqlen_ro, rotary_dim // 2),
    integer ``positions`` broadcastable to x.shape[:-2] (for instance (batch, seqlen)): the position of each
    token, the row of cos / sin it takes. Returns x rotated (float64, x's shape).

    Pair i of a token at position p turns by the angle whose cosine and sine are cos[p, i] and sin[p, i]:
    (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos). ``interleaved`` (GPT-J): the pairs are (x[2i], x[2i + 1]);
    otherwise (GPT-NeoX, half split) (x[i], x[i + rotary_dim / 2]). Columns from rotary_dim on are untouched."""
    x, cos, sin = _as_f64(x, "x"), _as_f64(cos, "rotary_cos"), _as_f64(sin, "rotary_sin")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (..., heads, head_dim), got shape {x.shape}")
    if cos.ndim != 2 or cos.shape[1] < 1:
        raise ValueError(f"rotary_cos must have shape (seqlen_ro, rotary_dim // 2) with rotary_dim >= 2, "
                         f"got {cos.shape}")
    if sin.shape != cos.shape:
        raise ValueError(f"rotary_sin must have the shape of rotary_cos {cos.shape}, got {sin.shape}")
    half = cos.shape[1]
    rd = 2 * half
    if rd > x.shape[-1]:
        raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {rd}) must be <= head_dim ({x.shape[-1]})")
    pos = _int_array(positions, "positions", None)
    try:
        shape = np.broadcast_shapes(pos.shape, x.shape[:-2])
    except ValueError:
        shape = None
    if shape != x.shape[:-2]:
        raise ValueError(f"positions {pos.shape} must broadcast to x's leading dims {x.shape[:-2]}")
    if pos.size and (pos.min() < 0 or pos.max() >= cos.shape[0]):
        raise ValueError(f"positions must lie in [0, seqlen_ro = {cos.shape[0]}) (the rows of rotary_cos), got "
                         f"[{int(pos.min())}, {int(pos.max())}]")
    c, s = cos[pos][..., None, :], sin[pos][..., None, :]   # (..., seqlen, 1, rotary_dim // 2): every head
    out = x.copy()
    first, second = (slice(0, rd, 2), slice(1, rd, 2)) if interleaved else (slice(0, half), slice(half, rd))
    x0, x1 = x[..., first], x[..., second]
    out[..., first] = x0 * c - x1 * s
    out[..., second] = x0 * s + x1 * c
    return out


def attention_reference_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, rotary_cos=None,
                                rotary_sin=None, rotary_interleaved: bool = True, cache_batch_idx=None,
                                block_table=None, causal: bool = False, window_size=(-1, -1),
                                softcap: float = 0.0, alibi_slopes=None, sinks=None, attention_chunk: int = 0,
                                softmax_scale: float | None = None, rotary_dtype=None,
                                round_rotated_q: bool = True, cache_leftpad=None, stored=None):
    """Float64 decoding attention over a KV cache, as flash-attn 2's ``flash_attn_with_kvcache``
    -> ``(out, lse, k_cache_after, v_cache_after)``.

    q (B, Nq, Hq, Dqk). Contiguous cache: k_cache (B_cache, S_cache, Hkv, Dqk), v_cache (..., Dv), sequence b
    in row b (or ``cache_batch_idx[b]``). Paged cache (``block_table`` (B, max_blocks) given): k_cache
    (num_blocks, page_size, Hkv, Dqk), key j of sequence b at k_cache[block_table[b, j // page_size],
    j % page_size]. ``cache_seqlens``: an int or integers (B,), the keys already cached per sequence.
    ``k``, ``v`` (B, Nnew, Hkv, Dqk / Dv), optional together: appended at positions cache_seqlens[b] ..
    cache_seqlens[b] + Nnew - 1 (in the returned caches; the arguments are not modified). Attention then
    runs over the cache_seqlens[b] + Nnew first keys of each sequence, as :func:`attention_reference` on
    that sequence alone (bottom-right causal / window / chunk alignment, ALiBi slopes (Hq,) or row b of
    (B, Hq), sinks (Hq,)); a sequence with no key gives out 0 and lse -inf (its sink's logit with ``sinks``).

    ``rotary_cos`` / ``rotary_sin`` (seqlen_ro, rotary_dim // 2): :func:`rotary_reference` on q and on the
    new k (style ``rotary_interleaved``). New key i sits at position cache_seqlens[b] + i; query t at
    cache_seqlens[b] + t when causal or a window is set (any window bound >= 0), else every query at
    cache_seqlens[b]. ``rotary_dtype`` (a NumPy dtype, e.g. float16 or ml_dtypes.bfloat16): the rotated new k
    are rounded to it, as the cache stores them, and so is the rotated q unless ``round_rotated_q`` is False
    (flash-attn's kernels keep it in q's dtype; a kernel may keep it in float32); None: exact.

    ``cache_leftpad`` (integers (B,), 0 <= cache_leftpad[b] <= cache_seqlens[b]): sequence b's keys start at cache
    position cache_leftpad[b] (flash-attn's left-padded caches): it attends to positions cache_leftpad[b] ..
    cache_seqlens[b] + Nnew - 1, and its rotary positions count from cache_leftpad[b]; appends still go to
    cache_seqlens[b] ..

    ``stored``: None, or a callable ``(b, k_new, v_new) -> (k_kept, v_kept)`` giving the values the cache keeps of
    sequence b's new tokens (after the rotary embedding), which the attention then reads (an fp8 cache's e4m3
    rounding).

    Returns out (B, Nq, Hq, Dv), lse (B, Hq, Nq) and the caches after the append, in their own layout, all
    float64 NumPy. Two sequences may not write the same cache slot, nor may a sequence read a slot that
    another one writes (a paged cache shared between sequences): ValueError, as for keys past a
    sequence's capacity."""
    q, kc, vc = _as_f64(q, "q"), _as_f64(k_cache, "k_cache"), _as_f64(v_cache, "v_cache")
    for name, x in (("q", q), ("k_cache", kc), ("v_cache", vc)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {x.shape}")
    b, nq, hq, d = q.shape
    if kc.shape[:3] != vc.shape[:3]:
        raise ValueError(f"k_cache and v_cache must agree in all but the head dim, got {kc.shape} and {vc.shape}")
    if kc.shape[3] != d:
        raise ValueError(f"k_cache must have the head_dim of q ({d}), got {kc.shape[3]}")
    hkv, dv = kc.shape[2], vc.shape[3]
    from ._checks import check_heads

    check_heads(hq, hkv)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values) or not at all")
    nnew = 0
    if k is not None:
        k, v = _as_f64(k, "k"), _as_f64(v, "v")
        if k.ndim != 4 or k.shape != (b, k.shape[1], hkv, d):
            raise ValueError(f"k must have shape (batch {b}, seqlen_new, heads_kv {hkv}, head_dim {d}), "
                             f"got {k.shape}")
        if v.shape != (b, k.shape[1], hkv, dv):
            raise ValueError(f"v must have shape {(b, k.shape[1], hkv, dv)}, got {v.shape}")
        nnew = k.shape[1]

    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        lens = np.full(b, int(cache_seqlens), np.int64)
    else:
        lens = _int_array(cache_seqlens, "cache_seqlens", 1)
        if lens.shape != (b,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({b},), got {lens.shape}")
    if np.any(lens < 0):
        raise ValueError(f"cache_seqlens must be >= 0, got {lens.tolist()}")
    total = lens + nnew
    pads = np.zeros(b, np.int64)
    if cache_leftpad is not None:
        pads = _int_array(cache_leftpad, "cache_leftpad", 1)
        if pads.shape != (b,) or np.any(pads < 0) or np.any(pads > lens):
            raise ValueError(f"cache_leftpad must be (batch,) integers in [0, cache_seqlens], got {pads.tolist()}")

    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx applies to a contiguous cache, not with block_table")
        table = _int_array(block_table, "block_table", 2)
        if table.shape[0] != b:
            raise ValueError(f"block_table must have shape (batch {b}, max_blocks), got {table.shape}")
        page = kc.shape[1]
        if page < 1:
            raise ValueError("k_cache's page_size (dim 1) must be >= 1")
        capacity = table.shape[1] * page
    else:
        rows = np.arange(b) if cache_batch_idx is None else _int_array(cache_batch_idx, "cache_batch_idx", 1)
        if rows.shape != (b,):
            raise ValueError(f"cache_batch_idx must have shape (batch,) = ({b},), got {rows.shape}")
        if b and (rows.min() < 0 or rows.max() >= kc.shape[0]):
            raise ValueError(f"cache_batch_idx must lie in [0, batch_cache = {kc.shape[0]}), got {rows.tolist()}")
        capacity = kc.shape[1]
    if np.any(total > capacity):
        raise ValueError(f"cache_seqlens + seqlen_new ({total.tolist()}) must be <= the cache's capacity per "
                         f"sequence ({capacity})")

    def slots(bi: int, lo: int, hi: int) -> np.ndarray:
        """Flat cache slots (cache row or block) * slots per row + offset of keys lo .. hi - 1 of sequence bi."""
        j = np.arange(lo, hi)
        if not paged:
            return rows[bi] * kc.shape[1] + j
        blocks = table[bi, j // page]
        if blocks.size and (blocks.min() < 0 or blocks.max() >= kc.shape[0]):
            raise ValueError(f"block_table[{bi}] names blocks outside [0, num_blocks = {kc.shape[0]}): "
                             f"{sorted(set(blocks.tolist()))}")
        return blocks * page + j % page

    written = [slots(bi, int(lens[bi]), int(total[bi])) for bi in range(b)]
    read = [slots(bi, int(pads[bi]), int(total[bi])) for bi in range(b)]
    if nnew:
        every = np.concatenate(written)
        if np.unique(every).size != every.size:
            raise ValueError("two sequences append to the same cache slot (cache_batch_idx / block_table)")
        owner = np.full(kc.shape[0] * kc.shape[1], -1, np.int64)
        for bi in range(b):
            owner[written[bi]] = bi
        for bi in range(b):
            who = owner[read[bi]]
            if np.any((who >= 0) & (who != bi)):
                raise ValueError(f"sequence {bi} reads cache slots that another sequence appends to")

    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary and (rotary_cos is None or rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    window = (-1, -1) if window_size is None else tuple(window_size)

    def rounded(x: np.ndarray, wanted: bool = True) -> np.ndarray:
        return x if rotary_dtype is None or not wanted else x.astype(rotary_dtype).astype(np.float64)

    if rotary:
        t = np.arange(nq)[None, :]
        per_row = bool(causal) or any(w >= 0 for w in window)
        start = (lens - pads)[:, None]   # positions count from the left pad
        q = rounded(rotary_reference(q, rotary_cos, rotary_sin, start + (t if per_row else 0),
                                     rotary_interleaved), round_rotated_q)
        if nnew:
            k = rounded(rotary_reference(k, rotary_cos, rotary_sin, start + np.arange(nnew)[None, :],
                                         rotary_interleaved))

    kflat = kc.reshape(-1, hkv, d).copy()   # the caches after the append, one slot a row
    vflat = vc.reshape(-1, hkv, dv).copy()
    for bi in range(b):
        if nnew:
            kflat[written[bi]], vflat[written[bi]] = (k[bi], v[bi]) if stored is None else stored(bi, k[bi], v[bi])

    slopes = None if alibi_slopes is None else _as_f64(alibi_slopes, "alibi_slopes")
    if slopes is not None and slopes.shape not in ((hq,), (b, hq)):
        raise ValueError(f"alibi_slopes must have shape ({hq},) or ({b}, {hq}), got {slopes.shape}")
    out, lse = np.zeros((b, nq, hq, dv)), np.full((b, hq, nq), -np.inf)
    for bi in range(b):
        o, l_ = attention_reference(
            q[bi:bi + 1], kflat[read[bi]][None], vflat[read[bi]][None], causal=causal,
            softmax_scale=softmax_scale,
            window_size=window, attention_chunk=attention_chunk, softcap=softcap,
            alibi_slopes=None if slopes is None else slopes if slopes.ndim == 1 else slopes[bi:bi + 1], sinks=sinks)
        out[bi], lse[bi] = o[0], l_[0]
    return out, lse, kflat.reshape(kc.shape), vflat.reshape(vc.shape)


def combine_reference(outs, lses):
    """Float64 combination of split-KV partial results -> ``(out, lse)``.

    outs (splits, B, Nq, H, D), lses (splits, B, H, Nq) (each split's log-sum-exp, natural log): lse =
    log(sum_s exp(lses[s])), out = sum_s exp(lses[s] - lse) outs[s]. A split whose lse is -inf contributes
    nothing, whatever its outs hold (NaN included); rows where every split is -inf give out 0, lse -inf.
    Returns out (B, Nq, H, D) and lse (B, H, Nq), float64 NumPy."""
    outs, lses = _as_f64(outs, "outs"), _as_f64(lses, "lses")
    if outs.ndim != 5:
        raise ValueError(f"outs must have 5 dimensions (splits, batch, seqlen_q, heads, head_dim), got {outs.shape}")
    s, b, nq, h, _ = outs.shape
    if lses.shape != (s, b, h, nq):
        raise ValueError(f"lses must have shape (splits, batch, heads, seqlen_q) = {(s, b, h, nq)}, got {lses.shape}")
    if np.any(np.isnan(lses)) or np.any(np.isposinf(lses)):
        raise ValueError("lses must be finite or -inf (a split that saw no key)")
    empty = np.isneginf(lses)
    m = lses.max(axis=0) if s else np.full((b, h, nq), -np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.where(empty, 0.0, np.exp(np.where(empty, 0.0, lses - m)))
    total = w.sum(axis=0)
    seen = total > 0
    lse = np.where(seen, np.log(np.where(seen, total, 1.0)) + m, -np.inf)
    w = (w / np.where(seen, total, 1.0)).transpose(0, 1, 3, 2)[..., None]   # (splits, B, Nq, H, 1)
    out = np.where(empty.transpose(0, 1, 3, 2)[..., None], 0.0, w * outs).sum(axis=0)
    return out, lse
