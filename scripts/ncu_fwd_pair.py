"""Three forwards (or forward + backward) of cuflash, or of PyTorch SDPA (cuDNN backend), on random inputs
of one shape, for ncu:

    ncu -k regex:... python3 scripts/ncu_fwd_pair.py B,H,N,D,dtype[,causal] [cuflash|cudnn] [fwd|bwd]
"""
from __future__ import annotations

import sys

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs, torch_inputs, torch_sdpa


def main() -> int:
    shape = Shape.parse(sys.argv[1] if len(sys.argv) > 1 else "4,16,4096,128,bfloat16")
    which = sys.argv[2] if len(sys.argv) > 2 else "cuflash"
    backward = len(sys.argv) > 3 and sys.argv[3] == "bwd"
    if which == "cuflash":
        q, k, v = random_inputs(shape)
        out = cupy.empty_like(q)
        dout = random_inputs(shape, seed=1)[0]
        for _ in range(3):
            if backward:
                o, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
                cuflash.backward(dout, q, k, v, o, lse, causal=shape.causal)
            else:
                cuflash.forward(q, k, v, causal=shape.causal, out=out)
    else:
        run = torch_sdpa("cudnn")
        tq, tk, tv = torch_inputs(shape, requires_grad=backward)
        for _ in range(3):
            o = run(tq, tk, tv, shape.causal)
            if backward:
                o.backward(o.detach().clone())
    cupy.cuda.runtime.deviceSynchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
