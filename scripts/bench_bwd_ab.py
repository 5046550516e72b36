"""Backward-only time of the benchmark table's rows, default and deterministic, for A/B runs of
two checkouts in one device call (each run is one process on one checkout):

    PYTHONPATH=<checkout> python3 scripts/bench_bwd_ab.py --precompile   # compile its kernels
    PYTHONPATH=<checkout> python3 scripts/bench_bwd_ab.py --tag A         # one line per row

Run the checkouts alternately (A B A B) and compare the medians; the inputs are the same
random normal tensors in every run (fixed seeds).
"""
from __future__ import annotations

import argparse
import os
import sys

ROWS = [(4, 16, 4096, 64, "float16", False), (4, 16, 4096, 64, "float16", True),
        (4, 16, 4096, 128, "bfloat16", False), (4, 16, 4096, 128, "bfloat16", True),
        (4, 16, 4096, 256, "bfloat16", False), (4, 16, 4096, 256, "bfloat16", True),
        (1, 16, 16384, 128, "bfloat16", True), (16, 16, 1024, 64, "float16", False)]


def _configs():
    from cuflash import heuristics

    out = []
    for _, _, _, d, dtype, causal in ROWS:
        out.append(heuristics.fwd_config(dtype, d, causal, 90))
        for det in (False, True):
            out += heuristics.bwd_configs(dtype, d, causal, 90, det).all()
    return list({c.key(): c for c in out}.values())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--tag", default=os.environ.get("PYTHONPATH", "."))
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if args.precompile:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from precompile import precompile_parallel

        failed = precompile_parallel(_configs())
        print(f"{args.tag}: precompiled, {len(failed)} failed", *failed, sep="\n")
        return 1 if failed else 0

    import cupy

    import cuflash
    from cuflash.bench import Shape, random_inputs, tflops, time_cuda

    for row in ROWS:
        shape = Shape(*row)
        q, k, v = random_inputs(shape)
        dout = random_inputs(shape, seed=1)[0]
        out, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        cells = []
        for det in (False, True):
            ms = time_cuda(lambda: cuflash.backward(dout, q, k, v, out, lse, causal=shape.causal,  # noqa: B023
                                                    deterministic=det, dq=grads[0], dk=grads[1], dv=grads[2]),
                           repeats=args.repeats)
            cells.append(f"{'det' if det else 'default'} {ms:.3f} ms {tflops(2.5 * shape.fwd_flops(), ms):.0f} TF/s")
        print(f"{args.tag} | {shape.label()} | " + " | ".join(cells), flush=True)
        del q, k, v, dout, out, lse, grads
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
