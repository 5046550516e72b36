"""Dropout's keep mask on the host: the NumPy twin of ``kernels_cu/common/philox.cuh``.

The kernels draw dropout from Philox4x32-10, a counter-based generator, keyed by the call's ``seed`` and
``offset`` and counted by the element's coordinates, so that the backward regenerates the forward's mask and
the same seed gives bitwise the same result. :func:`dropout_keep_mask` computes that mask for whole arrays: it
is the documented way to read the mask a call used (tests feed it to the float64 reference). The header's
comment defines the element-to-bits mapping; :func:`dropout_threshold` the keep rule.
"""
from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10 of ``counter`` (..., 4) uint32 words under ``key`` (2 words, or (..., 2)): (..., 4) uint32."""
    c = np.asarray(counter, dtype=np.uint64)
    k = np.asarray(key, dtype=np.uint64)
    if c.shape[-1:] != (4,) or k.shape[-1:] != (2,):
        raise ValueError(f"counter must end in 4 words and key in 2, got shapes {c.shape} and {k.shape}")
    c0, c1, c2, c3 = (c[..., n] for n in range(4))
    k0, k1 = k[..., 0], k[..., 1]
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(_W0)) & _MASK32
            k1 = (k1 + np.uint64(_W1)) & _MASK32
        p0, p1 = _M0 * c0, _M1 * c2    # exact: both factors < 2^32
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _MASK32, (p0 >> np.uint64(32)) ^ c3 ^ k1,
                          p0 & _MASK32)
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def dropout_threshold(dropout_p: float) -> int:
    """The kernels' keep rule: an element is kept when its 16 random bits are >= round(dropout_p * 65536)."""
    return int(round(float(dropout_p) * 65536.0))


def _check_u64(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int in [0, 2^64), got {type(value).__name__} {value!r}")
    value = int(value)
    if not 0 <= value < 1 << 64:
        raise ValueError(f"{name} must be in [0, 2^64), got {value}")
    return value


def dropout_keep_mask(seed: int, offset: int, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                      dropout_p: float) -> np.ndarray:
    """The keep mask that a call with this ``seed``, ``offset`` and ``dropout_p`` draws: bool
    (batch, heads, seqlen_q, seqlen_k), True where the element is kept (its probability then divided by
    1 - dropout_p). ``heads`` counts query heads; with packed (varlen) batches, ``batch`` indexes sequences and
    rows and columns are the sequence's own (0 .. its length)."""
    seed, offset = _check_u64("seed", seed), _check_u64("offset", offset)
    for name, n in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    threshold = dropout_threshold(dropout_p)
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    row_unit = (i >> 4) * 8 + (i & 7)
    col_unit = (j >> 4) * 4 + ((j & 7) >> 1)
    slot = ((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1)
    key = np.array([seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF], np.uint64)
    out = np.empty((batch, heads, seqlen_q, seqlen_k), dtype=bool)
    # Every unit once per (batch, head): units are (seqlen_q / 2) x (seqlen_k / 4) at most.
    n_row_units = int(row_unit.max()) + 1 if seqlen_q else 0
    n_col_units = int(col_unit.max()) + 1 if seqlen_k else 0
    ru, cu = np.meshgrid(np.arange(n_row_units, dtype=np.uint64), np.arange(n_col_units, dtype=np.uint64),
                         indexing="ij")
    word = (slot >> 1)
    shift = (16 * (slot & 1)).astype(np.uint32)
    for b in range(batch):
        for h in range(heads):
            counter = np.stack([ru, cu, np.full_like(ru, b * heads + h), np.full_like(ru, offset & 0xFFFFFFFF)],
                               axis=-1)
            words = philox4x32_10(counter, key)                 # (row units, col units, 4)
            picked = words[row_unit, col_unit, word]            # (seqlen_q, seqlen_k)
            out[b, h] = ((picked >> shift) & 0xFFFF) >= threshold
    return out
