"""Backward and forward+backward benchmarks beside PyTorch SDPA (flash, cuDNN) and FlashAttention-4,
on the cases of conftest.CASES (shape, input distribution); peers read cuflash's own inputs and
output gradient (DLPack views).

FLOPs: backward 2.5x and forward+backward 3.5x the forward's.
"""
from __future__ import annotations

import pytest
from conftest import CASES, case_id, case_label, peer

from cuflash.bench import cuflash_pass_fns, random_inputs, tflops, time_cuda, torch_pass_fns, torch_views
from cuflash.distributions import make_inputs

REPEATS = 30


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bwd_cuflash(benchmark, record, case):
    import cupy

    shape, dist = case
    q, k, v = make_inputs(shape, dist)
    dout = random_inputs(shape, seed=1)[0]
    fns = cuflash_pass_fns(q, k, v, shape.causal, dout)
    flops = shape.fwd_flops()
    label = case_label(shape, dist)
    record(label, "bwd", "cuflash", tflops(2.5 * flops, time_cuda(fns["bwd"], repeats=REPEATS)))
    benchmark.extra_info["tflops"] = tflops(3.5 * flops, time_cuda(fns["fwd+bwd"], repeats=REPEATS))
    record(label, "fwd+bwd", "cuflash", benchmark.extra_info["tflops"])
    benchmark.pedantic(lambda: (fns["fwd+bwd"](), cupy.cuda.get_current_stream().synchronize()), rounds=5, iterations=1)


@pytest.mark.parametrize("impl", ["sdpa_flash", "sdpa_cudnn", "fa4"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bwd_peer(benchmark, record, case, impl):
    """A peer's backward and forward+backward (torch autograd) on the same inputs and output gradient
    as test_bwd_cuflash; skips if the peer is absent or cannot run the shape."""
    fn, sdpa_layout = peer(impl)
    import torch

    shape, dist = case
    tq, tk, tv = torch_views(make_inputs(shape, dist), sdpa_layout=sdpa_layout, requires_grad=True)
    tdout = torch_views(random_inputs(shape, seed=1)[:1], sdpa_layout=sdpa_layout)[0]
    flops = shape.fwd_flops()
    label = case_label(shape, dist)
    try:  # each pass is called once in torch_pass_fns: FA4 compiles there
        fns = torch_pass_fns(fn, tq, tk, tv, shape.causal, tdout, passes=("bwd", "fwd+bwd"))
        record(label, "bwd", impl, tflops(2.5 * flops, time_cuda(fns["bwd"], repeats=REPEATS)))
        ms = time_cuda(fns["fwd+bwd"], repeats=REPEATS)
    except Exception as e:  # noqa: BLE001 - SDPA RuntimeError, FA4 DSL / assertion errors
        pytest.skip(f"{impl} does not run this shape: {type(e).__name__}: {str(e)[:100]}")
    benchmark.extra_info["tflops"] = tflops(3.5 * flops, ms)
    record(label, "fwd+bwd", impl, benchmark.extra_info["tflops"])
    benchmark.pedantic(lambda: (fns["fwd+bwd"](), torch.cuda.synchronize()), rounds=5, iterations=1)
