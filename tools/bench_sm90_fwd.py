"""Forward TFLOP/s of the portable (sm80) and the Hopper (sm90) kernels on a few shapes.

    python3 tools/bench_sm90_fwd.py
"""
import os

import cupy
import ml_dtypes
import numpy as np

import cuflash
from cuflash import api
from cuflash.bench import time_cuda

SHAPES = [  # B, H, N, D, dtype, causal
    (4, 16, 4096, 128, "bfloat16", False),
    (4, 16, 4096, 128, "bfloat16", True),
    (4, 16, 4096, 64, "float16", False),
    (4, 16, 4096, 256, "bfloat16", False),
    (16, 16, 1024, 64, "float16", False),
]


def main():
    for b, h, n, d, dtype, causal in SHAPES:
        dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
        rng = np.random.default_rng(0)
        q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32).astype(dt)) for _ in range(3))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        row = [f"B={b} H={h} N={n} D={d} {dtype} causal={causal}:"]
        for backend in ("sm80", "sm90"):
            os.environ["CUFLASH_FWD_BACKEND"] = backend
            api._fwd_plans.clear()
            out = cuflash.forward(q, k, v, causal=causal)
            ms = time_cuda(lambda: cuflash.forward(q, k, v, causal=causal, out=out))
            row.append(f"{backend} {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
