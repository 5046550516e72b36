"""Launch the Hopper forward and backward once each (after a warm-up), for ncu.

    ncu --kernel-name regex:'fwd|bwd_dkdv' --launch-skip 2 ... python3 scripts/profile_sm90.py [SPEC...]

SPEC: D:dtype:causal, e.g. 128:bfloat16:0 (default). Each spec runs forward + backward twice.
"""
from __future__ import annotations

import sys

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs


def main(specs: list[str]) -> int:
    for spec in specs or ["128:bfloat16:0"]:
        d, dtype, causal = spec.split(":")
        causal = causal == "1"
        shape = Shape(4, 16, 4096, int(d), dtype, causal)
        q, k, v = random_inputs(shape)
        dout = random_inputs(shape, seed=1)[0]
        for _ in range(2):
            out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
            cuflash.backward(dout, q, k, v, out, lse, causal=causal)
        cupy.cuda.runtime.deviceSynchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
