"""Many threads calling forward and backward on shared inputs, every result compared bit for bit with
the single-thread one (tests/test_concurrency.py runs it in-process, and as a script in a process of its
own where the environment must be set before CuPy starts: per-thread default streams, a cold kernel cache).

    python tests/concurrency_worker.py [--streams current|own|fresh] [--threads 8] [--iterations 12]
        [--devices 0,1] [--count-compiles]

prints one JSON line: {"mismatches": [...], "calls": N, "stream_ptr": P, "compiles": {...}}.
"""
from __future__ import annotations

import argparse
import json
import random
import threading

import numpy as np

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal). On Hopper the forward of each is a
# persistent kernel (one CTA per SM at most, tiles from a counter): the small ones leave most SMs free, so
# that launches from other threads run beside them.
CASES = [
    (1, 512, 512, 4, 4, 64, "float16", False),
    (2, 1000, 1000, 4, 2, 64, "float16", True),
    (1, 2048, 2048, 8, 8, 128, "bfloat16", True),
    (3, 333, 517, 2, 1, 96, "bfloat16", False),
    (1, 1500, 1500, 2, 2, 64, "bfloat16", True),
]


def _dtype(name: str):
    import ml_dtypes

    return {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[name]


def make_inputs(case, seed: int, device_id: int = 0):
    """(q, k, v, dout) on ``device_id``, the same for one seed on every device."""
    import cupy

    b, nq, nk, hq, hkv, d, dtype, _ = case
    rng = np.random.default_rng(seed)
    shapes = ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d), (b, nq, hq, d))
    with cupy.cuda.Device(device_id):
        return tuple(cupy.asarray(rng.standard_normal(s).astype(np.float32).astype(_dtype(dtype))) for s in shapes)


def run_case(case, inputs, out=None, backward: bool = True):
    """Forward (out, lse) and, deterministic, the backward's (dq, dk, dv) on the current stream."""
    import cuflash

    q, k, v, dout = inputs
    causal = case[-1]
    o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
    if not backward:
        return o, lse
    return (o, lse, *cuflash.backward(dout, q, k, v, o, lse, causal=causal, deterministic=True))


def same_bits(a, b) -> bool:
    import cupy

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {2: cupy.uint16, 4: cupy.uint32}[a.dtype.itemsize]
    return bool(cupy.array_equal(a.view(view), b.view(view)))


NAMES = ("out", "lse", "dq", "dk", "dv")


def references(devices) -> dict:
    """(case index, device) -> inputs and the single-thread results, computed before any thread starts."""
    import cupy

    refs = {}
    for device_id in devices:
        with cupy.cuda.Device(device_id):
            for i, case in enumerate(CASES):
                inputs = make_inputs(case, seed=1000 + i, device_id=device_id)
                results = run_case(case, inputs)
                cupy.cuda.get_current_stream().synchronize()
                refs[i, device_id] = (inputs, results)
    return refs


def hammer(refs: dict, *, threads: int, iterations: int, streams: str, devices) -> tuple[list, int]:
    """``threads`` threads, each ``iterations`` rounds over every case in its own order, launching a round's
    calls back to back before one wait: forward with ``out`` allocated and given, the backward on every
    other round (not with "fresh" streams). ``streams``: "current" (CuPy's current stream: per-thread
    default streams when CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1), "own" (a stream per thread), "fresh" (a
    new stream per round, dropped while its kernels run, so that stream handles come back). Returns
    (mismatches, calls)."""
    import cupy

    mismatches, calls = [], [0]
    lock = threading.Lock()
    barrier = threading.Barrier(threads)

    def worker(t: int):
        rng = random.Random(t)
        device_id = devices[t % len(devices)]
        with cupy.cuda.Device(device_id):
            own = cupy.cuda.Stream(non_blocking=True) if streams == "own" else None
            outs = {i: cupy.empty_like(refs[i, device_id][0][0]) for i in range(len(CASES))}
            barrier.wait()
            for it in range(iterations):
                stream = own or (cupy.cuda.Stream(non_blocking=True) if streams == "fresh" else None)
                order = list(range(len(CASES)))
                rng.shuffle(order)
                pending = []
                with stream or cupy.cuda.get_current_stream():
                    for i in order:
                        inputs, _ = refs[i, device_id]
                        # Not the backward on a "fresh" stream: its workspaces go back to CuPy's pool under the
                        # stream's handle when the call returns, and CuPy hands them to the next stream that
                        # gets the handle while the kernels may still run (cupy/cuda/stream.pyx, Stream.__del__).
                        backward = it % 2 == 0 and streams != "fresh"
                        pending.append((i, "out=None", run_case(CASES[i], inputs, backward=backward)))
                        pending.append((i, "out given", run_case(CASES[i], inputs, out=outs[i], backward=False)))
                    done = cupy.cuda.get_current_stream().record()
                del stream   # "fresh": the handle goes while its kernels may still run
                done.synchronize()
                for i, label, results in pending:
                    for name, x, r in zip(NAMES, results, refs[i, device_id][1]):
                        if not same_bits(x, r):
                            with lock:
                                mismatches.append(f"thread {t} round {it} case {CASES[i]} {label}: {name} differs")
                with lock:
                    calls[0] += len(pending)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return mismatches, calls[0]


def count_compiles() -> dict:
    """Wraps cupy.RawModule so that each module build cuflash asks for is counted by its options."""
    import cupy

    counts: dict = {}
    lock = threading.Lock()
    real = cupy.RawModule

    def counting(*args, **kwargs):
        key = " ".join(kwargs.get("options", ())) + " " + " ".join(kwargs.get("name_expressions", ()))
        with lock:
            counts[key] = counts.get(key, 0) + 1
        return real(*args, **kwargs)

    cupy.RawModule = counting
    return counts


def cold_start(threads: int) -> None:
    """``threads`` threads asking for every case's kernels at once, before anything is compiled."""
    barrier = threading.Barrier(threads)
    errors = []

    def worker(t: int):
        barrier.wait()
        try:
            for i in ([t % len(CASES)] + list(range(len(CASES)))):
                run_case(CASES[i], make_inputs(CASES[i], seed=1000 + i))
        except Exception as e:  # noqa: BLE001 - reported by the parent
            errors.append(repr(e))

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    if errors:
        raise RuntimeError(errors[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", default="current", choices=("current", "own", "fresh"))
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--devices", default="0")
    parser.add_argument("--count-compiles", action="store_true")
    args = parser.parse_args()
    import cupy

    compiles = count_compiles() if args.count_compiles else None
    if compiles is not None:
        cold_start(args.threads)
    devices = [int(x) for x in args.devices.split(",")]
    refs = references(devices)
    mismatches, calls = hammer(refs, threads=args.threads, iterations=args.iterations, streams=args.streams,
                               devices=devices)
    print(json.dumps({"mismatches": mismatches[:20], "n_mismatches": len(mismatches), "calls": calls,
                      "stream_ptr": cupy.cuda.get_current_stream().ptr, "compiles": compiles}))


if __name__ == "__main__":
    main()
