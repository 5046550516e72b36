"""CPU only: the backward's zero padding for a value head dim of its own (cuflash/head_dims.py) leaves the
gradients unchanged. The float64 reference backward on the padded arrays (at q's softmax scale), cut back to the
unpadded columns, equals the reference backward with Dv != Dqk; the padded columns' gradients are exactly 0;
dense and packed shapes, Dv below and above Dqk; and the buffers the caller gives receive the gradients."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import head_dims
from cuflash.reference import attention_reference, attention_reference_backward


@pytest.mark.parametrize("dqk,dv", [(192, 128), (128, 64), (64, 128), (8, 24), (40, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_leaves_the_gradients(dqk, dv, causal):
    rng = np.random.default_rng(dqk * 31 + dv + causal)
    b, nq, nk, hq, hkv = 2, 9, 13, 4, 2
    q, k = rng.standard_normal((b, nq, hq, dqk)), rng.standard_normal((b, nk, hkv, dqk))
    v = rng.standard_normal((b, nk, hkv, dv))
    out, _ = attention_reference(q, k, v, causal=causal)
    dout = rng.standard_normal(out.shape)
    ref = attention_reference_backward(dout, q, k, v, causal=causal)
    (dout_p, q_p, k_p, v_p, out_p), unpad = head_dims.padded(dout, q, k, v, out)
    width = max(dqk, dv)
    assert all(x.shape[-1] == width for x in (dout_p, q_p, k_p, v_p, out_p))
    out_again, _ = attention_reference(q_p, k_p, v_p, causal=causal, softmax_scale=1.0 / np.sqrt(dqk))
    np.testing.assert_allclose(out_again, out_p, rtol=1e-12, atol=1e-12)   # the padded output is out, widened
    grads = attention_reference_backward(dout_p, q_p, k_p, v_p, causal=causal, softmax_scale=1.0 / np.sqrt(dqk))
    for g, r in zip(unpad(*grads), ref):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)
    for g, keep in zip(grads, (dqk, dqk, dv)):
        assert not np.any(g[..., keep:])   # the padded columns get nothing


def test_packed_shapes_and_buffers():
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((11, 4, 64)), rng.standard_normal((13, 2, 64)), rng.standard_normal((13, 2, 32))
    out, dout = rng.standard_normal((11, 4, 32)), rng.standard_normal((11, 4, 32))
    (dout_p, q_p, k_p, v_p, out_p), unpad = head_dims.padded(dout, q, k, v, out)
    assert q_p is q and k_p is k and v_p.shape == (13, 2, 64) and out_p.shape == dout_p.shape == (11, 4, 64)
    np.testing.assert_array_equal(v_p[..., :32], v)
    assert not np.any(v_p[..., 32:])
    grads = unpad(np.ones((11, 4, 64)), np.full((13, 2, 64), 2.0), np.full((13, 2, 64), 3.0))
    given = np.zeros((13, 2, 32))
    dq, dk, dv = head_dims.deliver(grads, (None, None, given))
    assert dq.shape == (11, 4, 64) and dq.flags.c_contiguous and dv is given and np.all(given == 3.0)
