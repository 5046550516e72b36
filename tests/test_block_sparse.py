"""CPU-only: block masks on the host (cuflash.block_sparse): checks, the builders, and the kernels' tile lists
against brute force."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import block_sparse as bs

RNG = np.random.default_rng(46)


def test_check_block_mask():
    m = np.ones((1, 4, 3, 2), bool)
    assert bs.check_block_mask(m, 2, 4, 300, 200, (128, 128))[1] == (128, 128)
    assert bs.check_block_mask(np.ones((2, 1, 5, 7), bool), 2, 4, 80, 100, (16, 16))[1] == (16, 16)
    with pytest.raises(ValueError, match=r"shape \(2 or 1, 4 or 1, 3, 2\)"):
        bs.check_block_mask(np.ones((1, 4, 2, 2), bool), 2, 4, 300, 200)
    with pytest.raises(ValueError, match="shape"):
        bs.check_block_mask(np.ones((3, 4, 3, 2), bool), 2, 4, 300, 200)
    with pytest.raises(TypeError, match="dtype bool"):
        bs.check_block_mask(np.ones((1, 4, 3, 2), np.int8), 2, 4, 300, 200)
    with pytest.raises(TypeError, match="bool array"):
        bs.check_block_mask([[True]], 1, 1, 1, 1)
    for bad in (0, -1, (1, 0), (2, 2, 2), 1.5, True):
        with pytest.raises(ValueError, match="block_size"):
            bs.check_block_mask(m, 2, 4, 300, 200, bad)


def _expand(mask, bq, bk, nq, nk):
    return np.repeat(np.repeat(mask, bq, axis=2), bk, axis=3)[:, :, :nq, :nk]


@pytest.mark.parametrize("causal", [False, True])
def test_document_ids(causal):
    nq = nk = 100
    docs = np.sort(RNG.integers(0, 5, (2, nq)), axis=1).astype(np.int32)
    got = bs.block_mask_from_document_ids(docs, block_size=(16, 32), causal=causal)
    assert got.shape == (2, 1, 7, 4)
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    for b in range(2):
        vis = (docs[b][:, None] == docs[b][None, :]) & ((j <= i) if causal else True)
        want = np.zeros((7, 4), bool)
        for r in range(nq):
            for c in range(nk):
                want[r // 16, c // 32] |= vis[r, c]
        np.testing.assert_array_equal(got[b, 0], want)
    with pytest.raises(TypeError, match="document_ids_q"):
        bs.block_mask_from_document_ids(docs.astype(np.float32))


def test_predicate_per_head_and_broadcast():
    got = bs.block_mask_from_predicate(lambda b, h, q, k: (k - q) % (h + 2) == 0, None, 3, 70, 90, 32,
                                       rows_per_step=64)
    assert got.shape == (1, 3, 3, 3)
    for h in range(3):
        vis = (np.arange(90)[None] - np.arange(70)[:, None]) % (h + 2) == 0
        want = np.array([[vis[r:r + 32, c:c + 32].any() for c in range(0, 90, 32)] for r in range(0, 70, 32)])
        np.testing.assert_array_equal(got[0, h], want)


@pytest.mark.parametrize("block,tile,nq,nk", [((128, 128), (128, 64), 1000, 777), ((64, 32), (128, 128), 300, 401),
                                              ((48, 80), (64, 64), 200, 333), ((16, 16), (64, 128), 1, 50)])
def test_tile_lists_against_brute_force(block, tile, nq, nk):
    bq, bk = block
    bm, bn = tile
    nqb, nkb = bs.block_grid(nq, nk, block)
    mask = RNG.random((2, 3, nqb, nkb)) < 0.5
    kv_count, kv_index, q_count, q_index = bs.tile_lists(mask, block, nq, nk, bm, bn)
    elems = _expand(mask, bq, bk, nq, nk)
    mt, nt = -(-nq // bm), -(-nk // bn)
    assert kv_count.shape == (2, 3, mt) and kv_index.shape == (2, 3, mt, nt)
    assert q_count.shape == (2, 3, nt) and q_index.shape == (2, 3, nt, mt)
    for b in range(2):
        for h in range(3):
            sub = [[elems[b, h, m * bm:(m + 1) * bm, n * bn:(n + 1) * bn] for n in range(nt)] for m in range(mt)]
            for m in range(mt):
                want = [(n, not sub[m][n].all()) for n in reversed(range(nt)) if sub[m][n].any()]
                got = [(int(x) & 0x7FFFFFFF, bool(int(x) & bs.PARTIAL_BIT)) for x in
                       kv_index[b, h, m, :kv_count[b, h, m]].view(np.uint32)]
                assert got == want
            for n in range(nt):
                want = [(m, not sub[m][n].all()) for m in reversed(range(mt)) if sub[m][n].any()]
                got = [(int(x) & 0x7FFFFFFF, bool(int(x) & bs.PARTIAL_BIT)) for x in
                       q_index[b, h, n, :q_count[b, h, n]].view(np.uint32)]
                assert got == want
