"""Three forwards of cuflash, or of PyTorch SDPA (cuDNN backend), on random inputs of one shape, for
ncu: ``ncu -k regex:... python3 scripts/ncu_fwd_pair.py B,H,N,D,dtype[,causal] [cuflash|cudnn]``."""
from __future__ import annotations

import sys

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs, torch_inputs, torch_sdpa


def main() -> int:
    shape = Shape.parse(sys.argv[1] if len(sys.argv) > 1 else "4,16,4096,128,bfloat16")
    which = sys.argv[2] if len(sys.argv) > 2 else "cuflash"
    if which == "cuflash":
        q, k, v = random_inputs(shape)
        out = cupy.empty_like(q)
        for _ in range(3):
            cuflash.forward(q, k, v, causal=shape.causal, out=out)
    else:
        run = torch_sdpa("cudnn")
        tq, tk, tv = torch_inputs(shape)
        for _ in range(3):
            run(tq, tk, tv, shape.causal)
    cupy.cuda.runtime.deviceSynchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
