"""Sweep sm80 forward tile configurations on the device (one process, TFLOP/s table)."""
from __future__ import annotations

import itertools
import os
import sys

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs, tflops, time_cuda

CANDIDATES = {
    64: [(128, 64, 4), (128, 128, 4), (128, 32, 4)],
    128: [(128, 32, 4), (128, 64, 4), (128, 128, 4), (64, 64, 4)],
    256: [(64, 32, 4), (64, 64, 4)],
}


def main() -> int:
    dims = [int(x) for x in sys.argv[1:]] or [64, 128]
    for d in dims:
        for dtype, causal in itertools.product(["float16", "bfloat16"], [False, True]):
            shape = Shape(4, 16, 4096, d, dtype, causal)
            q, k, v = random_inputs(shape)
            out = cupy.empty_like(q)
            for tiles in CANDIDATES[d]:
                os.environ["CUFLASH_SM80_FWD_TILES"] = ",".join(map(str, tiles))
                cuflash.api._fwd_plans.clear()
                try:
                    ms = time_cuda(lambda: cuflash.forward(q, k, v, causal=causal, out=out), repeats=20)
                    print(f"D={d} {dtype} causal={causal} tiles={tiles}: {tflops(shape.fwd_flops(), ms):6.1f} TFLOP/s",
                          flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"D={d} tiles={tiles}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    os.environ.pop("CUFLASH_SM80_FWD_TILES", None)
    # Host overhead of one small call (device kept busy by the calls themselves).
    from cuflash.bench import host_overhead_us
    shape = Shape(1, 8, 128, 64, "float16", False)
    q, k, v = random_inputs(shape)
    out = cupy.empty_like(q)
    print(f"host overhead B=1 H=8 N=128 D=64: {host_overhead_us(lambda: cuflash.forward(q, k, v, out=out)):.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
