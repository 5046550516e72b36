"""TFLOP/s of sm90 forward variants (consumer schedule x tiles) beside SDPA cuDNN, with each
variant's output checked against the portable kernel (relative Frobenius norm of the difference).

    python3 tools/bench_sm90_variants.py                     # the default variant list
    python3 tools/bench_sm90_variants.py d128:sm90_overlap:128,176,12 d64:sm90_simple ...
"""
import sys

import cupy
import ml_dtypes
import numpy as np

import cuflash
from cuflash.bench import select_kernels, time_cuda

SHAPES = {  # name: (B, H, N, D, dtype, causal)
    "d128": (4, 16, 4096, 128, "bfloat16", False),
    "d128c": (4, 16, 4096, 128, "bfloat16", True),
    "d128h": (4, 16, 4096, 128, "float16", False),
    "d64": (4, 16, 4096, 64, "float16", False),
    "d64c": (4, 16, 4096, 64, "float16", True),
    "d256": (4, 16, 4096, 256, "bfloat16", False),
    "d256c": (4, 16, 4096, 256, "bfloat16", True),
    "d64s": (16, 16, 1024, 64, "float16", False),
    "n16k": (1, 16, 16384, 128, "bfloat16", True),
}
DEFAULT = [
    "d128:cudnn", "d128:sm90", "d128:sm90_overlap:128,176,12", "d128:sm90_overlap_p",
    "d128c:cudnn", "d128c:sm90", "d128c:sm90_overlap", "d128c:sm90_overlap:128,176,12",
    "d64:cudnn", "d64:sm90", "d64:sm90_overlap:192,128,16", "d64:sm90_overlap:128,128,12",
    "d64c:cudnn", "d64c:sm90", "d64c:sm90_overlap_p:128,128,12",
    "d256:cudnn", "d256:sm90", "d256c:cudnn", "d256c:sm90", "d256c:sm90_overlap",
    "d64s:cudnn", "d64s:sm90", "d64s:sm90_overlap:192,128,16",
]


def inputs(b, h, n, d, dtype):
    dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    return [cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32).astype(dt)) for _ in range(3)]


def cudnn_ms(shape):
    from cuflash.bench import Shape, torch_inputs, torch_sdpa

    b, h, n, d, dtype, causal = SHAPES[shape]
    q, k, v = torch_inputs(Shape(b, h, n, d, dtype, causal))
    fn = torch_sdpa("cudnn")
    return time_cuda(lambda: fn(q, k, v, causal))


def main(variants):
    cache = {}
    for spec in variants:
        shape, backend, *tiles = spec.split(":")
        tiles = tiles[0] if tiles else None
        b, h, n, d, dtype, causal = SHAPES[shape]
        if shape not in cache:
            cache.clear()
            cache[shape] = inputs(b, h, n, d, dtype)
            select_kernels("fwd", "sm80")
            cache["ref"] = cuflash.forward(*cache[shape], causal=causal).astype(cupy.float32)
        q, k, v = cache[shape]
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        try:
            if backend == "cudnn":
                ms, err = cudnn_ms(shape), float("nan")
            else:
                select_kernels("fwd", backend, tiles)
                out = cupy.full_like(q, float("nan"))
                cuflash.forward(q, k, v, causal=causal, out=out)
                ref = cache["ref"]
                err = float(cupy.linalg.norm(out.astype(cupy.float32) - ref) / cupy.linalg.norm(ref))
                ms = time_cuda(lambda: cuflash.forward(q, k, v, causal=causal, out=out))
            print(f"{shape:6s} {backend:16s} {tiles or 'default':11s} {ms:.3f} ms {flops / ms / 1e9:4.0f} TFLOP/s"
                  f"  err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{shape:6s} {backend:16s} {tiles or 'default':11s} FAILED {type(e).__name__}: {str(e)[:200]}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
