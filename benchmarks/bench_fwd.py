"""Forward benchmarks: cuflash beside PyTorch SDPA (flash, cuDNN) and FlashAttention-4, on the
standard shapes with normal inputs and on a few shapes with other score distributions
(conftest.CASES); every peer reads cuflash's own inputs (DLPack views).

    pytest benchmarks/ --benchmark-only -q
"""
from __future__ import annotations

import pytest
from conftest import CASES, case_id, case_label, peer

from cuflash.bench import FP8_SHAPES, fp8_inputs, fp8_label, tflops, time_cuda, torch_inputs, torch_sdpa, torch_views
from cuflash.distributions import make_inputs

REPEATS = 50


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fwd_cuflash(benchmark, record, case):
    import cupy
    import cuflash

    shape, dist = case
    q, k, v = make_inputs(shape, dist)
    out = cupy.empty_like(q)

    def run():
        cuflash.forward(q, k, v, causal=shape.causal, out=out)

    ms = time_cuda(run, repeats=REPEATS)
    benchmark.extra_info["tflops"] = tflops(shape.fwd_flops(), ms)
    record(case_label(shape, dist), "fwd", "cuflash", benchmark.extra_info["tflops"])
    benchmark.pedantic(lambda: (run(), cupy.cuda.get_current_stream().synchronize()), rounds=10, iterations=1)


@pytest.mark.parametrize("impl", ["sdpa_flash", "sdpa_cudnn", "fa4"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fwd_peer(benchmark, record, case, impl):
    """A peer on the same inputs as test_fwd_cuflash; skips if the peer is absent or cannot run the shape."""
    fn, sdpa_layout = peer(impl)
    import torch

    shape, dist = case
    tq, tk, tv = torch_views(make_inputs(shape, dist), sdpa_layout=sdpa_layout)
    try:
        fn(tq, tk, tv, shape.causal)  # FA4 compiles each new shape on its first call
        ms = time_cuda(lambda: fn(tq, tk, tv, shape.causal), repeats=REPEATS)
    except Exception as e:  # noqa: BLE001 - SDPA RuntimeError, FA4 DSL / assertion errors
        pytest.skip(f"{impl} does not run this shape: {type(e).__name__}: {str(e)[:100]}")
    benchmark.extra_info["tflops"] = tflops(shape.fwd_flops(), ms)
    record(case_label(shape, dist), "fwd", impl, benchmark.extra_info["tflops"])
    benchmark.pedantic(lambda: (fn(tq, tk, tv, shape.causal), torch.cuda.synchronize()), rounds=10, iterations=1)


@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: fp8_label(s).replace(" ", "_"))
def test_fwd_fp8_cuflash(benchmark, record, shape):
    """e4m3 inputs, bf16 output (Hopper only); the peers' bf16 forward is recorded in the same row."""
    import cupy
    import cuflash
    from cuflash.dispatch import device_info

    if device_info(cupy.cuda.Device().id)[0] != 90:
        pytest.skip("the fp8 forward needs compute capability 9.0")
    q8, k8, v8, dq, dk, dv = fp8_inputs(shape)
    out = cupy.empty(q8.shape, dtype=cuflash.api._checks.BFLOAT16)

    def run():
        cuflash.forward_fp8(q8, k8, v8, dq, dk, dv, causal=shape.causal, out=out)

    ms = time_cuda(run, repeats=REPEATS)
    benchmark.extra_info["tflops"] = tflops(shape.fwd_flops(), ms)
    record(fp8_label(shape), "fwd fp8", "cuflash", benchmark.extra_info["tflops"])
    for backend in ("flash", "cudnn"):
        fn = torch_sdpa(backend)
        if fn is not None:
            tq, tk, tv = torch_inputs(shape)
            record(fp8_label(shape), "fwd fp8", f"sdpa_{backend}",
                   tflops(shape.fwd_flops(), time_cuda(lambda: fn(tq, tk, tv, shape.causal), repeats=REPEATS)))
    benchmark.pedantic(lambda: (run(), cupy.cuda.get_current_stream().synchronize()), rounds=10, iterations=1)
