"""Host cost of one call at small shapes, where the kernel is short and the Python around it shows:
cuflash.forward / backward beside PyTorch SDPA (its default backend choice), called eagerly and replayed
from a CUDA graph (cupy.cuda.Graph for cuflash, torch.cuda.CUDAGraph for SDPA). pytest-benchmark times
the host side of each call (the device keeps up at these shapes; the stream is synchronised between
rounds). Later issues that add arguments rerun this to keep the eager overhead at most SDPA's.

    python -m pytest benchmarks/bench_overhead.py --benchmark-only --benchmark-columns=median,iqr,rounds \\
        --benchmark-sort=name

Needs a GPU (benchmarks/conftest.py skips every case without one); the SDPA cases skip without PyTorch.
"""
from __future__ import annotations

import math

import pytest

# name -> (batch, heads, seqlen_q, seqlen_k, head_dim); fp16, not causal.
SHAPES = {
    "B1_H8_N128_D64": (1, 8, 128, 128, 64),
    "B1_H8_N128_D128": (1, 8, 128, 128, 128),
    "B1_H8_Nq1_Nk4096_D128": (1, 8, 1, 4096, 128),   # one decoding step against a 4k-token cache
}
BWD_SHAPES = ("B1_H8_N128_D64", "B1_H8_N128_D128")
ROUNDS, ITERATIONS = 200, 20


def _inputs(shape: str):
    import cupy

    b, h, nq, nk, d = SHAPES[shape]
    rng = cupy.random.default_rng(0)

    def mk(n):
        return rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(cupy.float16)

    return mk(nq), mk(nk), mk(nk), mk(nq)   # q, k, v, dout


def _pedantic(benchmark, fn, sync) -> None:
    """``ROUNDS`` rounds of ``ITERATIONS`` calls of ``fn``, host-timed, ``sync`` after each round so that no
    queue builds up (pytest-benchmark >= 5 runs it untimed as the teardown; older ones time rounds of
    calls without it)."""
    for _ in range(10):
        fn()
    sync()
    try:
        benchmark.pedantic(fn, rounds=ROUNDS, iterations=ITERATIONS, warmup_rounds=2,
                           teardown=lambda *a, **k: sync())
    except TypeError:   # pytest-benchmark < 5: no teardown
        benchmark.pedantic(fn, rounds=ROUNDS, iterations=ITERATIONS, warmup_rounds=2)
    sync()


def _run(benchmark, fn, stream=None):
    """Times ``fn`` (host side) on a CuPy stream."""
    import cupy

    stream = stream or cupy.cuda.get_current_stream()
    _pedantic(benchmark, fn, stream.synchronize)


def _cuflash_fn(shape: str, pass_name: str):
    import cupy
    import cuflash

    q, k, v, dout = _inputs(shape)
    if pass_name == "fwd":
        return lambda: cuflash.forward(q, k, v)
    out, lse = cuflash.forward(q, k, v, return_lse=True)
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    return lambda: cuflash.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)


def _sdpa_fn(shape: str, pass_name: str):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    from cuflash.bench import torch_views

    b, h, nq, nk, d = SHAPES[shape]
    q, k, v, dout = torch_views(_inputs(shape), sdpa_layout=True, requires_grad=pass_name == "bwd")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if pass_name == "fwd":
        return lambda: sdpa(q, k, v), torch
    out = sdpa(q, k, v)
    dout = dout.detach()
    return (lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)), torch


@pytest.mark.parametrize("pass_name", ["fwd", "bwd"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_overhead_cuflash_eager(benchmark, shape, pass_name):
    if pass_name == "bwd" and shape not in BWD_SHAPES:
        pytest.skip("the backward at the N=128 shapes only")
    benchmark.group = f"{shape} {pass_name}"
    _run(benchmark, _cuflash_fn(shape, pass_name))


@pytest.mark.parametrize("pass_name", ["fwd", "bwd"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_overhead_sdpa_eager(benchmark, shape, pass_name):
    if pass_name == "bwd" and shape not in BWD_SHAPES:
        pytest.skip("the backward at the N=128 shapes only")
    benchmark.group = f"{shape} {pass_name}"
    fn, torch = _sdpa_fn(shape, pass_name)
    _pedantic(benchmark, fn, torch.cuda.synchronize)


@pytest.mark.parametrize("pass_name", ["fwd", "bwd"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_overhead_cuflash_graph(benchmark, shape, pass_name):
    """The same call captured once into a CUDA graph (cupy.cuda.Graph), each round a replay."""
    import cupy

    if pass_name == "bwd" and shape not in BWD_SHAPES:
        pytest.skip("the backward at the N=128 shapes only")
    benchmark.group = f"{shape} {pass_name}"
    fn = _cuflash_fn(shape, pass_name)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()   # compiled and planned before the capture
        stream.synchronize()
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    _run(benchmark, lambda: graph.launch(stream), stream)


@pytest.mark.parametrize("pass_name", ["fwd", "bwd"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_overhead_sdpa_graph(benchmark, shape, pass_name):
    """SDPA captured into a torch.cuda.CUDAGraph, each round a replay."""
    if pass_name == "bwd" and shape not in BWD_SHAPES:
        pytest.skip("the backward at the N=128 shapes only")
    benchmark.group = f"{shape} {pass_name}"
    fn, torch = _sdpa_fn(shape, pass_name)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - a backend that cannot be captured is a result, not an error
        pytest.skip(f"SDPA {pass_name} not capturable here: {type(e).__name__}: {e}")
    _pedantic(benchmark, graph.replay, torch.cuda.synchronize)


def test_shapes_are_small():
    """CPU: the shapes stay where the kernel is short (the point of this file)."""
    for b, h, nq, nk, d in SHAPES.values():
        assert b * h * nq * nk * d <= 8 * 4096 * 128 and math.log2(d) % 1 == 0
