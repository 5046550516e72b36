"""Backward and forward+backward benchmarks beside PyTorch SDPA (flash, cuDNN).

FLOPs: backward 2.5x and forward+backward 3.5x the forward's.
"""
from __future__ import annotations

import pytest

from cuflash.bench import STANDARD_SHAPES, random_inputs, tflops, time_cuda, torch_inputs, torch_sdpa

REPEATS = 30


@pytest.mark.parametrize("shape", STANDARD_SHAPES, ids=lambda s: s.label().replace(" ", "_"))
def test_bwd_cuflash(benchmark, record, shape):
    import cupy
    import cuflash

    q, k, v = random_inputs(shape)
    dout = random_inputs(shape, seed=1)[0]
    out, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
    grads = [cupy.empty_like(x) for x in (q, k, v)]

    def bwd():
        cuflash.backward(dout, q, k, v, out, lse, causal=shape.causal, dq=grads[0], dk=grads[1], dv=grads[2])

    def fwd_bwd():
        o, l = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True, out=out)
        cuflash.backward(dout, q, k, v, o, l, causal=shape.causal, dq=grads[0], dk=grads[1], dv=grads[2])

    flops = shape.fwd_flops()
    record(shape.label(), "bwd", "cuflash", tflops(2.5 * flops, time_cuda(bwd, repeats=REPEATS)))
    benchmark.extra_info["tflops"] = tflops(3.5 * flops, time_cuda(fwd_bwd, repeats=REPEATS))
    record(shape.label(), "fwd+bwd", "cuflash", benchmark.extra_info["tflops"])
    benchmark.pedantic(lambda: (fwd_bwd(), cupy.cuda.get_current_stream().synchronize()), rounds=5, iterations=1)


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("shape", STANDARD_SHAPES, ids=lambda s: s.label().replace(" ", "_"))
def test_bwd_sdpa(benchmark, record, shape, backend):
    fn = torch_sdpa(backend)
    if fn is None:
        pytest.skip("PyTorch with CUDA is not installed")
    import torch

    q, k, v = torch_inputs(shape, requires_grad=True)
    dout = torch.randn_like(q)
    flops = shape.fwd_flops()
    try:
        o = fn(q, k, v, shape.causal)
        ms = time_cuda(lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True), repeats=REPEATS)
        record(shape.label(), "bwd", f"sdpa_{backend}", tflops(2.5 * flops, ms))
        ms = time_cuda(lambda: torch.autograd.grad(fn(q, k, v, shape.causal), (q, k, v), dout), repeats=REPEATS)
    except RuntimeError as e:
        pytest.skip(f"SDPA {backend} does not run this shape: {str(e)[:100]}")
    benchmark.extra_info["tflops"] = tflops(3.5 * flops, ms)
    record(shape.label(), "fwd+bwd", f"sdpa_{backend}", benchmark.extra_info["tflops"])
    benchmark.pedantic(lambda: (torch.autograd.grad(fn(q, k, v, shape.causal), (q, k, v), dout),
                                torch.cuda.synchronize()), rounds=5, iterations=1)
