"""CPU-only: the float64 reference's programmable attention (issue #45) against what it must equal: the
built-in variants written as modifiers, ALiBi as a bias, brute-force dropout, and finite differences for
every gradient (dq, dk, dv, dbias, a modifier's table)."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import philox
from cuflash.reference import attention_reference, attention_reference_backward

RNG = np.random.default_rng(45)


def _qkv(b=2, nq=13, nk=21, hq=4, hkv=2, d=8, dv=8):
    return (RNG.standard_normal((b, nq, hq, d)), RNG.standard_normal((b, nk, hkv, d)),
            RNG.standard_normal((b, nk, hkv, dv)))


def _close(a, b, tol=1e-10):
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def test_alibi_as_a_bias():
    q, k, v = _qkv()
    b, nq, hq, _ = q.shape
    nk = k.shape[1]
    slopes = RNG.uniform(0.1, 1.0, (b, hq))
    pos = np.arange(nq)[:, None] + nk - nq
    bias = -slopes[:, :, None, None] * np.abs(pos - np.arange(nk)[None, :])
    dout = RNG.standard_normal((b, nq, hq, v.shape[3]))
    _close(attention_reference(q, k, v, alibi_slopes=slopes, causal=True),
           attention_reference(q, k, v, bias=bias, causal=True))
    _close(attention_reference_backward(dout, q, k, v, alibi_slopes=slopes, causal=True),
           attention_reference_backward(dout, q, k, v, bias=bias, causal=True)[:3])


def test_softcap_and_window_as_modifiers():
    q, k, v = _qkv(nq=17, nk=17)
    cap, scale = 3.0, 0.4
    dout = RNG.standard_normal(q.shape[:3] + (v.shape[3],))
    kw = dict(softmax_scale=scale)

    def score_mod(s, b, h, qi, ki):
        return cap * np.tanh(s / cap)

    def score_mod_grad(s, b, h, qi, ki):
        return 1.0 - np.tanh(s / cap) ** 2

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & (ki >= qi - 5)

    built_in = dict(softcap=cap, window_size=(5, 0), **kw)
    mods = dict(score_mod=score_mod, score_mod_grad=score_mod_grad, mask_mod=mask_mod, **kw)
    _close(attention_reference(q, k, v, **built_in), attention_reference(q, k, v, **mods))
    _close(attention_reference_backward(dout, q, k, v, **built_in),
           attention_reference_backward(dout, q, k, v, **mods))


def _fd(f, x, eps=1e-6):
    """Central differences of the scalar f at every element of x."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        hi = f()
        x[i] = old - eps
        lo = f()
        x[i] = old
        g[i] = (hi - lo) / (2 * eps)
    return g


@pytest.mark.parametrize("bias_shape", [(1, 4, 5, 7), (2, 1, 1, 7), (2, 4, 5, 7), (5, 1)])
def test_bias_gradients_by_finite_differences(bias_shape):
    q, k, v = _qkv(nq=5, nk=7, d=4, dv=3)
    bias = RNG.standard_normal(bias_shape)
    dout = RNG.standard_normal(q.shape[:3] + (v.shape[3],))
    dlse = RNG.standard_normal((q.shape[0], q.shape[2], q.shape[1]))
    kw = dict(bias=bias, causal=True)

    def loss():
        o, lse = attention_reference(q, k, v, **kw)
        return float((o * dout).sum() + (np.where(np.isfinite(lse), lse, 0) * dlse).sum())

    dq, dk, dv, dbias = attention_reference_backward(dout, q, k, v, dlse=dlse, **kw)
    assert dbias.shape == bias_shape
    for x, g in ((q, dq), (k, dk), (v, dv), (bias, dbias)):
        np.testing.assert_allclose(g, _fd(loss, x), rtol=1e-5, atol=1e-6)


def test_relative_position_table_gradient_through_the_hook():
    q, k, v = _qkv(nq=6, nk=9, d=4, dv=4)
    table = RNG.standard_normal((4, 6))   # (heads, buckets)

    def score_mod(s, b, h, qi, ki):
        return s + table[h, np.minimum(np.abs(qi - ki), 5)]

    dtable = np.zeros_like(table)

    def hook(ds, b, h, qi, ki):
        np.add.at(dtable[h], np.broadcast_to(np.minimum(np.abs(qi - ki), 5), ds.shape), ds)

    kw = dict(score_mod=score_mod, score_mod_grad=lambda s, *a: np.ones_like(s))
    dout = RNG.standard_normal(q.shape[:3] + (v.shape[3],))
    attention_reference_backward(dout, q, k, v, dscore_hook=hook, **kw)
    fd = _fd(lambda: float((attention_reference(q, k, v, **kw)[0] * dout).sum()), table)
    np.testing.assert_allclose(dtable, fd, rtol=1e-5, atol=1e-7)


def test_dropout_against_brute_force_and_finite_differences():
    q, k, v = _qkv(nq=18, nk=35, d=4, dv=5)
    b, nq, hq, _ = q.shape
    nk, p = k.shape[1], 0.3
    keep = philox.dropout_keep_mask(11, 2, b, hq, nq, nk, p)
    assert 0 < keep.mean() < 1
    kw = dict(dropout_p=p, dropout_mask=keep)
    out, lse = attention_reference(q, k, v, **kw)
    # Brute force: softmax of the full scores, dropped, times v (GQA: head h reads kv head h // 2).
    s = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, 2, axis=2)) / np.sqrt(q.shape[3])
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    want = np.einsum("bhqk,bkhd->bqhd", prob * keep / (1 - p), np.repeat(v, 2, axis=2))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, attention_reference(q, k, v)[1], rtol=1e-12)   # lse undropped
    dout = RNG.standard_normal(out.shape)
    grads = attention_reference_backward(dout, q, k, v, **kw)
    for x, g in zip((q, k, v), grads):
        np.testing.assert_allclose(g, _fd(lambda: float((attention_reference(q, k, v, **kw)[0] * dout).sum()), x),
                                   rtol=1e-5, atol=1e-6)


def test_block_mask_equals_the_mask_it_expands_to():
    q, k, v = _qkv(nq=40, nk=50)
    bq, bk = 16, 8
    blocks = RNG.random((2, 1, 3, 7)) < 0.6
    blocks[:, :, :, 0] = True

    def mask_mod(b, h, qi, ki):
        return blocks[b, 0][qi // bq, ki // bk]

    dout = RNG.standard_normal(q.shape[:3] + (v.shape[3],))
    _close(attention_reference(q, k, v, block_mask=blocks, block_size=(bq, bk)),
           attention_reference(q, k, v, mask_mod=mask_mod))
    _close(attention_reference_backward(dout, q, k, v, block_mask=blocks, block_size=(bq, bk), causal=True),
           attention_reference_backward(dout, q, k, v, mask_mod=mask_mod, causal=True))
    everything = np.ones((1, 1, 1, 1), bool)
    _close(attention_reference(q, k, v, block_mask=everything, block_size=64), attention_reference(q, k, v))


def test_a_row_that_sees_nothing_gives_zero_and_minus_infinity():
    q, k, v = _qkv(nq=4, nk=4)
    out, lse = attention_reference(q, k, v, mask_mod=lambda b, h, qi, ki: (qi != 2) & (ki >= 0))
    assert np.all(out[:, 2] == 0) and np.all(lse[:, :, 2] == -np.inf) and np.all(np.isfinite(lse[:, :, [0, 1, 3]]))


def test_bad_arguments():
    q, k, v = _qkv(nq=4, nk=6)
    with pytest.raises(ValueError, match="bias must broadcast"):
        attention_reference(q, k, v, bias=np.zeros((2, 4, 4, 5)))
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_reference(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        attention_reference(q, k, v, dropout_p=1.0, dropout_mask=np.ones((1,), bool))
    with pytest.raises(ValueError, match="block_mask must be bool"):
        attention_reference(q, k, v, block_mask=np.ones((1, 1, 2, 2), bool), block_size=2)
    with pytest.raises(TypeError, match="score_mod must be callable"):
        attention_reference(q, k, v, score_mod="score")
    with pytest.raises(TypeError, match="unknown argument"):
        attention_reference(q, k, v, dropout=0.1)
    with pytest.raises(ValueError, match="score_mod_grad"):
        attention_reference_backward(np.ones((2, 4, 4, 8)), q, k, v, score_mod=lambda s, *a: s)


def test_varlen_reference_is_the_dense_one_at_each_sequences_batch_index():
    """attention_reference_varlen with programmable arguments: sequence b is the dense reference at batch index
    b over its own positions (bias, dropout mask, block mask sliced; modifiers called with b), so on a batch of
    sequences padded to one length and cut back, the two agree row for row, dbias included."""
    from cuflash.reference import attention_reference_varlen, attention_reference_varlen_backward

    b, n, hq, d = 3, 11, 2, 8
    lengths_q, lengths_k = [11, 4, 7], [9, 11, 2]
    q, k, v = _qkv(b=b, nq=n, nk=n, hq=hq, hkv=1, d=d, dv=d)
    bias = RNG.standard_normal((1, hq, n, n))   # broadcast over the batch
    keep = RNG.random((b, hq, n, n)) > 0.3
    blocks = RNG.random((1, 1, 3, 3)) < 0.8
    docs = RNG.integers(0, 3, (b, n))
    prog = dict(bias=bias, dropout_p=0.3, dropout_mask=keep, block_mask=blocks, block_size=4,
                score_mod=lambda s, bi, h, qi, ki: s + 0.1 * bi - 0.05 * h * (qi - ki),
                score_mod_grad=lambda s, *a: np.ones_like(s),
                mask_mod=lambda bi, h, qi, ki: (docs[bi][qi] == docs[bi][ki]) | (ki == 0))
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)])
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)])
    pq = np.concatenate([q[i, :lengths_q[i]] for i in range(b)])
    pk = np.concatenate([k[i, :lengths_k[i]] for i in range(b)])
    pv = np.concatenate([v[i, :lengths_k[i]] for i in range(b)])
    out, lse = attention_reference_varlen(pq, pk, pv, cu_q, cu_k, causal=True, **prog)
    dout = RNG.standard_normal(out.shape)
    grads = attention_reference_varlen_backward(dout, pq, pk, pv, cu_q, cu_k, causal=True, **prog)
    dbias = np.zeros_like(bias)
    for i in range(b):
        nq, nk = lengths_q[i], lengths_k[i]
        seq = dict(prog, bias=bias[:, :, :nq, :nk], dropout_mask=keep[i:i + 1, :, :nq, :nk],
                   block_mask=blocks[:, :, :-(-nq // 4), :-(-nk // 4)])
        for name in ("score_mod", "score_mod_grad", "mask_mod"):
            seq[name] = (lambda f, i_: lambda *a: f(*a[:-4], i_, *a[-3:]))(prog[name], i)
        args = (q[i:i + 1, :nq], k[i:i + 1, :nk], v[i:i + 1, :nk])
        o, l_ = attention_reference(*args, causal=True, **seq)
        _close((out[cu_q[i]:cu_q[i + 1]], lse[:, cu_q[i]:cu_q[i + 1]]), (o[0], l_[0]))
        g = attention_reference_backward(dout[None, cu_q[i]:cu_q[i + 1]], *args, causal=True, **seq)
        _close((grads[0][cu_q[i]:cu_q[i + 1]], grads[1][cu_k[i]:cu_k[i + 1]], grads[2][cu_k[i]:cu_k[i + 1]]),
               (g[0][0], g[1][0], g[2][0]))
        dbias[:, :, :nq, :nk] += g[3]
    _close((grads[3],), (dbias,))
