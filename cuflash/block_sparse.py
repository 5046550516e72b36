"""Block-sparse attention on the host (issue #45): the user's block mask checked, built from document ids or a
predicate, and turned into the kernels' tile lists.

A block mask is bool ``(batch or 1, heads_q or 1, ceil(seqlen_q / bq), ceil(seqlen_k / bk))`` at a block size
``bq`` x ``bk`` of the user's choosing (default 128 x 128, FlexAttention's): keys in an off block are hidden
from the rows of that block, and the kernels never visit a tile that only off blocks cover. Everything here
works on NumPy and CuPy arrays alike (the array module of the mask), without a host sync for CuPy.

The kernels walk their own tiles (block_m x block_n, which may differ from the user's blocks), through lists
that :func:`tile_lists` builds: per (b, h, query tile) the key tiles to visit, last first, bit 31 set where a
tile is only partly covered by on blocks (its elements are then tested against the block mask); and the
transposed lists per key tile for the backward's dK / dV pass (ProgParams in kernels_cu/common/params.cuh).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import numpy as np

DEFAULT_BLOCK_SIZE = 128
PARTIAL_BIT = 1 << 31

BlockSize = Union[int, Tuple[int, int]]


def _xp(x):
    import sys

    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and isinstance(x, cupy.ndarray) else np


def check_block_size(block_size: Any) -> Tuple[int, int]:
    """``block_size`` as (bq, bk) positive ints (an int: both)."""
    if isinstance(block_size, (int, np.integer)) and not isinstance(block_size, (bool, np.bool_)):
        block_size = (int(block_size), int(block_size))
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or not all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) and x > 0
                       for x in block_size)):
        raise ValueError(f"block_size must be a positive int or a pair (bq, bk) of them, got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def block_grid(seqlen_q: int, seqlen_k: int, block_size: BlockSize) -> Tuple[int, int]:
    """(query blocks, key blocks) of a block mask for these lengths."""
    bq, bk = check_block_size(block_size)
    return -(-seqlen_q // bq), -(-seqlen_k // bk)


def check_block_mask(block_mask: Any, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int,
                     block_size: BlockSize = DEFAULT_BLOCK_SIZE):
    """TypeError / ValueError unless ``block_mask`` is a bool array (batch or 1, heads_q or 1, query blocks, key
    blocks); returns (block_mask, (bq, bk))."""
    bq, bk = check_block_size(block_size)
    if not (hasattr(block_mask, "shape") and hasattr(block_mask, "dtype")):
        raise TypeError(f"block_mask must be a bool array, got {type(block_mask).__name__}")
    if np.dtype(block_mask.dtype) != np.bool_:
        raise TypeError(f"block_mask must have dtype bool, got {block_mask.dtype}")
    nqb, nkb = block_grid(seqlen_q, seqlen_k, (bq, bk))
    shape = tuple(block_mask.shape)
    if len(shape) != 4 or shape[0] not in (1, batch) or shape[1] not in (1, heads_q) or shape[2:] != (nqb, nkb):
        raise ValueError(f"block_mask must have shape ({batch} or 1, {heads_q} or 1, {nqb}, {nkb}) (block_size "
                         f"{bq} x {bk} over seqlen_q {seqlen_q}, seqlen_k {seqlen_k}), got {shape}")
    return block_mask, (bq, bk)


def block_mask_from_predicate(predicate: Callable, batch: Optional[int], heads: Optional[int], seqlen_q: int,
                              seqlen_k: int, block_size: BlockSize = DEFAULT_BLOCK_SIZE, *, xp=np,
                              rows_per_step: int = 1024):
    """The block mask whose blocks are on where ``predicate(b, h, q_idx, kv_idx)`` holds for at least one element
    (b, h ints; q_idx (rows, 1), kv_idx (1, seqlen_k) int arrays of ``xp``; returns bool, broadcastable to
    (rows, seqlen_k)). ``batch`` / ``heads`` None: the predicate does not depend on it (that dim is 1). In an on
    block every element is then visible: pass the same rule as a :class:`cuflash.MaskMod` too where elements
    matter (cuflash derives the block mask of a MaskMod itself)."""
    bq, bk = check_block_size(block_size)
    nqb, nkb = block_grid(seqlen_q, seqlen_k, (bq, bk))
    nb, nh = batch or 1, heads or 1
    out = xp.zeros((nb, nh, nqb, nkb), dtype=bool)
    kv = xp.arange(seqlen_k)[None, :]
    step = max(bq, rows_per_step // bq * bq)   # whole query blocks per step
    for b in range(nb):
        for h in range(nh):
            for r0 in range(0, seqlen_q, step):
                r1 = min(seqlen_q, r0 + step)
                vis = xp.broadcast_to(xp.asarray(predicate(b, h, xp.arange(r0, r1)[:, None], kv), dtype=bool),
                                      (r1 - r0, seqlen_k))
                out[b, h, r0 // bq:-(-r1 // bq)] = _any_by_blocks(xp, vis, r0, bq, bk)
    return out


def _any_by_blocks(xp, vis, r0: int, bq: int, bk: int):
    """(query blocks, key blocks) any() of ``vis`` (rows from r0, a multiple of bq), padded to whole blocks."""
    rows, cols = vis.shape
    nr, nc = -(-rows // bq), -(-cols // bk)
    padded = xp.zeros((nr * bq, nc * bk), dtype=bool)
    padded[:rows, :cols] = vis
    return padded.reshape(nr, bq, nc, bk).any(axis=(1, 3))


def block_mask_from_document_ids(document_ids_q, document_ids_k=None, block_size: BlockSize = DEFAULT_BLOCK_SIZE,
                                 *, causal: bool = False):
    """The block mask of document masking: a query sees the keys of its own document (``causal``: and not
    after it, bottom-right aligned). ``document_ids_q`` (batch, seqlen_q) / ``document_ids_k`` (batch, seqlen_k)
    integer arrays (default: the same as q's); returns bool (batch, 1, query blocks, key blocks)."""
    dq = document_ids_q
    dk = dq if document_ids_k is None else document_ids_k
    for name, d in (("document_ids_q", dq), ("document_ids_k", dk)):
        if not hasattr(d, "dtype") or np.dtype(d.dtype).kind not in "iu" or d.ndim != 2:
            raise TypeError(f"{name} must be a 2-D integer array (batch, seqlen), got "
                            f"{getattr(d, 'dtype', type(d).__name__)} {getattr(d, 'shape', '')}")
    if dq.shape[0] != dk.shape[0]:
        raise ValueError(f"document_ids_q and document_ids_k must have the same batch, got {dq.shape[0]} and "
                         f"{dk.shape[0]}")
    xp = _xp(dq)
    nq, nk = int(dq.shape[1]), int(dk.shape[1])

    def same_document(b, h, q_idx, kv_idx):
        vis = dq[b][q_idx] == dk[b][kv_idx]
        return vis & (kv_idx <= q_idx + (nk - nq)) if causal else vis

    return block_mask_from_predicate(same_document, int(dq.shape[0]), None, nq, nk, block_size, xp=xp)


def _rect_counts(xp, prefix, r0, r1, c0, c1):
    """Count of on blocks in rectangles [r0, r1) x [c0, c1) from a 2-D prefix sum with a zero first row / col."""
    return (prefix[..., r1[:, None], c1[None, :]] - prefix[..., r0[:, None], c1[None, :]]
            - prefix[..., r1[:, None], c0[None, :]] + prefix[..., r0[:, None], c0[None, :]])


def tile_coverage(block_mask, block_size: BlockSize, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int):
    """(any, all): bool (B', H', query tiles, key tiles), whether some / every user block that tile (m, n) of
    block_m x block_n overlaps is on (blocks past the sequences are not counted)."""
    xp = _xp(block_mask)
    bq, bk = check_block_size(block_size)
    mt, nt = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    counts = block_mask.astype(xp.int32)
    prefix = xp.zeros(counts.shape[:2] + (counts.shape[2] + 1, counts.shape[3] + 1), dtype=xp.int32)
    prefix[..., 1:, 1:] = counts.cumsum(axis=2).cumsum(axis=3)
    m = xp.arange(mt)
    n = xp.arange(nt)
    r0 = (m * block_m) // bq
    r1 = (xp.minimum((m + 1) * block_m, seqlen_q) - 1) // bq + 1
    c0 = (n * block_n) // bk
    c1 = (xp.minimum((n + 1) * block_n, seqlen_k) - 1) // bk + 1
    on = _rect_counts(xp, prefix, r0, r1, c0, c1)
    area = (r1 - r0)[:, None] * (c1 - c0)[None, :]
    return on > 0, on == area


def tile_lists(block_mask, block_size: BlockSize, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int):
    """The kernels' tile lists (module docstring): ``(kv_count, kv_index, q_count, q_index)``, int32,
    counts (B', H', tiles) and indices (B', H', tiles, other tiles): per query tile its key tiles with an on
    block, last first, and per key tile its query tiles, last first; bit 31 (PARTIAL_BIT) marks a tile that an
    off block also covers, whose elements the kernel tests against the block mask."""
    return lists_from_coverage(*tile_coverage(block_mask, block_size, seqlen_q, seqlen_k, block_m, block_n))


def lists_from_coverage(any_on, all_on):
    """:func:`tile_lists` from the tiles' coverage (bool (B', H', query tiles, key tiles): some / every element of
    the tile visible), e.g. :func:`tile_coverage`'s, or a mask modifier's evaluated over the tiles."""
    xp = _xp(any_on)
    kv_count, kv_index = key_tile_lists(any_on, all_on)
    q_count, q_index = key_tile_lists(xp.swapaxes(any_on, -1, -2), xp.swapaxes(all_on, -1, -2))
    return kv_count, kv_index, q_count, q_index


def key_tile_lists(on, full):
    """(count, index) of :func:`tile_lists` along the last axis alone: per row of ``on`` (the query tiles', or, with
    the last two axes swapped, the key tiles') the tiles on, last first, then the others; PARTIAL_BIT where ``full``
    is not set. The kernels read the key-tile lists only."""
    xp = _xp(on)
    tiles = on.shape[-1]
    order = xp.arange(tiles - 1, -1, -1)                         # last first
    on_r, full_r = on[..., order], full[..., order]
    # on tiles first, in the last-first order, then the off ones: each tile's place from running counts (a
    # permutation of each row, scattered at once: no sort, and no host synchronisation on a device)
    on_i = on_r.astype(xp.int32)
    count = on_i.sum(axis=-1, keepdims=True)
    place = xp.where(on_r, xp.cumsum(on_i, axis=-1) - 1, count + xp.cumsum(1 - on_i, axis=-1) - 1)
    value = (xp.broadcast_to(order, on_r.shape).astype(xp.int64) | xp.where(full_r, 0, PARTIAL_BIT))
    rows = xp.arange(on_r.size // tiles, dtype=xp.int64).reshape(on_r.shape[:-1] + (1,)) * tiles
    index = xp.empty(on_r.size, dtype=xp.int64)
    index[(rows + place).ravel()] = value.ravel()
    index = index.reshape(on_r.shape).astype(xp.uint32).view(xp.int32)
    return count[..., 0].astype(xp.int32), index
