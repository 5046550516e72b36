"""Which rows meet which in each ring step, and the zig-zag split of a sequence over the ranks.

A sequence of ``seqlen`` tokens is cut into ``2 * world`` equal chunks; rank ``r`` holds chunks ``r`` and
``2 * world - 1 - r`` (in that order), so that under a causal mask every rank has the same work: one
early chunk, which sees few keys, and one late chunk, which sees many. In ring step ``s`` rank ``r``
computes its queries against the keys and values of rank ``(r - s) % world``. Without a mask any split
works; the zig-zag one is used for both, so that one sharding serves both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class StepBlock:
    """The part of one ring step that is not masked out: local query rows ``q_start:q_stop`` against
    the source rank's key rows ``k_start:k_stop``, with the causal mask (both sides the same length:
    the step that meets the rank's own keys) or without one."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool

    @property
    def q_rows(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def k_rows(self) -> slice:
        return slice(self.k_start, self.k_stop)


def step_block(rank: int, source: int, world: int, local_seqlen: int, causal: bool) -> Optional[StepBlock]:
    """The work of ``rank`` against the keys of ``source`` (zig-zag shards of ``local_seqlen`` rows each),
    or None where every pair is masked (never, with the zig-zag split)."""
    n = local_seqlen
    if not causal:
        return StepBlock(0, n, 0, n, False)
    half = n // 2
    if source == rank:     # chunks (r, 2R-1-r) against themselves: the causal mask of the local sequence
        return StepBlock(0, n, 0, n, True)
    if source < rank:      # both local chunks come after the source's early chunk and before its late one
        return StepBlock(0, n, 0, half, False)
    # source > rank: only the local late chunk comes after the source's chunks, and after both of them
    return StepBlock(half, n, 0, n, False)


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


def zigzag_shard(x, world: int, rank: int, *, axis: int = 1):
    """The rows of ``x`` (a CuPy or NumPy array, the sequence along ``axis``) that ``rank`` holds:
    chunks ``rank`` and ``2 * world - 1 - rank`` of ``2 * world``, concatenated (a new array)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    n = x.shape[axis]
    check_split(n, world)
    c = n // (2 * world)
    index = [slice(None)] * x.ndim
    parts = []
    for chunk in (rank, 2 * world - 1 - rank):
        index[axis] = slice(chunk * c, (chunk + 1) * c)
        parts.append(x[tuple(index)])
    return _xp(x).concatenate(parts, axis=axis)


def zigzag_unshard(shards: Sequence, *, axis: int = 1):
    """The whole sequence back from the shards of every rank, in rank order (inverse of :func:`zigzag_shard`)."""
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
    return _xp(shards[0]).concatenate(chunks, axis=axis)


def _xp(x):
    """The array module of ``x``: CuPy for CuPy arrays, NumPy otherwise."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    import numpy

    return numpy
