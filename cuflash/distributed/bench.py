"""Ring attention against one GPU: ``python -m cuflash.distributed.bench [--gpus 2,4] [--seqlen 131072] ...``.

For each ring size, one process per GPU; every rank draws the whole sequence from one seed and keeps its
zig-zag shard. Each repeat first times single-GPU cuflash on the whole sequence on GPU 0 (the others
wait), then the ring forward + backward on all GPUs, so the two alternate and share the clocks'
drift. Prints per-rank times, the time each rank's kernels stood waiting for NCCL, and the speed-up of
the slowest rank over one GPU (medians).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

from .check import Case, global_inputs


def _barrier(group) -> None:
    """Every rank here, nothing queued: an all-reduce of one float on the compute stream, then a sync."""
    import cupy
    from cupy.cuda import nccl

    x = cupy.zeros(1, dtype=np.float32)
    stream = cupy.cuda.get_current_stream()
    group.comm.allReduce(x.data.ptr, x.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    stream.synchronize()


def _timed(fwd, bwd) -> tuple[float, float]:
    """(forward ms, backward ms) of one forward then backward, by CUDA events on the current stream."""
    import cupy

    e0, e1, e2 = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
    e0.record()
    saved = fwd()
    e1.record()
    bwd(saved)
    e2.record()
    e2.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1), cupy.cuda.get_elapsed_time(e1, e2)


def _bench_rank(group, case: Case, warmup: int, repeats: int, single: bool) -> dict:
    import cuflash
    from . import ring_backward, ring_forward, zigzag_shard

    whole = global_inputs(case)
    q, k, v, dout = (zigzag_shard(x, group.world, group.rank) for x in whole)
    run_single = single and group.rank == 0
    if not run_single:
        del whole
    causal = case.causal

    def ring_fwd():
        return ring_forward(q, k, v, group, causal=causal, return_lse=True)

    def ring_bwd(saved):
        ring_backward(dout, q, k, v, *saved, group, causal=causal)

    samples = {"ring_fwd": [], "ring_bwd": [], "ring_wait": [], "single_fwd": [], "single_bwd": []}
    for i in range(warmup + repeats):
        keep = i >= warmup
        if single:
            _barrier(group)
            if run_single:
                wq, wk, wv, wdo = whole
                f, b = _timed(lambda: cuflash.forward(wq, wk, wv, causal=causal, return_lse=True),
                              lambda s: cuflash.backward(wdo, wq, wk, wv, *s, causal=causal))
                if keep:
                    samples["single_fwd"].append(f)
                    samples["single_bwd"].append(b)
        _barrier(group)
        group.wait_ms()   # clears the waits of earlier runs
        f, b = _timed(ring_fwd, ring_bwd)
        wait = group.wait_ms()
        if keep:
            samples["ring_fwd"].append(f)
            samples["ring_bwd"].append(b)
            samples["ring_wait"].append(wait)
    return {name: statistics.median(x) if x else None for name, x in samples.items()}


def bench(world: int, case: Case, *, warmup: int = 2, repeats: int = 5, single: bool = True) -> list[dict]:
    """Per-rank medians {ring_fwd, ring_bwd, ring_wait, single_fwd, single_bwd} (ms; single only on rank 0)."""
    from .launch import run_ranks

    return run_ranks(_bench_rank, world, (case, warmup, repeats, single), time_waits=True, timeout_s=300)


def fwd_bwd_flops(case: Case) -> float:
    """Forward + backward FLOPs of the whole sequence (backward = 2.5 x forward), causal halved."""
    f = 4.0 * case.batch * case.heads * case.seqlen * case.seqlen * case.head_dim
    return 3.5 * f * (0.5 if case.causal else 1.0)


def main(argv=None) -> int:
    from .launch import gpu_count

    ap = argparse.ArgumentParser(prog="python -m cuflash.distributed.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="", help="ring sizes, comma-separated (default: every visible GPU)")
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    ap.add_argument("--no-causal", action="store_true", help="no mask (default: causal)")
    ap.add_argument("--dist", default="normal", help="score distribution (cuflash.distributions)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    worlds = [int(x) for x in args.gpus.split(",") if x] or [gpu_count()]
    if min(worlds) < 1:
        print("cuflash.distributed.bench: no GPU visible", file=sys.stderr)
        return 1
    case = Case(args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim, args.dtype, not args.no_causal,
                args.dist)
    flops = fwd_bwd_flops(case)
    print(f"# ring attention, {case.label()}, forward + backward, medians of {args.repeats}", flush=True)
    print("| GPUs | rank | fwd ms | bwd ms | fwd+bwd ms | waiting on NCCL ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    summary = []
    for world in worlds:
        ranks = bench(world, case, warmup=args.warmup, repeats=args.repeats, single=not args.no_single)
        for r, m in enumerate(ranks):
            print(f"| {world} | {r} | {m['ring_fwd']:.1f} | {m['ring_bwd']:.1f} | {m['ring_fwd'] + m['ring_bwd']:.1f} "
                  f"| {m['ring_wait']:.2f} |", flush=True)
        ring_ms = max(m["ring_fwd"] + m["ring_bwd"] for m in ranks)
        row = {"gpus": world, "case": case.label(), "ranks": ranks, "ring_ms": ring_ms,
               "ring_tflops_per_gpu": flops / (ring_ms * 1e-3) / 1e12 / world}
        if ranks[0]["single_fwd"] is not None:
            single_ms = ranks[0]["single_fwd"] + ranks[0]["single_bwd"]
            row.update(single_ms=single_ms, speedup=single_ms / ring_ms,
                       single_tflops=flops / (single_ms * 1e-3) / 1e12)
        summary.append(row)
    print()
    print("| GPUs | one GPU ms | ring ms (slowest rank) | speed-up | efficiency | TFLOP/s per GPU (ring / one) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in summary:
        if "speedup" in row:
            print(f"| {row['gpus']} | {row['single_ms']:.1f} | {row['ring_ms']:.1f} | {row['speedup']:.2f}x | "
                  f"{row['speedup'] / row['gpus']:.1%} | {row['ring_tflops_per_gpu']:.0f} / {row['single_tflops']:.0f} |")
        else:
            print(f"| {row['gpus']} | - | {row['ring_ms']:.1f} | - | - | {row['ring_tflops_per_gpu']:.0f} / - |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    # The package's copy of this module, not __main__: the ranks' functions and cases pickle by that name.
    from cuflash.distributed import bench as _module

    sys.exit(_module.main())
