"""The forward's experimental option -DCUFLASH_SM90_FWD_RESCALE_UNDER_QK=1 (kernels_cu/sm90/fwd.cu, off by
default: O's rescale moved under the next Q K^T): it compiles without spills (CPU), and its results on sharp
and outlier inputs match float64 (GPU, compute capability 9.0), so that the A/B in sm90/NOTES.md times a
correct kernel."""
from __future__ import annotations

import pytest

from cuflash import heuristics
from cuflash.compile import compile_offline

from compile_checks import assert_no_spills
from conftest import FWD_TOL, assert_lse_matches, poisoned, requires_gpu

DEFINE = "-DCUFLASH_SM90_FWD_RESCALE_UNDER_QK=1"
CASES = [(dtype, d, causal) for dtype in ("float16", "bfloat16") for d in (64, 128, 256) for causal in (False, True)]


@pytest.mark.parametrize("dtype,d,causal", CASES)
def test_option_compiles_without_spills(monkeypatch, dtype, d, causal):
    monkeypatch.setenv("CUFLASH_NVRTC_DEFINES", DEFINE)
    cfg = heuristics.fwd_config(dtype, d, causal, 90)
    _, log = compile_offline(cfg, "90a")
    assert_no_spills(log, f"{cfg.key()} {DEFINE}")


@requires_gpu
@pytest.mark.parametrize("dist", ["outlier12", "sharp"])
@pytest.mark.parametrize("dtype,d,causal", CASES)
def test_option_against_float64(monkeypatch, dist, dtype, d, causal):
    import cupy
    import numpy as np
    import cuflash
    from cuflash import api
    from cuflash.bench import Shape
    from cuflash.distributions import make_inputs
    from cuflash.reference import attention_reference, rel_err

    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("needs compute capability 9.0 (sm_90a)")
    monkeypatch.setenv("CUFLASH_NVRTC_DEFINES", DEFINE)
    monkeypatch.delenv("CUFLASH_FWD_BACKEND", raising=False)
    api._fwd_plans.clear()
    try:
        shape = Shape(1, 4, 1031, d, dtype, causal, heads_kv=2, seqlen_k=1100)
        q, k, v = make_inputs(shape, dist, seed=7)
        out = poisoned(q.shape, dtype)
        o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
        cupy.cuda.get_current_stream().synchronize()
        ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
        err = rel_err(o, ref_o)
        assert np.isfinite(err) and err <= FWD_TOL[dtype], f"out rel err {err:.3e}"
        assert_lse_matches(lse, ref_lse, (1, 4, 1031))
    finally:
        api._fwd_plans.clear()
