"""fp8 forward beside the bf16 forward and SDPA cuDNN (bf16), TFLOP/s; and the V^T pass alone.

    python3 scripts/bench_fp8.py [D[c]:N:B ...]     e.g. 128:4096:4 128c:4096:4
Tile override for tuning: CUFLASH_SM90_FP8_TILES="bm,bn,w".
"""
from __future__ import annotations

import sys

import numpy as np

import cupy
import cuflash
from cuflash import fp8
from cuflash.bench import Shape, random_inputs, tflops, time_cuda, torch_inputs, torch_sdpa

DEFAULT = ["64:4096:4", "64c:4096:4", "128:4096:4", "128c:4096:4", "256:4096:4", "256c:4096:4",
           "128c:16384:1", "64:1024:16"]


def main(specs: list[str]) -> None:
    cudnn = torch_sdpa("cudnn")
    print("| shape | fp8 TFLOP/s | fp8 kernel only | V^T pass us | bf16 cuflash | cuDNN bf16 | fp8 / cuDNN |")
    print("|---|---|---|---|---|---|---|")
    for spec in specs:
        d, n, b = spec.split(":")
        causal = d.endswith("c")
        d, n, b = int(d.rstrip("c")), int(n), int(b)
        shape = Shape(b, 16, n, d, "bfloat16", causal)
        q, k, v = random_inputs(shape)
        (q8, dq), (k8, dk), (v8, dv) = (cuflash.quantize_fp8(x) for x in (q, k, v))
        out = cupy.empty(q.shape, dtype=q.dtype)
        ms_fp8 = time_cuda(lambda: cuflash.forward_fp8(q8, k8, v8, dq, dk, dv, causal=causal, out=out), repeats=30)
        nk_pad = -(-n // 32) * 32
        ms_vt = time_cuda(lambda: fp8.transpose_v(v8, nk_pad), repeats=30)
        ms_bf16 = time_cuda(lambda: cuflash.forward(q, k, v, causal=causal, out=out), repeats=30)
        ref = cuflash.forward(q, k, v, causal=causal)
        o8 = cuflash.forward_fp8(q8, k8, v8, dq, dk, dv, causal=causal)
        diff = float(cupy.linalg.norm((o8.astype(np.float32) - ref.astype(np.float32)).ravel())
                     / cupy.linalg.norm(ref.astype(np.float32).ravel()))
        c = "-"
        if cudnn is not None:
            tq, tk, tv = torch_inputs(shape)
            ms_c = time_cuda(lambda: cudnn(tq, tk, tv, causal), repeats=30)
            c = f"{tflops(shape.fwd_flops(), ms_c):.0f}"
        f = shape.fwd_flops()
        ratio = f"{ms_c / ms_fp8:.2f}" if cudnn is not None else "-"
        print(f"| {shape.label().replace('bfloat16', 'fp8')} | {tflops(f, ms_fp8):.0f} | "
              f"{tflops(f, ms_fp8 - ms_vt):.0f} | {ms_vt * 1e3:.0f} | {tflops(f, ms_bf16):.0f} | {c} | {ratio} |"
              f" (fp8 vs bf16 rel diff {diff:.3f})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
