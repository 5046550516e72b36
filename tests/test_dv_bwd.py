"""GPU: the backward with a value head dim of its own (Dv != Dqk, issue #43) against the float64 reference, on
every kernel family, dense and varlen (cuflash/head_dims.py pads to one head dim; tests/test_head_dims.py checks
that identity on the CPU). Gradient buffers poisoned, every row compared (rows where a gradient vanishes against
the incoming gradient's scale, as tests/test_variants.py)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import BWD_TOL, poisoned, requires_gpu
from test_dv_fwd import _rand
from test_variants import _assert_rows

pytestmark = [requires_gpu, pytest.mark.usefixtures("hopper_kernels_only")]

PAIRS = [(192, 128), (128, 64), (64, 128), (8, 24)]
FAMILIES = [({}, "bfloat16"), ({"fwd_backend": "sm80", "bwd_backend": "sm80"}, "float16"), ({}, "float32")]


@pytest.mark.parametrize("family,dtype", FAMILIES)
@pytest.mark.parametrize("dqk,dv", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_dense(rng, family, dtype, dqk, dv, causal):
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_backward

    cuflash.options.set(**family)
    b, nq, nk, hq, hkv = 2, 139, 211, 4, 2
    q, k, v = _rand(rng, (b, nq, hq, dqk), dtype), _rand(rng, (b, nk, hkv, dqk), dtype), _rand(rng, (b, nk, hkv, dv), dtype)
    out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
    dout = _rand(rng, out.shape, dtype)
    bufs = [poisoned(x.shape, dtype) for x in (q, k, v)]
    for det in (False, True):
        grads = cuflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, dq=bufs[0], dk=bufs[1],
                                 dv=bufs[2])
        assert all(g is buf for g, buf in zip(grads, bufs))
        ref = attention_reference_backward(dout, q, k, v, causal=causal)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
            _assert_rows(name, g, cupy.asarray(r), dtype, BWD_TOL, dout)


@pytest.mark.parametrize("dqk,dv", [(192, 128), (64, 128)])
def test_varlen(rng, dqk, dv):
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_varlen_backward

    lq, lk = [0, 1, 13, 131, 128, 257], [3, 1, 0, 131, 200, 257]
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lq)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lk)]).astype(np.int32))
    q, k = _rand(rng, (sum(lq), 4, dqk), "bfloat16"), _rand(rng, (sum(lk), 2, dqk), "bfloat16")
    v = _rand(rng, (sum(lk), 2, dv), "bfloat16")
    for causal in (False, True):
        out, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True)
        dout = _rand(rng, out.shape, "bfloat16")
        grads = cuflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max(lq), max(lk), causal=causal)
        ref = attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=causal)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
            _assert_rows(name, g, cupy.asarray(r), "bfloat16", BWD_TOL, dout)


def test_wrong_dout_shape_is_named(rng):
    import cuflash

    q, k, v = _rand(rng, (1, 8, 2, 64), "float16"), _rand(rng, (1, 8, 2, 64), "float16"), _rand(rng, (1, 8, 2, 32), "float16")
    out, lse = cuflash.forward(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="dout must have the shape of q with v's head_dim"):
        cuflash.backward(q, q, k, v, out, lse)
