"""Hopper kernels with mbarrier waits given a suspend-time hint (CUFLASH_MBAR_SUSPEND_NS, through
CUFLASH_NVRTC_DEFINES) against none: forward and backward TFLOP/s, B=4 H=16 N=4096.

    python3 scripts/bench_mbar_hint.py 0 20000 1000000
"""
from __future__ import annotations

import os
import sys

import cupy

import cuflash
from cuflash import api
from cuflash.bench import Shape, random_inputs, tflops, time_cuda

SHAPES = [Shape(4, 16, 4096, 128, "bfloat16", False), Shape(4, 16, 4096, 128, "bfloat16", True),
          Shape(4, 16, 4096, 64, "float16", True), Shape(4, 16, 4096, 256, "bfloat16", False),
          Shape(16, 16, 1024, 64, "float16", False)]


def main(hints: list[str]) -> None:
    print("| shape | " + " | ".join(f"fwd {h} / bwd {h} / bwd det {h}" for h in hints) + " |")
    for shape in SHAPES:
        q, k, v = random_inputs(shape)
        dout = random_inputs(shape, seed=1)[0]
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        out = cupy.empty_like(q)
        cells = []
        for h in hints:
            os.environ["CUFLASH_NVRTC_DEFINES"] = f"-DCUFLASH_MBAR_SUSPEND_NS={h}"
            api._fwd_plans.clear()
            api._bwd_plans.clear()
            f = time_cuda(lambda: cuflash.forward(q, k, v, causal=shape.causal, out=out), repeats=30)
            o, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
            times = []
            for det in (False, True):
                times.append(time_cuda(lambda: cuflash.backward(dout, q, k, v, o, lse, causal=shape.causal,
                                                                deterministic=det, dq=grads[0], dk=grads[1],
                                                                dv=grads[2]), repeats=20))
            fl = shape.fwd_flops()
            cells.append(f"{tflops(fl, f):.0f} / {tflops(2.5 * fl, times[0]):.0f} / {tflops(2.5 * fl, times[1]):.0f}")
        print(f"| {shape.label()} | " + " | ".join(cells) + " |", flush=True)
        del q, k, v, dout, grads, out
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(sys.argv[1:] or ["0", "1000000"])
