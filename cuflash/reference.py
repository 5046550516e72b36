"""Float64 NumPy reference for attention and its gradients.

Used by every GPU test and by the self-check of ``python -m cuflash``. Same
conventions as the kernels: layout (batch, seqlen, heads, head_dim), GQA by
sharing K/V heads, causal aligned to the bottom-right corner, lse in natural
log, rows that see no key give output 0 and lse -inf.
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


def _check_dims(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, int, int, int, int, int]:
    """The layout the kernels take: q (B, Nq, Hq, D), k and v (B, Nk, Hkv, D), Hq % Hkv == 0.
    Reuses the kernels' shape checks, so the messages are the same."""
    from ._checks import check_qkv_shapes

    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), "
                             f"got shape {tuple(x.shape)}")
    return check_qkv_shapes(q, k, v)


def _options(causal, softmax_scale, head_dim: int) -> tuple[bool, float]:
    from ._checks import check_flag, check_scale

    return check_flag("causal", causal), check_scale(softmax_scale, head_dim)


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool) -> np.ndarray:
    """(seqlen_q, seqlen_k) bool: key j visible from query i."""
    if not causal:
        return np.ones((seqlen_q, seqlen_k), dtype=bool)
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def _probs(q, k, mask, scale):
    """P (seqlen_q, seqlen_k) and lse (seqlen_q,) for one (batch, head)."""
    s = (q @ k.T) * scale
    s = np.where(mask, s, -np.inf)
    row_max = s.max(axis=1, keepdims=True) if s.shape[1] else np.full((s.shape[0], 1), -np.inf)
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(s - safe_max)
    total = e.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
        lse = np.where(total[:, 0] > 0, np.log(np.where(total[:, 0] > 0, total[:, 0], 1.0)) + safe_max[:, 0],
                       -np.inf)
    return p, lse


def attention_reference(q, k, v, *, causal: bool = False, softmax_scale: float | None = None):
    """Float64 attention. q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D) -> out (B, Nq, Hq, D), lse (B, Hq, Nq)."""
    q, k, v = _as_f64(q, "q"), _as_f64(k, "k"), _as_f64(v, "v")
    b, nq, nk, hq, hkv, d = _check_dims(q, k, v)
    causal, scale = _options(causal, softmax_scale, d)
    group = hq // hkv
    mask = visible_mask(nq, nk, causal)
    out = np.zeros((b, nq, hq, d))
    lse = np.zeros((b, hq, nq))
    for bi in range(b):
        for h in range(hq):
            p, lse[bi, h] = _probs(q[bi, :, h], k[bi, :, h // group], mask, scale)
            out[bi, :, h] = p @ v[bi, :, h // group]
    return out, lse


def attention_reference_backward(dout, q, k, v, *, causal: bool = False, softmax_scale: float | None = None):
    """Float64 gradients (dq, dk, dv) of attention, shaped like q, k, v; GQA heads summed."""
    dout, q, k, v = _as_f64(dout, "dout"), _as_f64(q, "q"), _as_f64(k, "k"), _as_f64(v, "v")
    b, nq, nk, hq, hkv, d = _check_dims(q, k, v)
    if dout.shape != q.shape:
        raise ValueError(f"dout must have the shape of q {tuple(q.shape)}, got {tuple(dout.shape)}")
    causal, scale = _options(causal, softmax_scale, d)
    group = hq // hkv
    mask = visible_mask(nq, nk, causal)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for bi in range(b):
        for h in range(hq):
            kh, vh, do = k[bi, :, h // group], v[bi, :, h // group], dout[bi, :, h]
            p, _ = _probs(q[bi, :, h], kh, mask, scale)
            dv[bi, :, h // group] += p.T @ do
            dp = do @ vh.T
            delta = (p * dp).sum(axis=1, keepdims=True)  # = rowsum(dout * out)
            ds = p * (dp - delta)
            dq[bi, :, h] = scale * ds @ kh
            dk[bi, :, h // group] += scale * ds.T @ q[bi, :, h]
    return dq, dk, dv


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
                                chunk_rows: int | None = None):
    """Float64 attention (and, given ``dout``, its gradients) on the GPU, a chunk of query rows at a time,
    so that long sequences never hold the whole score matrix.

    Inputs are CuPy arrays in the kernels' layout (any float dtype; strided views are fine) and the
    conventions are :func:`attention_reference`'s. Returns CuPy float64 ``(out, lse)``, or
    ``(out, lse, dq, dk, dv)`` with ``dout``; rows that see no key give 0, lse -inf and zero gradients.
    ``chunk_rows``: query rows per chunk (default: about 2^26 scores a chunk). Its products are CuPy's
    matmuls where cuBLAS is installed (the bench extras); without it the same chunks are computed with
    NumPy on the host (slower, the same results), so that no check needs cuBLAS.
    """
    import cupy

    from .bench import cublas_missing

    _check_chunked_args(q, k, v, dout, causal, softmax_scale, chunk_rows)   # before any copy to the host
    if cublas_missing() is None:
        return _reference_by_chunks(cupy, q, k, v, dout, causal, softmax_scale, chunk_rows)
    host = [None if x is None else cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else x for x in (q, k, v, dout)]
    return tuple(cupy.asarray(x) for x in _reference_by_chunks(np, *host, causal, softmax_scale, chunk_rows))


def _check_chunked_args(q, k, v, dout, causal, softmax_scale, chunk_rows):
    """attention_reference_chunked's argument checks: ((b, nq, nk, hq, hkv, d), causal, scale, rows a chunk)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if x is not None or name != "dout":
            _check_real_array(x, name)
    dims = _check_dims(q, k, v)
    causal, scale = _options(causal, softmax_scale, dims[-1])
    if dout is not None and tuple(dout.shape) != tuple(q.shape):
        raise ValueError(f"dout must have the shape of q {tuple(q.shape)}, got {tuple(dout.shape)}")
    return dims, causal, scale, _chunk_rows(dims[2], chunk_rows)


def _reference_by_chunks(xp, q, k, v, dout, causal, softmax_scale, chunk_rows):
    """attention_reference_chunked with the array module ``xp`` (CuPy, or NumPy on the host)."""
    (b, nq, nk, hq, hkv, d), causal, scale, rows = _check_chunked_args(q, k, v, dout, causal, softmax_scale,
                                                                       chunk_rows)
    f64, group = xp.float64, hq // hkv
    out, lse = xp.zeros((b, nq, hq, d), f64), xp.full((b, hq, nq), -xp.inf, f64)
    grads = None if dout is None else (xp.zeros((b, nq, hq, d), f64), xp.zeros((b, nk, hkv, d), f64),
                                       xp.zeros((b, nk, hkv, d), f64))
    keys = xp.arange(nk)[None, :]
    for bi in range(b):
        for h in range(hq):
            kh, vh = xp.asarray(k[bi, :, h // group], f64), xp.asarray(v[bi, :, h // group], f64)
            qh = xp.asarray(q[bi, :, h], f64)
            for r0 in range(0, nq, rows):
                r1 = min(nq, r0 + rows)
                s = (qh[r0:r1] @ kh.T) * scale
                if causal:
                    s = xp.where(keys <= xp.arange(r0, r1)[:, None] + (nk - nq), s, -xp.inf)
                m = s.max(axis=1, keepdims=True) if nk else xp.full((r1 - r0, 1), -xp.inf, f64)
                m = xp.where(xp.isfinite(m), m, 0.0)   # rows that see no key: every p is 0
                p = xp.exp(s - m)
                total = p.sum(axis=1, keepdims=True)
                seen = total > 0
                p /= xp.where(seen, total, 1.0)
                o = p @ vh
                out[bi, r0:r1, h] = o
                lse[bi, h, r0:r1] = xp.where(seen, xp.log(xp.where(seen, total, 1.0)) + m, -xp.inf)[:, 0]
                if grads is not None:
                    dq, dk, dv = grads
                    do = xp.asarray(dout[bi, r0:r1, h], f64)
                    dv[bi, :, h // group] += p.T @ do
                    ds = p * (do @ vh.T - (do * o).sum(axis=1, keepdims=True))
                    dq[bi, r0:r1, h] = scale * (ds @ kh)
                    dk[bi, :, h // group] += scale * (ds.T @ qh[r0:r1])
    return (out, lse) if grads is None else (out, lse, *grads)

