"""CPU-only: the float64 reference against independent formulations."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash.reference import attention_reference, attention_reference_backward, rel_err, visible_mask


def _naive(q, k, v, causal, scale):
    """Straightforward per-element softmax in float64, repeated K/V heads (no GQA sharing)."""
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    out = np.zeros((b, nq, hq, d))
    lse = np.full((b, hq, nq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            for i in range(nq):
                js = [j for j in range(nk) if not causal or j <= i + nk - nq]
                if not js:
                    continue
                s = np.array([q[bi, i, h] @ k[bi, j, h // g] for j in js]) * scale
                m = s.max()
                w = np.exp(s - m)
                lse[bi, h, i] = m + math.log(w.sum())
                out[bi, i, h] = (w[:, None] * v[bi, js, h // g]).sum(0) / w.sum()
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,hq,hkv", [(5, 5, 2, 2), (7, 3, 4, 2), (3, 9, 3, 1), (1, 1, 1, 1)])
def test_forward_matches_naive(causal, nq, nk, hq, hkv):
    rng = np.random.default_rng(nq * 100 + nk)
    q = rng.standard_normal((2, nq, hq, 8))
    k = rng.standard_normal((2, nk, hkv, 8))
    v = rng.standard_normal((2, nk, hkv, 8))
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.7)
    ref_out, ref_lse = _naive(q, k, v, causal, 0.7)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-12)


def test_bottom_right_causal_and_empty_rows():
    m = visible_mask(4, 2, causal=True)
    assert m.tolist() == [[False, False], [False, False], [True, False], [True, True]]
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 4, 1, 8)), rng.standard_normal((1, 2, 1, 8)), rng.standard_normal((1, 2, 1, 8))
    out, lse = attention_reference(q, k, v, causal=True)
    assert np.all(out[0, :2] == 0) and np.all(np.isneginf(lse[0, 0, :2]))
    assert not np.isnan(out).any()


@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_finite_differences(causal):
    rng = np.random.default_rng(1)
    b, nq, nk, hq, hkv, d = 1, 4, 5, 2, 1, 8
    q = rng.standard_normal((b, nq, hq, d))
    k = rng.standard_normal((b, nk, hkv, d))
    v = rng.standard_normal((b, nk, hkv, d))
    dout = rng.standard_normal((b, nq, hq, d))
    dq, dk, dv = attention_reference_backward(dout, q, k, v, causal=causal)

    def loss(q_, k_, v_):
        return float((attention_reference(q_, k_, v_, causal=causal)[0] * dout).sum())

    eps = 1e-6
    for x, grad in ((q, dq), (k, dk), (v, dv)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            up = loss(q, k, v)
            x[idx] = orig - eps
            down = loss(q, k, v)
            x[idx] = orig
            num[idx] = (up - down) / (2 * eps)
        assert rel_err(grad, num) < 1e-7


def test_rel_err_rejects_nan():
    ref = np.ones(4)
    assert rel_err(np.array([1.0, np.nan, 1.0, 1.0]), ref) == math.inf
    assert rel_err(ref, ref) == 0.0


# ---- argument checks (the same messages as the kernels' where they share a rule) ----

def _ones(shape=(1, 3, 2, 8)):
    return np.ones(shape, np.float32)


@pytest.mark.parametrize("change,exc,match", [
    ({"q": None}, TypeError, "q must be an array of real numbers"),
    ({"k": "abc"}, TypeError, "k must be an array of real numbers"),
    ({"v": _ones().astype(complex)}, TypeError, "v must hold real numbers"),
    ({"q": _ones((3, 2, 8))}, ValueError, "q must have 4 dimensions"),
    ({"v": _ones((1, 4, 2, 8))}, ValueError, "k and v must have the same shape"),
    ({"k": _ones((2, 3, 2, 8)), "v": _ones((2, 3, 2, 8))}, ValueError, "batch size"),
    ({"k": _ones((1, 3, 2, 4)), "v": _ones((1, 3, 2, 4))}, ValueError, "head_dim"),
    ({"q": _ones((1, 3, 3, 8))}, ValueError, "multiple of heads_kv"),
    ({"softmax_scale": -1.0}, ValueError, "softmax_scale"),
    ({"softmax_scale": "1"}, TypeError, "softmax_scale"),
    ({"causal": "no"}, TypeError, "causal must be a bool"),
])
@pytest.mark.parametrize("fn", ["forward", "backward"])
def test_reference_argument_checks(change, exc, match, fn):
    args = {"q": _ones(), "k": _ones(), "v": _ones(), **change}
    with pytest.raises(exc, match=match):
        if fn == "forward":
            attention_reference(**args)
        else:
            attention_reference_backward(_ones(), **args)   # the layout is checked before dout


def test_reference_backward_dout_shape():
    with pytest.raises(ValueError, match="dout must have the shape of q"):
        attention_reference_backward(_ones((1, 4, 2, 8)), _ones(), _ones(), _ones())
    with pytest.raises(TypeError, match="dout must be an array of real numbers"):
        attention_reference_backward(None, _ones(), _ones(), _ones())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,hq,hkv,chunk", [(13, 13, 2, 2, 4), (17, 6, 4, 2, 5), (5, 19, 3, 1, 1),
                                                (9, 9, 2, 1, 100), (1, 1, 1, 1, 1)])
def test_chunked_reference_matches_whole(causal, nq, nk, hq, hkv, chunk):
    """The GPU reference by chunks of query rows (run here with NumPy as its array module) gives the
    whole-matrix reference's output, lse and gradients: GQA sums, Nq != Nk, rows that see no key."""
    from cuflash.reference import _reference_by_chunks

    rng = np.random.default_rng(nq * 1000 + nk * 10 + chunk)
    q = rng.standard_normal((2, nq, hq, 16))
    k = rng.standard_normal((2, nk, hkv, 16))
    v = rng.standard_normal((2, nk, hkv, 16))
    dout = rng.standard_normal(q.shape)
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.4)
    grads = attention_reference_backward(dout, q, k, v, causal=causal, softmax_scale=0.4)
    got = _reference_by_chunks(np, q, k, v, dout, causal, 0.4, chunk)
    np.testing.assert_allclose(got[0], out, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.isneginf(got[1]), np.isneginf(lse))
    np.testing.assert_allclose(got[1][np.isfinite(lse)], lse[np.isfinite(lse)], rtol=1e-12)
    for g, r in zip(got[2:], grads):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)
    fwd_only = _reference_by_chunks(np, q, k, v, None, causal, 0.4, chunk)
    assert len(fwd_only) == 2 and np.array_equal(fwd_only[0], got[0])


def test_chunked_reference_rejects_bad_arguments():
    from cuflash.reference import _reference_by_chunks

    x = np.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="chunk_rows"):
        _reference_by_chunks(np, x, x, x, None, False, None, 0)
    with pytest.raises(ValueError, match="dout"):
        _reference_by_chunks(np, x, x, x, x[:, :2], False, None, 2)
    with pytest.raises(TypeError, match="causal"):
        _reference_by_chunks(np, x, x, x, None, "yes", None, 2)
