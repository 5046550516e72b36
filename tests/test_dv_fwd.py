"""GPU: the forward with a value head dim of its own (Dv != Dqk, issue #43) against the float64 reference, on
every kernel family, dense and varlen: DeepSeek's (192, 128), (128, 64), Dv above Dqk, the smallest dims and
the widest. Outputs poisoned, every row compared, lse to its own bound. (The backward: tests/test_dv_bwd.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FWD_TOL, assert_close_on_every_row, assert_lse_matches, dtype_of, poisoned, requires_gpu

pytestmark = [requires_gpu, pytest.mark.usefixtures("hopper_kernels_only")]

PAIRS = [(192, 128), (128, 64), (64, 128), (8, 24), (256, 128), (128, 256), (72, 40)]
FAMILIES = [({}, "bfloat16"), ({"fwd_backend": "sm80"}, "float16"), ({}, "float32")]


def _rand(rng, shape, dtype):
    import cupy

    return cupy.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype_of(dtype)))


@pytest.mark.parametrize("family,dtype", FAMILIES)
@pytest.mark.parametrize("dqk,dv", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_dense(rng, family, dtype, dqk, dv, causal):
    import cupy
    import cuflash
    from cuflash.reference import attention_reference

    cuflash.options.set(**family)
    b, nq, nk, hq, hkv = 2, 139, 211, 4, 2
    q, k, v = _rand(rng, (b, nq, hq, dqk), dtype), _rand(rng, (b, nk, hkv, dqk), dtype), _rand(rng, (b, nk, hkv, dv), dtype)
    out = poisoned((b, nq, hq, dv), dtype)
    o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
    assert o is out
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
    assert_lse_matches(lse, ref_lse, (b, hq, nq))


@pytest.mark.parametrize("dqk,dv", [(192, 128), (64, 128)])
@pytest.mark.parametrize("nq,nk", [(1, 1), (4096, 4096), (1000, 3001)])
def test_dense_lengths(rng, dqk, dv, nq, nk):
    """Short and long sequences on the default kernels (the persistent and short tiles)."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference

    q, k, v = _rand(rng, (1, nq, 2, dqk), "bfloat16"), _rand(rng, (1, nk, 1, dqk), "bfloat16"), \
        _rand(rng, (1, nk, 1, dv), "bfloat16")
    for causal in (False, True):
        out = poisoned((1, nq, 2, dv), "bfloat16")
        o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
        ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
        assert_close_on_every_row("out", o, cupy.asarray(ref_o), "bfloat16", FWD_TOL)
        assert_lse_matches(lse, ref_lse, (1, 2, nq))


@pytest.mark.parametrize("family,dtype", FAMILIES)
@pytest.mark.parametrize("dqk,dv", [(192, 128), (64, 128)])
def test_varlen(rng, family, dtype, dqk, dv):
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_varlen

    cuflash.options.set(**family)
    lq, lk = [0, 1, 13, 131, 128, 257], [3, 1, 0, 131, 200, 257]
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lq)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lk)]).astype(np.int32))
    q, k, v = _rand(rng, (sum(lq), 4, dqk), dtype), _rand(rng, (sum(lk), 2, dqk), dtype), _rand(rng, (sum(lk), 2, dv), dtype)
    for causal in (False, True):
        out = poisoned((sum(lq), 4, dv), dtype)
        o, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True, out=out)
        ref_o, ref_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, causal=causal)
        assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
        assert_lse_matches(lse, ref_lse, ref_lse.shape)


def test_repeated_calls_keep_the_output_shape(rng):
    """The call cache's replays allocate the output with v's head dim (a replay once allocated q's shape)."""
    import cupy
    import cuflash
    from cuflash import api
    from cuflash.reference import attention_reference

    q, k, v = _rand(rng, (1, 77, 2, 192), "bfloat16"), _rand(rng, (1, 77, 1, 192), "bfloat16"), \
        _rand(rng, (1, 77, 1, 128), "bfloat16")
    ref_o, _ = attention_reference(q, k, v, causal=True)
    for _ in range(3):   # the first call records, the others replay (the freed output's block comes back)
        o = cuflash.forward(q, k, v, causal=True)
        assert o.shape == (1, 77, 2, 128)
        assert_close_on_every_row("out", o, cupy.asarray(ref_o), "bfloat16", FWD_TOL)
        del o
    assert len(api._fwd_calls) >= 1


def kernel_configs(cc: int = 90) -> list:
    """The forward KernelConfigs this file's cases run (dev/precompile.py's varlen_tests group)."""
    from cuflash import heuristics
    from cuflash.variants import MaskVariant

    out = []
    for causal in (False, True):
        for family, dtype in FAMILIES:
            for dqk, dv in PAIRS:
                out.append(heuristics.fwd_config(dtype, dqk, causal, cc, backend=family.get("fwd_backend"),
                                                 short=True, head_dim_v=dv))
                out.append(heuristics.fwd_config(dtype, dqk, causal, cc, backend=family.get("fwd_backend"),
                                                 head_dim_v=dv))
                for short in (False, True):
                    out.append(heuristics.fwd_config(dtype, dqk, causal, cc, backend=family.get("fwd_backend"),
                                                     short=short, variant=MaskVariant(varlen=True), head_dim_v=dv))
    return list({c.key(): c for c in out}.values())
