"""Forward benchmarks: cuflash beside PyTorch SDPA (flash, cuDNN) on the standard shapes.

    pytest benchmarks/ --benchmark-only -q
"""
from __future__ import annotations

import pytest

from cuflash.bench import (FP8_SHAPES, STANDARD_SHAPES, fp8_inputs, fp8_label, random_inputs, tflops,
                           time_cuda, torch_inputs, torch_sdpa)

REPEATS = 50


@pytest.mark.parametrize("shape", STANDARD_SHAPES, ids=lambda s: s.label().replace(" ", "_"))
def test_fwd_cuflash(benchmark, record, shape):
    import cupy
    import cuflash

    q, k, v = random_inputs(shape)
    out = cupy.empty_like(q)

    def run():
        cuflash.forward(q, k, v, causal=shape.causal, out=out)

    ms = time_cuda(run, repeats=REPEATS)
    benchmark.extra_info["tflops"] = tflops(shape.fwd_flops(), ms)
    record(shape.label(), "fwd", "cuflash", benchmark.extra_info["tflops"])
    benchmark.pedantic(lambda: (run(), cupy.cuda.get_current_stream().synchronize()), rounds=10, iterations=1)


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("shape", STANDARD_SHAPES, ids=lambda s: s.label().replace(" ", "_"))
def test_fwd_sdpa(benchmark, record, shape, backend):
    fn = torch_sdpa(backend)
    if fn is None:
        pytest.skip("PyTorch with CUDA is not installed")
    import torch

    q, k, v = torch_inputs(shape)
    try:
        ms = time_cuda(lambda: fn(q, k, v, shape.causal), repeats=REPEATS)
    except RuntimeError as e:
        pytest.skip(f"SDPA {backend} does not run this shape: {str(e)[:100]}")
    benchmark.extra_info["tflops"] = tflops(shape.fwd_flops(), ms)
    record(shape.label(), "fwd", f"sdpa_{backend}", benchmark.extra_info["tflops"])
    benchmark.pedantic(lambda: (fn(q, k, v, shape.causal), torch.cuda.synchronize()), rounds=10, iterations=1)


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
