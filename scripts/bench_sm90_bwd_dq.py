"""sm90 backward dQ modes side by side (B=4 H=16 N=4096): atomic, tile (bulk reduce), tile
ordered (deterministic), and the portable deterministic kernels; backward TFLOP/s incl. pre/post.

    python3 scripts/bench_sm90_bwd_dq.py
"""
from __future__ import annotations

import os

import cupy

import cuflash
from cuflash import api
from cuflash.bench import Shape, random_inputs, tflops, time_cuda

SHAPES = [Shape(4, 16, 4096, 64, "float16", False), Shape(4, 16, 4096, 64, "float16", True),
          Shape(4, 16, 4096, 128, "bfloat16", False), Shape(4, 16, 4096, 128, "bfloat16", True),
          Shape(4, 16, 4096, 96, "bfloat16", False), Shape(16, 16, 1024, 64, "float16", False),
          Shape(1, 16, 16384, 128, "bfloat16", True), Shape(4, 16, 4096, 256, "bfloat16", False),
          Shape(4, 16, 4096, 256, "bfloat16", True), Shape(4, 16, 4096, 192, "bfloat16", False)]
MODES = [("atomic", "atomic", False), ("tile", "tile", False), ("tile det", "tile", True),
         ("sm80 det", None, True)]


def main() -> None:
    print("| shape | " + " | ".join(m[0] for m in MODES) + " |")
    print("|---" * (len(MODES) + 1) + "|")
    for shape in SHAPES:
        q, k, v = random_inputs(shape)
        dout = random_inputs(shape, seed=1)[0]
        out, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        cells, ref = [], None
        for _, dq_mode, det in MODES:
            os.environ["CUFLASH_BWD_BACKEND"] = "sm80" if dq_mode is None else "auto"
            os.environ["CUFLASH_SM90_BWD_DQ"] = dq_mode or "atomic"
            api._bwd_plans.clear()
            run = lambda: cuflash.backward(dout, q, k, v, out, lse, causal=shape.causal, deterministic=det,  # noqa: E731
                                           dq=grads[0], dk=grads[1], dv=grads[2])
            ms = time_cuda(run, repeats=20)
            dq = grads[0].astype(cupy.float32)
            if ref is None:
                ref = dq.copy()
            diff = float(cupy.linalg.norm(dq - ref) / cupy.linalg.norm(ref))
            cells.append(f"{tflops(2.5 * shape.fwd_flops(), ms):.0f} ({ms:.2f} ms, dq rel {diff:.0e})")
        print(f"| {shape.label()} | " + " | ".join(cells) + " |", flush=True)
        del q, k, v, dout, out, lse, grads
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
