"""CPU only (issue #44): the float64 references of decoding with a KV cache, of rotary embeddings and of the
split-KV combination, checked against the dense reference and independent formulations: the cache reference
without an append is the dense reference on each sequence's slice of the cache; a paged cache behind a
shuffled block table gives the contiguous cache's results; appends land where they should and nowhere else;
rotary is the complex multiplication by e^{i angle}, keeps each pair's norm, is the identity at angle 0, and its
two styles differ by a column permutation; the combination of two halves of the keys is attention over all
of them, and a split that saw no key (lse -inf, outs NaN) changes nothing."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash.reference import (attention_reference, attention_reference_kvcache, combine_reference,
                               rotary_reference)

RTOL = 1e-12   # the same float64 computation reached another way


def _assert_lse(lse, ref, rtol=RTOL):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(lse[fin], ref[fin], rtol=rtol, atol=1e-13)


def _tables(seqlen_ro, rotary_dim, rng):
    """cos / sin (seqlen_ro, rotary_dim // 2) of random angles (not the usual frequencies: any angle must do)."""
    angles = rng.uniform(-np.pi, np.pi, (seqlen_ro, rotary_dim // 2))
    return np.cos(angles), np.sin(angles)


def _cache(rng, batch, capacity, hkv, d, dv):
    return rng.standard_normal((batch, capacity, hkv, d)), rng.standard_normal((batch, capacity, hkv, dv))


# ---------------------------------------------------------------------------
# Rotary


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8, 2])
def test_rotary_is_complex_multiplication(interleaved, rotary_dim):
    """Pair i of a token at position p, (x0, x1) as x0 + i x1, is multiplied by cos + i sin of row p."""
    rng = np.random.default_rng(rotary_dim + 100 * interleaved)
    x = rng.standard_normal((2, 5, 3, 16))
    cos, sin = _tables(40, rotary_dim, rng)
    pos = rng.integers(0, 40, (2, 5))
    got = rotary_reference(x, cos, sin, pos, interleaved)
    half = rotary_dim // 2
    if interleaved:
        idx0, idx1 = slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
        z = x[..., idx0] + 1j * x[..., idx1]
    else:
        z, idx0, idx1 = x[..., :half] + 1j * x[..., half:rotary_dim], slice(0, half), slice(half, rotary_dim)
    rot = z * (cos[pos] + 1j * sin[pos])[:, :, None, :]
    np.testing.assert_allclose(got[..., idx0], rot.real, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(got[..., idx1], rot.imag, rtol=1e-13, atol=1e-14)
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])   # columns past rotary_dim


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_identity_at_angle_zero(interleaved):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 7, 2, 24))
    ones, zeros = np.ones((10, 8)), np.zeros((10, 8))
    np.testing.assert_array_equal(rotary_reference(x, ones, zeros, rng.integers(0, 10, (3, 7)), interleaved), x)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_keeps_pair_norms(interleaved):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 9, 4, 32))
    cos, sin = _tables(64, 24, rng)
    got = rotary_reference(x, cos, sin, rng.integers(0, 64, (2, 9)), interleaved)

    def pairs(a):
        return (a[..., 0:24:2], a[..., 1:24:2]) if interleaved else (a[..., :12], a[..., 12:24])

    (a0, a1), (b0, b1) = pairs(x), pairs(got)
    np.testing.assert_allclose(np.hypot(b0, b1), np.hypot(a0, a1), rtol=1e-13)
    assert not np.allclose(got[..., :24], x[..., :24])   # and it did turn them
    np.testing.assert_array_equal(got[..., 24:], x[..., 24:])


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_styles_differ_by_a_permutation(rotary_dim):
    """GPT-J's pairs (2i, 2i + 1) become GPT-NeoX's (i, i + rotary_dim / 2) after moving the even columns of the
    rotary part first and the odd ones after them."""
    rng = np.random.default_rng(rotary_dim)
    x = rng.standard_normal((2, 6, 3, 32))
    cos, sin = _tables(50, rotary_dim, rng)
    pos = rng.integers(0, 50, (2, 6))
    perm = np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2), np.arange(rotary_dim, 32)])
    a = rotary_reference(x, cos, sin, pos, True)[..., perm]
    b = rotary_reference(x[..., perm], cos, sin, pos, False)
    np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-15)


def test_rotary_refuses_bad_arguments():
    x, c = np.zeros((1, 2, 1, 8)), np.zeros((4, 2))
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_reference(x, np.zeros((4, 5)), np.zeros((4, 5)), np.zeros((1, 2), int), True)
    with pytest.raises(ValueError, match="rotary_sin"):
        rotary_reference(x, c, np.zeros((4, 3)), np.zeros((1, 2), int), True)
    with pytest.raises(ValueError, match="positions"):
        rotary_reference(x, c, c, np.full((1, 2), 4), True)
    with pytest.raises(TypeError, match="positions"):
        rotary_reference(x, c, c, np.zeros((1, 2)), True)


# ---------------------------------------------------------------------------
# The cache reference


VARIANTS = [dict(), dict(causal=True), dict(window_size=(5, 2)), dict(causal=True, window_size=(9, 0), softcap=3.0),
            dict(alibi="batch", causal=True), dict(alibi="heads"), dict(sinks=True, causal=True),
            dict(causal=True, attention_chunk=8), dict(softmax_scale=0.3)]


def _variant(kw, rng, batch, hq):
    kw = dict(kw)
    alibi = kw.pop("alibi", None)
    if alibi:
        kw["alibi_slopes"] = rng.uniform(0.01, 0.5, (batch, hq) if alibi == "batch" else (hq,))
    if kw.pop("sinks", False):
        kw["sinks"] = rng.standard_normal(hq)
    return kw


@pytest.mark.parametrize("kw", VARIANTS)
@pytest.mark.parametrize("batch_idx", [False, True])
def test_no_append_is_the_dense_reference_on_each_slice(kw, batch_idx):
    """Without new keys: sequence b is attention_reference over keys [0, cache_seqlens[b]) of its cache row
    (cache_batch_idx[b] where given); GQA, Dv != Dqk, ragged lengths with 0, 1 and a full row."""
    rng = np.random.default_rng(len(str(kw)) + 7 * batch_idx)
    batch, nq, hq, hkv, d, dv, cap = 5, 3, 6, 2, 16, 8, 40
    lens = np.array([0, 1, cap, 17, 2], np.int32)
    q = rng.standard_normal((batch, nq, hq, d))
    kc, vc = _cache(rng, batch + 2, cap, hkv, d, dv)
    rows = rng.permutation(batch + 2)[:batch] if batch_idx else np.arange(batch)
    kw = _variant(kw, rng, batch, hq)
    out, lse, ka, va = attention_reference_kvcache(q, kc, vc, cache_seqlens=lens,
                                                   cache_batch_idx=rows if batch_idx else None, **kw)
    assert out.shape == (batch, nq, hq, dv) and lse.shape == (batch, hq, nq)
    np.testing.assert_array_equal(ka, kc)
    np.testing.assert_array_equal(va, vc)
    for b in range(batch):
        one = dict(kw)
        if "alibi_slopes" in one and one["alibi_slopes"].ndim == 2:
            one["alibi_slopes"] = one["alibi_slopes"][b:b + 1]
        o, l_ = attention_reference(q[b:b + 1], kc[rows[b]:rows[b] + 1, :lens[b]], vc[rows[b]:rows[b] + 1, :lens[b]],
                                    **one)
        np.testing.assert_allclose(out[b], o[0], rtol=RTOL, atol=1e-14)
        _assert_lse(lse[b], l_[0])
    if "sinks" not in kw:   # sequence 0 sees no key
        assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    else:                   # its rows' denominators hold the sink alone, as in attention_reference
        np.testing.assert_array_equal(out[0], 0)
        np.testing.assert_allclose(lse[0], np.broadcast_to(kw["sinks"][:, None], (hq, nq)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nnew", [1, 3])
def test_append_lands_at_cache_seqlens(causal, nnew):
    """New keys and values go to positions cache_seqlens[b] .. + nnew - 1 of each sequence's row, nothing else
    changes, the arguments are left alone, and attention runs over the cache_seqlens[b] + nnew first keys."""
    rng = np.random.default_rng(10 * nnew + causal)
    batch, nq, hq, hkv, d, dv, cap = 4, 2, 4, 4, 8, 16, 20
    lens = np.array([0, 7, cap - nnew, 1], np.int32)
    q = rng.standard_normal((batch, nq, hq, d))
    kc, vc = _cache(rng, batch, cap, hkv, d, dv)
    k, v = rng.standard_normal((batch, nnew, hkv, d)), rng.standard_normal((batch, nnew, hkv, dv))
    copies = [x.copy() for x in (q, kc, vc, k, v, lens)]
    out, lse, ka, va = attention_reference_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=causal)
    for x, c in zip((q, kc, vc, k, v, lens), copies):
        np.testing.assert_array_equal(x, c)
    want_k, want_v = kc.copy(), vc.copy()
    for b in range(batch):
        want_k[b, lens[b]:lens[b] + nnew] = k[b]
        want_v[b, lens[b]:lens[b] + nnew] = v[b]
    np.testing.assert_array_equal(ka, want_k)
    np.testing.assert_array_equal(va, want_v)
    for b in range(batch):
        n = lens[b] + nnew
        keys = np.concatenate([kc[b, :lens[b]], k[b]])[None]
        vals = np.concatenate([vc[b, :lens[b]], v[b]])[None]
        o, l_ = attention_reference(q[b:b + 1], keys, vals, causal=causal)
        assert keys.shape[1] == n
        np.testing.assert_allclose(out[b], o[0], rtol=RTOL, atol=1e-14)
        _assert_lse(lse[b], l_[0])


def _paged(kc, vc, page, rng, spare=3):
    """The contiguous caches (B, capacity, H, D) cut into pages stored in shuffled blocks, with ``spare`` blocks
    that no sequence names."""
    batch, cap = kc.shape[:2]
    per = cap // page
    nblocks = batch * per + spare
    perm = rng.permutation(nblocks)
    table = perm[:batch * per].reshape(batch, per).astype(np.int32)
    kp = rng.standard_normal((nblocks, page) + kc.shape[2:])
    vp = rng.standard_normal((nblocks, page) + vc.shape[2:])
    for b in range(batch):
        for i in range(per):
            kp[table[b, i]] = kc[b, i * page:(i + 1) * page]
            vp[table[b, i]] = vc[b, i * page:(i + 1) * page]
    return kp, vp, table


def _unpage(kp, table, page):
    batch, per = table.shape
    return np.stack([np.concatenate([kp[table[b, i]] for i in range(per)]) for b in range(batch)])


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True, rotary=True), dict(window_size=(6, 0), rotary=True,
                                                                                  alibi="batch", sinks=True)])
@pytest.mark.parametrize("nnew", [0, 3])
def test_paged_cache_equals_contiguous(page, kw, nnew):
    rng = np.random.default_rng(page + 5 * nnew + len(str(kw)))
    batch, nq, hq, hkv, d, dv, cap = 4, 4, 4, 2, 16, 16, 48
    lens = np.array([0, 1, cap - nnew, 29], np.int32)
    q = rng.standard_normal((batch, nq, hq, d))
    kc, vc = _cache(rng, batch, cap, hkv, d, dv)
    k, v = (rng.standard_normal((batch, nnew, hkv, d)), rng.standard_normal((batch, nnew, hkv, dv))) if nnew \
        else (None, None)
    kw = _variant(kw, rng, batch, hq)
    if kw.pop("rotary", False):
        kw["rotary_cos"], kw["rotary_sin"] = _tables(cap + nq, 8, rng)
    kp, vp, table = _paged(kc, vc, page, rng)
    out, lse, ka, va = attention_reference_kvcache(q, kc, vc, k, v, cache_seqlens=lens, **kw)
    pout, plse, pka, pva = attention_reference_kvcache(q, kp, vp, k, v, cache_seqlens=lens, block_table=table, **kw)
    np.testing.assert_allclose(pout, out, rtol=RTOL, atol=1e-14)
    _assert_lse(plse, lse)
    np.testing.assert_array_equal(_unpage(pka, table, page), ka)
    np.testing.assert_array_equal(_unpage(pva, table, page), va)
    spare = np.setdiff1d(np.arange(kp.shape[0]), table)
    np.testing.assert_array_equal(pka[spare], kp[spare])
    np.testing.assert_array_equal(pva[spare], vp[spare])


@pytest.mark.parametrize("kw,per_row", [(dict(), False), (dict(causal=True), True), (dict(window_size=(4, -1)), True),
                                         (dict(window_size=(-1, 2)), True), (dict(attention_chunk=16), False)])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_positions(kw, per_row, interleaved):
    """q rotated at cache_seqlens[b] + t when causal or windowed, else every query at cache_seqlens[b]; new key i
    at cache_seqlens[b] + i; the cache after holds the rotated keys."""
    rng = np.random.default_rng(3 + interleaved + len(str(kw)))
    batch, nq, nnew, hq, hkv, d, cap = 3, 4, 2, 2, 1, 16, 30
    lens = np.array([0, 5, 28], np.int32)
    q = rng.standard_normal((batch, nq, hq, d))
    kc, vc = _cache(rng, batch, cap, hkv, d, d)
    k, v = rng.standard_normal((batch, nnew, hkv, d)), rng.standard_normal((batch, nnew, hkv, d))
    cos, sin = _tables(cap + nq, 12, rng)
    out, lse, ka, _ = attention_reference_kvcache(q, kc, vc, k, v, cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin,
                                                  rotary_interleaved=interleaved, **kw)
    qpos = lens[:, None] + (np.arange(nq)[None, :] if per_row else 0)
    qr = rotary_reference(q, cos, sin, np.broadcast_to(qpos, (batch, nq)), interleaved)
    kr = rotary_reference(k, cos, sin, lens[:, None] + np.arange(nnew)[None, :], interleaved)
    for b in range(batch):
        np.testing.assert_array_equal(ka[b, lens[b]:lens[b] + nnew], kr[b])
        keys = np.concatenate([kc[b, :lens[b]], kr[b]])[None]
        vals = np.concatenate([vc[b, :lens[b]], v[b]])[None]
        o, l_ = attention_reference(qr[b:b + 1], keys, vals, **kw)
        np.testing.assert_allclose(out[b], o[0], rtol=RTOL, atol=1e-14)
        _assert_lse(lse[b], l_[0])


def test_rotary_dtype_rounds_the_rotated_values():
    """rotary_dtype: the rotated new keys in the cache after are the float64 rotation rounded to it."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 1, 2, 16))
    kc, vc = _cache(rng, 1, 8, 2, 16, 16)
    k, v = rng.standard_normal((1, 2, 2, 16)), rng.standard_normal((1, 2, 2, 16))
    cos, sin = _tables(8, 16, rng)
    _, _, exact, _ = attention_reference_kvcache(q, kc, vc, k, v, cache_seqlens=3, rotary_cos=cos, rotary_sin=sin)
    _, _, rounded, _ = attention_reference_kvcache(q, kc, vc, k, v, cache_seqlens=3, rotary_cos=cos, rotary_sin=sin,
                                                   rotary_dtype=np.float16)
    np.testing.assert_array_equal(rounded[0, 3:5], exact[0, 3:5].astype(np.float16).astype(np.float64))
    assert not np.array_equal(rounded[0, 3:5], exact[0, 3:5])
    np.testing.assert_array_equal(rounded[0, :3], kc[0, :3])
    # the rotated q: rounded too unless round_rotated_q=False (then exact, against the same rounded keys)
    lens = np.array([3])
    for round_q in (True, False):
        out, lse, _, _ = attention_reference_kvcache(q, kc, vc, k, v, cache_seqlens=3, rotary_cos=cos,
                                                     rotary_sin=sin, rotary_dtype=np.float16,
                                                     round_rotated_q=round_q)
        qr = rotary_reference(q, cos, sin, lens[:, None], True)
        if round_q:
            qr = qr.astype(np.float16).astype(np.float64)
        o, l_ = attention_reference(qr, rounded[:, :5], np.concatenate([vc[:, :3], v], axis=1))
        np.testing.assert_allclose(out, o, rtol=RTOL, atol=1e-14)
        _assert_lse(lse, l_)


def test_python_int_cache_seqlens():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 1, 2, 8))
    kc, vc = _cache(rng, 2, 10, 1, 8, 8)
    a = attention_reference_kvcache(q, kc, vc, cache_seqlens=6)
    b = attention_reference_kvcache(q, kc, vc, cache_seqlens=np.array([6, 6], np.int32))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_kvcache_refuses_bad_arguments():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 1, 4, 8))
    kc, vc = _cache(rng, 2, 10, 2, 8, 8)
    k, v = rng.standard_normal((2, 2, 2, 8)), rng.standard_normal((2, 2, 2, 8))
    lens = np.array([3, 4], np.int32)
    with pytest.raises(ValueError, match="k and v"):
        attention_reference_kvcache(q, kc, vc, k, cache_seqlens=lens)
    with pytest.raises(ValueError, match="capacity"):
        attention_reference_kvcache(q, kc, vc, k, v, cache_seqlens=np.array([3, 9], np.int32))
    with pytest.raises(ValueError, match="cache_seqlens"):
        attention_reference_kvcache(q, kc, vc, cache_seqlens=np.array([3, -1], np.int32))
    with pytest.raises(TypeError, match="cache_seqlens"):
        attention_reference_kvcache(q, kc, vc, cache_seqlens=np.array([3.0, 1.0]))
    with pytest.raises(ValueError, match="heads_q"):
        attention_reference_kvcache(q[:, :, :3], kc, vc, cache_seqlens=lens)
    with pytest.raises(ValueError, match="same cache slot"):
        attention_reference_kvcache(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=np.array([1, 1], np.int32))
    with pytest.raises(ValueError, match="cache_batch_idx"):
        attention_reference_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=np.array([0, 2], np.int32))
    kp, vp, table = _paged(kc, vc, 5, rng)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        attention_reference_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                    cache_batch_idx=np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="block_table"):
        attention_reference_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table + kp.shape[0])
    shared = table.copy()
    shared[1, 0] = table[0, 0]   # sequence 1 reads the block that sequence 0 appends to
    with pytest.raises(ValueError, match="another sequence"):
        attention_reference_kvcache(q, kp, vp, k, v, cache_seqlens=np.array([3, 6], np.int32), block_table=shared)
    attention_reference_kvcache(q, kp, vp, cache_seqlens=lens, block_table=shared)   # read-only sharing is fine
    with pytest.raises(ValueError, match="rotary"):
        attention_reference_kvcache(q, kc, vc, cache_seqlens=lens, rotary_cos=np.ones((10, 4)))


# ---------------------------------------------------------------------------
# Combining split-KV partial results


@pytest.mark.parametrize("kw", [dict(), dict(softcap=2.0), dict(softmax_scale=2.5)])
@pytest.mark.parametrize("cut", [0, 1, 37, 64])
def test_combine_of_two_key_ranges_is_attention_over_all(kw, cut):
    """attention_reference on keys [0, cut) and [cut, n), combined, is attention_reference on all n keys
    (an empty range, cut 0 or n, has lse -inf and contributes nothing)."""
    rng = np.random.default_rng(cut + len(str(kw)))
    b, nq, nk, hq, hkv, d, dv = 2, 5, 64, 4, 2, 16, 24
    q = rng.standard_normal((b, nq, hq, d))
    k, v = rng.standard_normal((b, nk, hkv, d)), rng.standard_normal((b, nk, hkv, dv))
    o1, l1 = attention_reference(q, k[:, :cut], v[:, :cut], **kw)
    o2, l2 = attention_reference(q, k[:, cut:], v[:, cut:], **kw)
    out, lse = combine_reference(np.stack([o1, o2]), np.stack([l1, l2]))
    ref_o, ref_l = attention_reference(q, k, v, **kw)
    np.testing.assert_allclose(out, ref_o, rtol=1e-11, atol=1e-13)
    _assert_lse(lse, ref_l, rtol=1e-13)


def test_combine_ignores_splits_that_saw_no_key():
    rng = np.random.default_rng(8)
    s, b, nq, h, d = 4, 2, 3, 2, 8
    outs = rng.standard_normal((s, b, nq, h, d))
    lses = rng.normal(0, 3, (s, b, h, nq))
    lses[1] = -np.inf                    # split 1 saw no key anywhere: its outs are garbage
    outs[1] = np.nan
    lses[2, 0, 1, 2] = -np.inf           # one row of split 2
    outs[2, 0, 2, 1] = np.nan
    lses[:, 1, 0, 0] = -np.inf           # a row that no split saw
    outs[:, 1, 0, 0] = np.nan
    out, lse = combine_reference(outs, lses)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[1, 0, 0], 0)
    assert np.isneginf(lse[1, 0, 0]) and np.isfinite(lse).sum() == lse.size - 1
    keep = [0, 2, 3]
    outs_k, lses_k = outs[keep].copy(), lses[keep].copy()
    want_o, want_l = combine_reference(outs_k, lses_k)
    np.testing.assert_allclose(out, want_o, rtol=1e-14)
    _assert_lse(lse, want_l, rtol=1e-14)
    # explicit formula on a row where all three remaining splits count
    w = np.exp(lses[keep, 0, 0, 0] - np.log(np.exp(lses[keep, 0, 0, 0]).sum()))
    np.testing.assert_allclose(out[0, 0, 0], (w[:, None] * outs[keep, 0, 0, 0]).sum(0), rtol=1e-13)
    np.testing.assert_allclose(lse[0, 0, 0], np.log(np.exp(lses[keep, 0, 0, 0]).sum()), rtol=1e-13)


def test_combine_large_and_small_lse():
    """lse values far outside exp's range (+-1000): no overflow, the largest split dominates."""
    outs = np.stack([np.full((1, 1, 1, 4), 1.0), np.full((1, 1, 1, 4), 2.0), np.full((1, 1, 1, 4), 3.0)])
    lses = np.array([1000.0, 1000.0, -1000.0]).reshape(3, 1, 1, 1)
    out, lse = combine_reference(outs, lses)
    np.testing.assert_allclose(out, 1.5, rtol=1e-14)
    np.testing.assert_allclose(lse, 1000.0 + np.log(2.0), rtol=1e-14)


def test_combine_refuses_bad_shapes():
    with pytest.raises(ValueError, match="lses"):
        combine_reference(np.zeros((2, 1, 3, 4, 8)), np.zeros((2, 1, 3, 4)))
    with pytest.raises(ValueError, match="outs"):
        combine_reference(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 4, 3)))
    with pytest.raises(ValueError, match="lses"):
        combine_reference(np.zeros((1, 1, 1, 1, 8)), np.full((1, 1, 1, 1), np.nan))


def test_leftpad_is_the_cache_shifted_left():
    """cache_leftpad L: the same as the cache shifted left by L (cache_seqlens - L), rotary positions included; the
    append lands at cache_seqlens either way."""
    from cuflash.reference import attention_reference_kvcache

    rng = np.random.default_rng(5)
    b, cap, hq, hkv, d, nnew = 2, 40, 4, 2, 16, 2
    q = rng.standard_normal((b, 3, hq, d))
    kc, vc = rng.standard_normal((b, cap, hkv, d)), rng.standard_normal((b, cap, hkv, d))
    kn, vn = rng.standard_normal((b, nnew, hkv, d)), rng.standard_normal((b, nnew, hkv, d))
    lens, pads = np.array([20, 31]), np.array([7, 0])
    ang = np.arange(cap + 4)[:, None] * 0.1 * np.arange(1, d // 2 + 1)[None]
    kw = dict(rotary_cos=np.cos(ang), rotary_sin=np.sin(ang), causal=True)
    out, lse, k_after, v_after = attention_reference_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                                             cache_leftpad=pads, **kw)
    k_shifted = np.stack([np.roll(x, -pads[i], axis=0) for i, x in enumerate(kc)])
    v_shifted = np.stack([np.roll(x, -pads[i], axis=0) for i, x in enumerate(vc)])
    ro, rl, rk, rv = attention_reference_kvcache(q, k_shifted, v_shifted, kn, vn, cache_seqlens=lens - pads, **kw)
    np.testing.assert_allclose(out, ro, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, rl, rtol=1e-12)
    for i in range(b):
        at, shifted_at = lens[i], lens[i] - pads[i]
        np.testing.assert_array_equal(k_after[i, at:at + nnew], rk[i, shifted_at:shifted_at + nnew])
    with pytest.raises(ValueError, match="cache_leftpad"):
        attention_reference_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=np.array([21, 0]))
