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


@pytest.mark.parametrize("sm90_reads", [True, False])
def test_narrow_v_arrays_and_preprocess_width(monkeypatch, sm90_reads):
    """head_dims.NarrowV: the Hopper kernel takes v, out and dout as they are and the preprocess reads Dv columns;
    the portable kernels take them padded (the preprocess then reads Dqk); dV comes through a Dqk-wide workspace
    whose first Dv columns reach the caller's dv."""
    from cuflash import capture, params

    monkeypatch.setattr(capture, "keep_if_capturing", lambda *arrays: None)
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 5, 3, 192)), rng.standard_normal((2, 7, 3, 192))
    v, out, dout = (rng.standard_normal(s) for s in ((2, 7, 3, 128), (2, 5, 3, 128), (2, 5, 3, 128)))
    dv = np.full(v.shape, np.nan)
    narrow = head_dims.NarrowV(dout, q, k, v, out, dv, sm90_reads=sm90_reads)
    assert narrow
    dout_k, q_k, k_k, v_k, out_k, dv_k = narrow.arrays()
    assert q_k is q and k_k is k and dv_k.shape == (2, 7, 3, 192)
    if sm90_reads:
        assert dout_k is dout and v_k is v and out_k is out
    else:
        for wide, narrow_x in ((dout_k, dout), (v_k, v), (out_k, out)):
            assert wide.shape[-1] == 192 and not wide[..., 128:].any() and (wide[..., :128] == narrow_x).all()
    names = params.BWD_PARAMS.names
    values = tuple(range(len(names)))
    unpacked = np.frombuffer(narrow.preprocess_params(values), dtype=params.BWD_PARAMS)[0]
    assert unpacked["head_dim"] == (128 if sm90_reads else 192)
    assert all(unpacked[n] == i for i, n in enumerate(names) if n not in ("head_dim", "softmax_scale", "scale_log2",
                                                                           "softcap_in", "softcap_out", "alibi_scale"))
    dv_k[...] = rng.standard_normal(dv_k.shape)
    narrow.deliver_dv()
    assert (dv == dv_k[..., :128]).all()
    assert not head_dims.NarrowV(dout, q, k, rng.standard_normal((2, 7, 3, 192)), out, dv, sm90_reads=True)
