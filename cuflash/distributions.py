"""Attention inputs whose score distributions look like real models', for the benchmark harness.

Random normal q and k give scores of standard deviation 1 at the default softmax scale
1/sqrt(D): every probability is small and the online softmax's running max barely moves. Trained
models are not like that: a few channels of q and k carry outliers, heads are sharp, and many
heads put most of their weight on one early "sink" key. Kernels that take shortcuts when the
running max is stable (cuflash's forward keeps the max unless a probability passes 2^14) can
run at a different speed on such inputs, so the benchmarks time each of these:

| name | what | score std (D=128) |
| --- | --- | --- |
| ``normal`` | q, k, v ~ N(0, 1) | 1 |
| ``outlier8`` | normal, then 4 fixed channels of q and k times 8 | ~11.4 |
| ``outlier12`` | normal, then 4 fixed channels of q and k times 12 | ~25.5 |
| ``sharp`` | normal, then q and k times sqrt(8) | 8 |
| ``sink`` | normal plus an attention sink at key 0 (score ~10 above the rest) | ~1 |
| ``mixed`` | KV head j (and its query heads) drawn as the j % 5-th of the five above | 13.0 pooled |

A trained model has heads of every kind side by side, so ``mixed`` is the one closest to a real layer: a kernel
whose strategy follows what it has just seen (cuflash's kept max does, per warp) meets them all in one launch.

All score figures are for the default ``softmax_scale`` 1/sqrt(D); ``target_score_std`` gives
them at any head dim. Layout is cuflash's: q ``(batch, seqlen_q, heads, head_dim)``, k and v
``(batch, seqlen_k, heads_kv, head_dim)``.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # bench imports this module; the dataclass is only needed for hints here
    from .bench import Shape

# The single-kind distributions, in the order "mixed" deals them out to the KV heads.
MIXED_CYCLE = ("normal", "outlier8", "outlier12", "sharp", "sink")
DISTRIBUTIONS = MIXED_CYCLE + ("mixed",)

OUTLIER_CHANNELS = 4
OUTLIER_FACTORS = {"outlier8": 8.0, "outlier12": 12.0}
# sqrt(8) on both q and k multiplies every score by 8, at every head dim.
SHARP_FACTOR = 8.0 ** 0.5
# Sink: key 0 scores SINK_GAP * (1 + z / SINK_SHIFT), z ~ N(0, 1), i.e. 10 +- 2, above the others' N(0, ~1).
SINK_GAP = 10.0
SINK_SHIFT = 5.0


def outlier_channels(head_dim: int, seed: int = 0) -> np.ndarray:
    """The ``OUTLIER_CHANNELS`` channel indices (sorted int64, distinct, < head_dim) that the outlier
    distributions scale: the same for q and k, a deterministic function of ``seed``."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(head_dim, size=min(OUTLIER_CHANNELS, head_dim), replace=False))


def target_score_std(dist: str, head_dim: int, heads_kv: int | None = None) -> float:
    """Standard deviation of the scaled scores q.k/sqrt(D) that ``dist`` is built to give.

    normal 1; outlierF sqrt((D - 4 + 4 F^4) / D) (F=8: 16.0 / 11.4 / 8.1 at D=64 / 128 / 256;
    F=12: 36.0 / 25.5 / 18.0); sharp 8 at every D; sink ~1 (the other keys' scores have std
    sqrt((D-1)/D); the sink column adds about (10^2 + 2^2) / seqlen_k to the variance, +1.3 % at 4096 keys);
    mixed: the pooled std of its heads' kinds (every score has mean 0), over ``heads_kv`` KV heads of equal
    size (a whole cycle of five if None: 13.0 at D=128).
    """
    if dist == "mixed":
        kinds = [MIXED_CYCLE[j % len(MIXED_CYCLE)] for j in range(heads_kv or len(MIXED_CYCLE))]
        return math.sqrt(sum(target_score_std(x, head_dim) ** 2 for x in kinds) / len(kinds))
    if dist == "normal":
        return 1.0
    if dist in OUTLIER_FACTORS:
        c = min(OUTLIER_CHANNELS, head_dim)
        return math.sqrt((head_dim - c + c * OUTLIER_FACTORS[dist] ** 4) / head_dim)
    if dist == "sharp":
        return SHARP_FACTOR ** 2
    if dist == "sink":
        return 1.0
    raise ValueError(f"unknown distribution {dist!r}; expected one of {DISTRIBUTIONS}")


def make_inputs(shape: "Shape", dist: str = "normal", seed: int = 0):
    """(q, k, v) CuPy arrays in ``shape.dtype``: q ``(batch, seqlen, heads, head_dim)``, k and v
    ``(batch, seqlen_k, heads_kv, head_dim)``, drawn on the GPU in float32 from
    ``cupy.random.RandomState(seed)`` and then cast. ``normal`` is bitwise what
    ``bench.random_inputs(shape, seed)`` has always returned; the others start from the same
    draws (score stds at D=128 with the default scale 1/sqrt(D)):

    - ``normal``: q, k, v ~ N(0, 1); scores N(0, 1).
    - ``outlier8`` / ``outlier12``: channels ``outlier_channels(head_dim, seed)`` of q and of k
      (the same 4) times 8 / 12; score std ~11.4 / ~25.5 (``target_score_std``), heavy tailed.
    - ``sharp``: q and k times sqrt(8); every score times 8, std 8 at every head dim.
    - ``sink``: per KV head a random unit direction u. Every key but key 0 loses its component
      along u, key 0 becomes b*u, and every query gets a*u added (a = 5, b = 2*sqrt(D), so
      a*b/sqrt(D) = 10): the other keys' scores stay N(0, (D-1)/D), since they are orthogonal to
      u, while key 0's is 10 + 2z (z = q's own N(0, 1) component along u), about 10 above a typical
      score. At 4096 keys, key 0 takes on average about 2/3 of a row's weight non-causal (logits
      10 +- 2 against ln(4095) + 1/2 = 8.8 for all the rest together) and about 0.78 causal (every
      causal row sees key 0, short rows almost only it); at 1024 keys 0.84 non-causal. v is left
      as drawn (v[:, 0] ordinary).
    - ``mixed``: KV head j, and the query heads that read it, as ``MIXED_CYCLE[j % 5]`` draws them (each
      kind from the same seed, so v is the same as in all the others).
    """
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}; expected one of {DISTRIBUTIONS}")
    import cupy

    if dist == "mixed":
        group = shape.heads // shape.hkv
        parts = {x: make_inputs(shape, x, seed) for x in dict.fromkeys(
            MIXED_CYCLE[j % len(MIXED_CYCLE)] for j in range(shape.hkv))}
        q, k, v = (cupy.empty_like(x) for x in parts[MIXED_CYCLE[0]])
        for j in range(shape.hkv):
            qj, kj, vj = parts[MIXED_CYCLE[j % len(MIXED_CYCLE)]]
            q[:, :, j * group:(j + 1) * group] = qj[:, :, j * group:(j + 1) * group]
            k[:, :, j], v[:, :, j] = kj[:, :, j], vj[:, :, j]
        return q, k, v

    from ._checks import BFLOAT16

    dt = {"float16": np.float16, "bfloat16": BFLOAT16, "float32": np.float32}[shape.dtype]
    d = shape.head_dim
    rs = cupy.random.RandomState(seed)
    q = rs.standard_normal((shape.batch, shape.seqlen, shape.heads, d), dtype=np.float32)
    k = rs.standard_normal((shape.batch, shape.nk, shape.hkv, d), dtype=np.float32)
    v = rs.standard_normal((shape.batch, shape.nk, shape.hkv, d), dtype=np.float32)
    if dist in OUTLIER_FACTORS:
        gain = np.ones(d, dtype=np.float32)
        gain[outlier_channels(d, seed)] = OUTLIER_FACTORS[dist]
        gain = cupy.asarray(gain)  # broadcast over the last axis
        q *= gain
        k *= gain
    elif dist == "sharp":
        q *= np.float32(SHARP_FACTOR)
        k *= np.float32(SHARP_FACTOR)
    elif dist == "sink":
        # Drawn after v, so that q, k, v start from the same values as "normal".
        u = rs.standard_normal((shape.hkv, d), dtype=np.float32)
        u /= cupy.linalg.norm(u, axis=-1, keepdims=True)
        k -= (k * u).sum(axis=-1, keepdims=True) * u
        k[:, 0] = np.float32(SINK_GAP * math.sqrt(d) / SINK_SHIFT) * u
        # query head h reads KV head h // (heads / heads_kv)
        q += np.float32(SINK_SHIFT) * cupy.repeat(u, shape.heads // shape.hkv, axis=0)
    return q.astype(dt), k.astype(dt), v.astype(dt)


def sampled_scores(q, k, softmax_scale: float | None = None, samples: int = 512, seed: int = 0):
    """Scaled scores (float32 CuPy ``(rows, seqlen_k)``) of about ``samples`` query rows against every
    key of their head, unmasked: up to 8 (batch, head) pairs, the same number of random rows in
    each. q ``(batch, seqlen_q, heads, head_dim)``, k ``(batch, seqlen_k, heads_kv, head_dim)``.
    The products run on the host in NumPy (at most 8 key slices cross the bus): ``@`` on CuPy arrays
    would need cuBLAS, which the default install leaves out."""
    import cupy

    b, nq, hq, d = q.shape
    g = hq // k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    rng = np.random.default_rng(seed)
    pairs = rng.choice(b * hq, size=min(8, b * hq), replace=False)
    per_pair = min(nq, max(1, samples // len(pairs)))
    blocks = []
    for p in pairs:
        bi, hi = divmod(int(p), hq)
        rows = cupy.asarray(np.sort(rng.choice(nq, size=per_pair, replace=False)))
        qs = q[bi, :, hi].astype(cupy.float32)[rows].get()  # (rows, D); cast first: gathers then run on float32
        ks = k[bi, :, hi // g].astype(cupy.float32).get()  # (seqlen_k, D)
        blocks.append(qs @ ks.T * np.float32(scale))
    return cupy.asarray(np.concatenate(blocks))


def score_std(q, k, softmax_scale: float | None = None, samples: int = 512) -> float:
    """Measured standard deviation of the scaled scores (``sampled_scores``: about ``samples`` rows
    against all their keys, no causal mask). q ``(B, Nq, H, D)``, k ``(B, Nk, Hkv, D)`` CuPy arrays."""
    return float(sampled_scores(q, k, softmax_scale, samples).std())
