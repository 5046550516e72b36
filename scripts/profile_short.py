"""Forward (and optionally SDPA cuDNN) launches of one shape, for ncu:
PROFILE_SHAPE="B,H,N,D,dtype,causal" [PROFILE_TORCH=1] python3 scripts/profile_short.py"""
from __future__ import annotations

import os
import sys

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs


def main() -> int:
    b, h, n, d, dtype, causal = os.environ.get("PROFILE_SHAPE", "16,16,1024,64,float16,0").split(",")
    shape = Shape(int(b), int(h), int(n), int(d), dtype, causal in ("1", "True"))
    q, k, v = random_inputs(shape)
    for _ in range(3):
        cuflash.forward(q, k, v, causal=shape.causal)
    cupy.cuda.runtime.deviceSynchronize()
    if os.environ.get("PROFILE_TORCH") == "1":
        import torch

        from cuflash.bench import torch_inputs, torch_sdpa

        sdpa = torch_sdpa("cudnn")
        tq, tk, tv = torch_inputs(shape)
        for _ in range(3):
            sdpa(tq, tk, tv, shape.causal)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
