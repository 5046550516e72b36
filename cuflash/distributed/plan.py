"""Which rows meet which in each ring step, and the zig-zag split of a sequence over the ranks.

A sequence of ``seqlen`` tokens is cut into ``2 * world`` equal chunks; rank ``r`` holds chunks ``r`` and
``2 * world - 1 - r`` (in that order), so that under a causal mask every rank has the same work: one
early chunk, which sees few keys, and one late chunk, which sees many. In ring step ``s`` rank ``r``
computes its queries against the keys and values of rank ``(r - s) % world``. Without a mask any split
works; the zig-zag one is used for both, so that one sharding serves both.

A sequence that does not cut into ``2 * world`` equal chunks is padded at its end (``zigzag_shard`` pads
with zeros) and the ring is told the real length (``seqlen=``). The padding is a suffix of the global
sequence, so on every rank it is a suffix of the local rows (a late chunk, or an early one and then its
late one, past ``seqlen``): ``valid_rows`` counts the rows before it, and ``step_block`` cuts every
step's query and key rows to those, so padded keys are never attended and padded queries never
computed, with no mask in the kernels. Padded rows of the results are 0 (lse -inf).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class StepBlock:
    """The part of one ring step that is not masked out: local query rows ``q_start:q_stop`` against
    the source rank's key rows ``k_start:k_stop``, with the causal mask (both sides the same length:
    the step that meets the rank's own keys) or without one. A block of a positional variant (window,
    chunks, ALiBi: ``variant_blocks``) holds contiguous global positions on both sides, ``q_pos`` and
    ``k_pos`` being those of its first query and key row (-1: not positional)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool
    q_pos: int = -1
    k_pos: int = -1

    @property
    def mask_offsets(self) -> tuple:
        """(diag, key_offset) of the mask policy (variants.Variants.param_values): query row i of the block
        sits at key position i + diag of the block's keys, whose first is at absolute key_offset."""
        return (self.q_pos - self.k_pos, self.k_pos)

    @property
    def q_rows(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def k_rows(self) -> slice:
        return slice(self.k_start, self.k_stop)


def step_block(rank: int, source: int, world: int, local_seqlen: int, causal: bool,
               seqlen: Optional[int] = None) -> Optional[StepBlock]:
    """The work of ``rank`` against the keys of ``source`` (zig-zag shards of ``local_seqlen`` rows each),
    or None where every pair is masked (never, with the zig-zag split and no padding). ``seqlen``: the
    real length of a padded sequence; the rows past it are cut from both sides (``valid_rows``)."""
    blk = _step_block(rank, source, local_seqlen, causal)
    if seqlen is None or seqlen >= world * local_seqlen:
        return blk
    q_valid = valid_rows(rank, world, local_seqlen, seqlen)
    k_valid = valid_rows(source, world, local_seqlen, seqlen)
    q_stop, k_stop = min(blk.q_stop, q_valid), min(blk.k_stop, k_valid)
    if q_stop <= blk.q_start or k_stop <= blk.k_start:
        return None
    # The causal block (source == rank) keeps equal lengths: both sides are cut at the same row.
    return StepBlock(blk.q_start, q_stop, blk.k_start, k_stop, blk.causal)


def _step_block(rank: int, source: int, n: int, causal: bool) -> StepBlock:
    if not causal:
        return StepBlock(0, n, 0, n, False)
    half = n // 2
    if source == rank:     # chunks (r, 2R-1-r) against themselves: the causal mask of the local sequence
        return StepBlock(0, n, 0, n, True)
    if source < rank:      # both local chunks come after the source's early chunk and before its late one
        return StepBlock(0, n, 0, half, False)
    # source > rank: only the local late chunk comes after the source's chunks, and after both of them
    return StepBlock(half, n, 0, n, False)


def segments(rank: int, world: int, local_seqlen: int, seqlen: Optional[int] = None) -> list:
    """The runs of contiguous global positions among ``rank``'s local rows: ``(local_start, local_stop,
    global_start)`` for its early and its late chunk, cut before the padding."""
    half = local_seqlen // 2
    valid = local_seqlen if seqlen is None else valid_rows(rank, world, local_seqlen, seqlen)
    out = []
    for start, stop, pos in ((0, half, rank * half), (half, local_seqlen, (2 * world - 1 - rank) * half)):
        stop = min(stop, valid)
        if stop > start:
            out.append((start, stop, pos))
    return out


def variant_blocks(rank: int, source: int, world: int, local_seqlen: int, pattern: tuple,
                   seqlen: Optional[int] = None) -> list:
    """The blocks of one ring step under a positional pattern ``(causal, left, right, chunk)`` (window bounds
    -1 unbounded; chunk 0 none): each pair of a local query chunk and a source key chunk in which some query
    sees some key, with their global positions. A window visits only the steps and chunks it reaches."""
    import numpy as np

    causal, left, right, chunk = pattern
    blocks = []
    for q0, q1, qp in segments(rank, world, local_seqlen, seqlen):
        p = np.arange(qp, qp + q1 - q0, dtype=np.int64)
        hi = p if causal else (p + right if right >= 0 else np.full_like(p, 1 << 62))
        lo = p - left if left >= 0 else np.full_like(p, -(1 << 62))
        if chunk:
            start = (p // chunk) * chunk
            lo, hi = np.maximum(lo, start), np.minimum(hi, start + chunk - 1)
        for k0, k1, kp in segments(source, world, local_seqlen, seqlen):
            if np.any(np.maximum(lo, kp) <= np.minimum(hi, kp + k1 - k0 - 1)):
                blocks.append(StepBlock(q0, q1, k0, k1, False, qp, kp))
    return blocks


def valid_rows(rank: int, world: int, local_seqlen: int, seqlen: int) -> int:
    """How many local rows of ``rank`` hold tokens of a sequence of ``seqlen`` (the rest, a suffix of the
    local rows, is padding)."""
    half = local_seqlen // 2
    early = min(max(seqlen - rank * half, 0), half)
    late = min(max(seqlen - (2 * world - 1 - rank) * half, 0), half)
    return early + late


def check_padded(seqlen: Optional[int], world: int, local_seqlen: int) -> Optional[int]:
    """``seqlen`` (the real length of a padded zig-zag sequence) checked against the shards, or None when
    there is no padding; ValueError naming what does not fit."""
    if seqlen is None:
        return None
    if isinstance(seqlen, bool) or not isinstance(seqlen, int):
        raise TypeError(f"seqlen must be an int or None, got {type(seqlen).__name__}")
    whole = world * local_seqlen
    if seqlen == whole:
        return None
    if local_seqlen % 2:
        raise ValueError(f"a padded sequence (seqlen={seqlen} < world * local_seqlen = {whole}) needs zig-zag "
                         f"shards of an even local seqlen, got {local_seqlen}")
    if not 0 < seqlen < whole:
        raise ValueError(f"seqlen must be in [1, world * local_seqlen = {whole}], got {seqlen}")
    return seqlen


def chunk_positions(rank: int, world: int, local_seqlen: int) -> list[int]:
    """Global token positions of the local rows of ``rank`` under the zig-zag split."""
    half = local_seqlen // 2
    first = list(range(rank * half, (rank + 1) * half))
    last_chunk = 2 * world - 1 - rank
    return first + list(range(last_chunk * half, (last_chunk + 1) * half))


def check_split(seqlen: int, world: int) -> int:
    """The local length of a zig-zag split of ``seqlen`` tokens over ``world`` ranks; ValueError when the
    sequence does not cut into ``2 * world`` equal chunks."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if seqlen % (2 * world):
        raise ValueError(f"the zig-zag split needs seqlen divisible by 2 * world = {2 * world}, got seqlen {seqlen}")
    return seqlen // world


def padded_length(seqlen: int, world: int) -> int:
    """``seqlen`` rounded up to a multiple of ``2 * world`` (the zig-zag split's chunks)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return -(-seqlen // (2 * world)) * 2 * world


def zigzag_shard(x, world: int, rank: int, *, axis: int = 1):
    """The rows of ``x`` (a CuPy or NumPy array, the sequence along ``axis``) that ``rank`` holds:
    chunks ``rank`` and ``2 * world - 1 - rank`` of ``2 * world``, concatenated (a new array). A length
    that does not cut into ``2 * world`` chunks is padded with zeros at the end first (pass the real
    length as ``seqlen=`` to the ring, and to :func:`zigzag_unshard`)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    n = x.shape[axis]
    padded = padded_length(n, world)
    c = padded // (2 * world)
    index = [slice(None)] * x.ndim
    parts = []
    for chunk in (rank, 2 * world - 1 - rank):
        index[axis] = slice(min(chunk * c, n), min((chunk + 1) * c, n))
        part = x[tuple(index)]
        short = c - part.shape[axis]
        if short:
            pad_shape = list(x.shape)
            pad_shape[axis] = short
            part = _xp(x).concatenate([part, _xp(x).zeros(pad_shape, dtype=x.dtype)], axis=axis)
        parts.append(part)
    return _xp(x).concatenate(parts, axis=axis)


def zigzag_unshard(shards: Sequence, *, axis: int = 1, seqlen: Optional[int] = None):
    """The whole sequence back from the shards of every rank, in rank order (inverse of :func:`zigzag_shard`);
    ``seqlen``: the real length of a padded sequence, whose padding is dropped."""
    world = len(shards)
    if world == 0:
        raise ValueError("shards must hold one array per rank, got none")
    n = shards[0].shape[axis]
    if n % 2 or any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"shards must have the same shape with an even length along axis {axis}, got "
                         f"{[tuple(s.shape) for s in shards]}")
    c = n // 2
    chunks = [None] * (2 * world)
    index = [slice(None)] * shards[0].ndim
    for r, s in enumerate(shards):
        index[axis] = slice(0, c)
        chunks[r] = s[tuple(index)]
        index[axis] = slice(c, n)
        chunks[2 * world - 1 - r] = s[tuple(index)]
    whole = _xp(shards[0]).concatenate(chunks, axis=axis)
    if seqlen is not None and seqlen < whole.shape[axis]:
        index[axis] = slice(0, seqlen)
        whole = whole[tuple(index)]
    return whole


def _xp(x):
    """The array module of ``x``: CuPy for CuPy arrays, NumPy otherwise."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    import numpy

    return numpy
