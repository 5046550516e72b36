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
