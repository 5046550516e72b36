"""TFLOP/s of sm90 forward variants (consumer schedule x tiles) on the anchor shapes.

    python3 tools/bench_sm90_variants.py
"""

import cupy
import ml_dtypes
import numpy as np

import cuflash
from cuflash.bench import select_kernels, time_cuda

SHAPES = {  # name: (B, H, N, D, dtype, causal)
    "d128": (4, 16, 4096, 128, "bfloat16", False),
    "d128c": (4, 16, 4096, 128, "bfloat16", True),
    "d64": (4, 16, 4096, 64, "float16", False),
    "d256": (4, 16, 4096, 256, "bfloat16", False),
    "d64s": (16, 16, 1024, 64, "float16", False),
}
VARIANTS = [  # (shape, backend, tiles or None)
    *[(s, b, None) for s in ("d128", "d128c", "d64", "d256", "d64s") for b in ("sm90_simple", "sm90_overlap", "sm90_pingpong")],
    *[(s, b, "128,176,12") for s in ("d128", "d128c", "d64") for b in ("sm90_simple", "sm90_pingpong")],
    *[(s, b, "192,128,16") for s in ("d64", "d64s") for b in ("sm90_simple", "sm90_pingpong")],
]
VARIANTS.sort(key=lambda v: v[1] == "sm90_pingpong")  # a hang in the newest schedule comes last


def inputs(b, h, n, d, dtype):
    dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    return [cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32).astype(dt)) for _ in range(3)]


def main():
    cache = {}
    for shape, backend, tiles in VARIANTS:
        b, h, n, d, dtype, causal = SHAPES[shape]
        if shape not in cache:
            cache.clear()
            cache[shape] = inputs(b, h, n, d, dtype)
        q, k, v = cache[shape]
        select_kernels("fwd", backend, tiles)
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        try:
            out = cuflash.forward(q, k, v, causal=causal)
            ms = time_cuda(lambda: cuflash.forward(q, k, v, causal=causal, out=out))
            print(f"{shape:6s} {backend:14s} {tiles or 'default':11s} {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{shape:6s} {backend:14s} {tiles or 'default':11s} FAILED {type(e).__name__}: {str(e)[:200]}",
                  flush=True)


if __name__ == "__main__":
    main()
