"""GPU: the backward with a value head dim of its own (Dv != Dqk, issue #43) against the float64 reference, on
every kernel family, dense and varlen (cuflash/head_dims.py pads to one head dim; tests/test_head_dims.py checks
that identity on the CPU). Gradient buffers poisoned, every row compared (rows where a gradient vanishes against
the incoming gradient's scale, as tests/test_variants.py)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import BWD_TOL, planned_cc, poisoned, requires_gpu
from test_dv_fwd import _rand
from test_variants import _assert_rows

pytestmark = [requires_gpu, pytest.mark.usefixtures("hopper_kernels_only")]

PAIRS = [(192, 128), (128, 64), (64, 128), (8, 24), (256, 64), (96, 40)]
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


@pytest.mark.parametrize("dqk,dv", [(192, 128), (64, 128), (128, 72)])
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


@pytest.mark.parametrize("family", [{}, {"bwd_backend": "sm80"}])
def test_varlen_seqused_k(rng, family):
    """Keys past seqused_k get dk = dv = 0 where the Hopper kernel writes dV into a wider workspace
    (head_dims.NarrowV) and the portable kernels take padded copies."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_varlen_backward

    cuflash.options.set(**family)
    lq, lk, used = [5, 70, 131], [9, 150, 131], [4, 97, 131]
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lq)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lk)]).astype(np.int32))
    seqused_k = cupy.asarray(np.array(used, dtype=np.int32))
    q, k = _rand(rng, (sum(lq), 4, 192), "bfloat16"), _rand(rng, (sum(lk), 2, 192), "bfloat16")
    v = _rand(rng, (sum(lk), 2, 128), "bfloat16")
    out, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), seqused_k=seqused_k, return_lse=True)
    dout = _rand(rng, out.shape, "bfloat16")
    bufs = [poisoned(x.shape, "bfloat16") for x in (q, k, v)]
    grads = cuflash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max(lq), max(lk), seqused_k=seqused_k,
                                    dq=bufs[0], dk=bufs[1], dv=bufs[2])
    ref = attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, seqused_k=seqused_k)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        _assert_rows(name, g, cupy.asarray(r), "bfloat16", BWD_TOL, dout)
    starts = np.cumsum([0] + lk[:-1])
    unused = cupy.asarray(np.concatenate([np.arange(s + u, s + n) for s, u, n in zip(starts, used, lk)]))
    for name, g in (("dk", grads[1]), ("dv", grads[2])):
        assert not bool(cupy.any(g[unused].astype(cupy.float32))), f"{name}: keys past seqused_k are not 0"


def test_dense_not_tma_addressable(rng, monkeypatch):
    """v broadcast over its heads (a stride of 0, which TMA cannot address): the portable kernels run, on
    zero-padded copies (head_dims.NarrowV with sm90_reads False)."""
    import cupy
    import cuflash
    from cuflash import sm90
    from cuflash.reference import attention_reference_backward

    monkeypatch.undo()   # hopper_kernels_only: this test wants the fallback, and checks that it happened
    maps, found = sm90.bwd_tensor_maps, []
    monkeypatch.setattr(sm90, "bwd_tensor_maps", lambda *args: found.append(maps(*args)) or found[-1])

    b, n, h, dqk, dv = 2, 77, 2, 128, 64
    q, k = _rand(rng, (b, n, h, dqk), "float16"), _rand(rng, (b, n, h, dqk), "float16")
    v = cupy.broadcast_to(_rand(rng, (b, n, 1, dv), "float16"), (b, n, h, dv))
    out, lse = cuflash.forward(q, k, v, causal=True, return_lse=True)
    dout = _rand(rng, out.shape, "float16")
    grads = cuflash.backward(dout, q, k, v, out, lse, causal=True)
    assert found and all(m is None for m in found) or planned_cc() != 90
    ref = attention_reference_backward(dout, q, k, v, causal=True)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        _assert_rows(name, g, cupy.asarray(r), "float16", BWD_TOL, dout)


def test_wrong_dout_shape_is_named(rng):
    import cuflash

    q, k, v = _rand(rng, (1, 8, 2, 64), "float16"), _rand(rng, (1, 8, 2, 64), "float16"), _rand(rng, (1, 8, 2, 32), "float16")
    out, lse = cuflash.forward(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="dout must have the shape of q with v's head_dim"):
        cuflash.backward(q, q, k, v, out, lse)
