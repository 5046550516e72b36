"""Threads, streams, devices and CUDA graphs (GPU): every result of a concurrent or replayed call must be
bit for bit the one a lone call gives (the forward is deterministic, the backward here too). On Hopper
the forward's persistent kernels take their tiles from a counter in device memory, which two kernels
running at once must never share (cuflash/tile_counters.py); with one counter per stream pointer, four
threads on per-thread default streams returned 3 wrong outputs in 160 (issue #29).

The per-thread-default-stream and cold-start cases run tests/concurrency_worker.py in a process of their
own: CuPy reads CUPY_CUDA_PER_THREAD_DEFAULT_STREAM and CUPY_CACHE_DIR when it starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import planned_cc, randn, requires_gpu

pytestmark = requires_gpu

WORKER = Path(__file__).with_name("concurrency_worker.py")
sys.path.insert(0, str(WORKER.parent))


def _worker(*args: str, env: dict | None = None, timeout: int = 540) -> dict:
    """Runs the worker script with these arguments and extra environment; its JSON report."""
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run([sys.executable, str(WORKER), *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout, cwd=WORKER.parent.parent)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_clean(report: dict) -> None:
    assert report["n_mismatches"] == 0, (f"{report['n_mismatches']} of {report['calls']} concurrent calls "
                                         f"differ from the lone call's result:\n" + "\n".join(report["mismatches"]))


@pytest.mark.parametrize("cluster", ["auto", "1"])
def test_per_thread_default_streams(cluster):
    """Eight threads on their per-thread default streams (every one of them stream pointer 2); with
    CUFLASH_SM90_FWD_CLUSTER=1 the persistent cluster kernels (which count finished CTAs in the same slot)."""
    report = _worker("--streams", "current", "--threads", "8", "--iterations", "12",
                     env={"CUPY_CUDA_PER_THREAD_DEFAULT_STREAM": "1", "CUFLASH_SM90_FWD_CLUSTER": cluster})
    assert report["stream_ptr"] == 2, "the per-thread default stream was not in effect"
    _assert_clean(report)


@pytest.mark.parametrize("streams", ["own", "fresh"])
def test_threads_on_streams(streams):
    """Eight threads, each on a stream of its own, or on a new stream every round that is dropped while its
    kernels run (CUDA hands the handle to a later stream: the handle says nothing about which kernels run)."""
    import concurrency_worker as cw

    refs = cw.references([0])
    mismatches, calls = cw.hammer(refs, threads=8, iterations=10, streams=streams, devices=[0])
    _assert_clean({"n_mismatches": len(mismatches), "calls": calls, "mismatches": mismatches[:20]})


def test_two_devices():
    """Threads split over two GPUs, each on a stream of its own (inputs and results per device)."""
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs a second GPU")
    import concurrency_worker as cw

    refs = cw.references([0, 1])
    for i in range(len(cw.CASES)):   # one kernel, one result, whichever GPU ran it
        for name, a, b in zip(cw.NAMES, refs[i, 0][1], refs[i, 1][1]):
            assert bool((cupy.asnumpy(a).view(np.uint8) == cupy.asnumpy(b).view(np.uint8)).all()), \
                f"case {cw.CASES[i]}: {name} differs between the two GPUs"
    mismatches, calls = cw.hammer(refs, threads=8, iterations=8, streams="own", devices=[0, 1])
    _assert_clean({"n_mismatches": len(mismatches), "calls": calls, "mismatches": mismatches[:20]})


def test_cold_start_compiles_each_kernel_once(tmp_path):
    """Sixteen threads asking for the same kernels at once in a process whose kernel cache is empty: each
    module is built once, and the results then match the lone call's bit for bit."""
    report = _worker("--streams", "own", "--threads", "16", "--iterations", "2", "--count-compiles",
                     env={"CUPY_CACHE_DIR": str(tmp_path / "cupy_cache")})
    compiles = report["compiles"]
    assert compiles, "no kernel was compiled: the cache was not cold"
    twice = {k: n for k, n in compiles.items() if n != 1}
    assert not twice, f"modules built more than once: {twice}"
    _assert_clean(report)


# ---------------------------------------------------------------------------------------------------------
# CUDA graphs: a captured call replays with the addresses it was captured with; new values are written
# into the same arrays between replays, and the replays must give what fresh calls give.

GRAPH_CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal)
    (2, 700, 700, 4, 2, 64, "float16", True),
    (1, 1100, 1300, 4, 4, 128, "bfloat16", False),
    (2, 333, 333, 2, 1, 96, "bfloat16", True),
]


def _bits_equal(a, b) -> bool:
    import cupy

    view = {2: cupy.uint16, 4: cupy.uint32}[a.dtype.itemsize]
    return a.shape == b.shape and bool(cupy.array_equal(a.view(view), b.view(view)))


def _capture(stream, fn):
    with stream:
        stream.begin_capture()
        try:
            result = fn()
        finally:
            graph = stream.end_capture()
    return graph, result


@pytest.mark.parametrize("case", GRAPH_CASES, ids=lambda c: f"{c[6]}-d{c[5]}-{'causal' if c[7] else 'full'}")
def test_graph_forward_and_backward(rng, case):
    """forward (out given, lse allocated in the capture) then the deterministic backward (gradients given),
    captured once and replayed four times on new values; the backward's workspaces outlive the capture."""
    import cupy

    import cuflash
    from cuflash import capture

    b, nq, nk, hq, hkv, d, dtype, causal = case
    q, dout = randn(rng, (b, nq, hq, d), dtype), randn(rng, (b, nq, hq, d), dtype)
    k, v = randn(rng, (b, nk, hkv, d), dtype), randn(rng, (b, nk, hkv, d), dtype)
    out = cupy.empty_like(q)
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)

    def step():
        o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
        cuflash.backward(dout, q, k, v, o, lse, causal=causal, deterministic=True, dq=dq, dk=dk, dv=dv)
        return lse

    step()   # compiles, plans and tensor maps outside the capture
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    kept = capture.kept_count()
    graph, lse = _capture(stream, step)
    assert capture.kept_count() > kept, "the captured backward's workspaces were not kept"
    for round_ in range(4):
        with stream:
            for x in (q, k, v, dout):
                x[...] = randn(rng, x.shape, dtype)
            out.fill(np.nan)
            for g in (dq, dk, dv):
                g.fill(np.nan)
            graph.launch(stream)
            fresh_out, fresh_lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
            fresh = cuflash.backward(dout, q, k, v, fresh_out, fresh_lse, causal=causal, deterministic=True)
        stream.synchronize()
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                                   (fresh_out, fresh_lse, *fresh)):
            assert _bits_equal(got, want), f"replay {round_}: {name} differs from a fresh call"


def test_graph_replayed_beside_eager_calls(rng):
    """A captured persistent forward replayed on other streams while eager calls on the capture stream run
    beside it: the graph holds its own tile counter, which no eager launch may take."""
    import cupy

    import cuflash

    shape_q, shape_kv = (1, 600, 4, 64), (1, 600, 4, 64)
    a = [randn(rng, s, "float16") for s in (shape_q, shape_kv, shape_kv)]
    e = [randn(rng, s, "float16") for s in (shape_q, shape_kv, shape_kv)]
    out_a, out_e = cupy.empty_like(a[0]), [cupy.empty_like(e[0]) for _ in range(3)]
    want_a, want_e = cuflash.forward(*a), cuflash.forward(*e)
    cupy.cuda.Device().synchronize()
    capture_stream = cupy.cuda.Stream(non_blocking=True)
    graph, _ = _capture(capture_stream, lambda: cuflash.forward(*a, out=out_a))
    others = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
    for round_ in range(20):
        out_a.fill(np.nan)
        for o in out_e:
            o.fill(np.nan)
        cupy.cuda.Device().synchronize()
        graph.launch(others[round_ % 3])
        with capture_stream:
            for o in out_e:
                cuflash.forward(*e, out=o)
        cupy.cuda.Device().synchronize()
        assert _bits_equal(out_a, want_a), f"round {round_}: the replayed graph's output differs"
        for o in out_e:
            assert _bits_equal(o, want_e), f"round {round_}: an eager call beside the graph differs"


def test_graph_fp8_forward(rng):
    """The fp8 forward (persistent at these sizes, V^T made inside the call) captured and replayed on new
    quantised values and descales."""
    import cupy

    import cuflash

    if planned_cc() != 90:
        pytest.skip("the fp8 forward needs compute capability 9.0")

    def quantised():
        return [cuflash.quantize_fp8(randn(rng, s, "float32")) for s in ((2, 500, 4, 128), (2, 700, 2, 128),
                                                                        (2, 700, 2, 128))]

    (q8, dq), (k8, dk), (v8, dv) = quantised()
    out = cupy.empty(q8.shape, dtype=cuflash.api._checks.BFLOAT16)
    cuflash.forward_fp8(q8, k8, v8, dq, dk, dv, causal=True, out=out)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    graph, _ = _capture(stream, lambda: cuflash.forward_fp8(q8, k8, v8, dq, dk, dv, causal=True, out=out))
    for round_ in range(3):
        with stream:
            for (x8, ds), (new8, new_ds) in zip(((q8, dq), (k8, dk), (v8, dv)), quantised()):
                x8[...] = new8
                ds[...] = new_ds
            out.fill(np.nan)
            graph.launch(stream)
            fresh = cuflash.forward_fp8(q8, k8, v8, dq, dk, dv, causal=True)
        stream.synchronize()
        assert _bits_equal(out, fresh), f"replay {round_}: the fp8 output differs from a fresh call"
