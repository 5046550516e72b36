"""Forward benchmarks: cuflash beside PyTorch SDPA (flash, cuDNN) on the standard shapes.

    pytest benchmarks/ --benchmark-only -q
"""
from __future__ import annotations

import pytest

from cuflash.bench import STANDARD_SHAPES, tflops, time_cuda, torch_inputs, torch_sdpa, random_inputs

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
