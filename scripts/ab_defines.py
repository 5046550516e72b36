"""A/B timing of NVRTC define sets (CUFLASH_NVRTC_DEFINES) on the same inputs, interleaved.

    python3 scripts/ab_defines.py bwd "" "-DCUFLASH_SM90_BWD_NO_EARLY_DV"
Prints, per shape, the median time of each define set over alternating rounds (TFLOP/s).
"""
from __future__ import annotations

import os
import statistics
import sys

import cupy

import cuflash
from cuflash import api
from cuflash.bench import Shape, random_inputs, time_cuda

SHAPES = [Shape(4, 16, 4096, 64, "float16", True), Shape(4, 16, 4096, 128, "bfloat16", False),
          Shape(4, 16, 4096, 128, "bfloat16", True), Shape(4, 16, 4096, 96, "bfloat16", False),
          Shape(1, 16, 16384, 128, "bfloat16", True), Shape(4, 16, 4096, 192, "bfloat16", False)]


def main(direction: str, variants: list[str]) -> None:
    for shape in SHAPES:
        q, k, v = random_inputs(shape)
        dout = random_inputs(shape, seed=1)[0]
        out, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        if direction == "bwd":
            run = lambda: cuflash.backward(dout, q, k, v, out, lse, causal=shape.causal,  # noqa: E731
                                           dq=grads[0], dk=grads[1], dv=grads[2])
            flops = 2.5 * shape.fwd_flops()
        else:
            run = lambda: cuflash.forward(q, k, v, causal=shape.causal, out=out)  # noqa: E731
            flops = shape.fwd_flops()
        times = {v: [] for v in variants}
        for _ in range(3):
            for var in variants:
                os.environ["CUFLASH_NVRTC_DEFINES"] = var
                api._bwd_plans.clear()
                api._fwd_plans.clear()
                times[var].append(time_cuda(run, repeats=20))
        cells = [f"{flops / statistics.median(t) / 1e9:.0f}" for t in times.values()]
        print(f"{shape.label():45s} " + " | ".join(f"{v or 'default'}: {c}" for v, c in zip(variants, cells)),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
