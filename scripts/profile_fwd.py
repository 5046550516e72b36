"""Launch one forward per tile configuration, for ncu: CUFLASH_PROFILE="D:bm,bn,w;D:bm,bn,w"."""
from __future__ import annotations

import os
import sys

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs


def main() -> int:
    spec = os.environ.get("CUFLASH_PROFILE", "128:64,64,4")
    dtype = os.environ.get("CUFLASH_PROFILE_DTYPE", "float16")
    causal = os.environ.get("CUFLASH_PROFILE_CAUSAL", "0") == "1"
    for item in spec.split(";"):
        d, tiles = item.split(":")
        os.environ["CUFLASH_SM80_FWD_TILES"] = tiles
        cuflash.api._fwd_plans.clear()
        q, k, v = random_inputs(Shape(4, 16, 4096, int(d), dtype, causal))
        for _ in range(2):
            cuflash.forward(q, k, v, causal=causal)
        cupy.cuda.runtime.deviceSynchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
