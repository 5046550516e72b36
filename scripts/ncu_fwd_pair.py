"""Three forwards (or forward + backward) of cuflash, of PyTorch SDPA (cuDNN backend) or of
FlashAttention-4, on inputs of one shape and score distribution, for ncu:

    ncu -k regex:... python3 scripts/ncu_fwd_pair.py B,H,N,D,dtype[,causal] [cuflash|cudnn|fa4] [fwd|bwd] [dist]

FA4 needs $CUFLASH_FA4_PATH (as ``python -m cuflash`` does); dist is one of cuflash/distributions.py.
"""
from __future__ import annotations

import sys

import cupy

import cuflash
from cuflash.bench import Shape, fa4_fn, torch_views, torch_sdpa
from cuflash.distributions import make_inputs


def main() -> int:
    shape = Shape.parse(sys.argv[1] if len(sys.argv) > 1 else "4,16,4096,128,bfloat16")
    which = sys.argv[2] if len(sys.argv) > 2 else "cuflash"
    backward = len(sys.argv) > 3 and sys.argv[3] == "bwd"
    dist = sys.argv[4] if len(sys.argv) > 4 else "normal"
    q, k, v = make_inputs(shape, dist, 0)
    dout = make_inputs(shape, "normal", 1)[0]
    if which == "cuflash":
        out = cupy.empty_like(q)
        for _ in range(3):
            if backward:
                o, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
                cuflash.backward(dout, q, k, v, o, lse, causal=shape.causal)
            else:
                cuflash.forward(q, k, v, causal=shape.causal, out=out)
    else:
        import torch

        run, sdpa_layout = (torch_sdpa("cudnn"), True) if which == "cudnn" else (fa4_fn(), False)
        if run is None:
            raise SystemExit(f"{which} does not run here")
        tq, tk, tv = torch_views((q, k, v), sdpa_layout=sdpa_layout, requires_grad=backward)
        (tdo,) = torch_views((dout,), sdpa_layout=sdpa_layout)
        for _ in range(3):
            o = run(tq, tk, tv, shape.causal)
            if backward:
                torch.autograd.grad(o, (tq, tk, tv), tdo)
    cupy.cuda.runtime.deviceSynchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
