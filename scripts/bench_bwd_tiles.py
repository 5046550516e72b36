"""Backward TFLOP/s of sm90 tile overrides on given shapes (CUFLASH_SM90_BWD_TILES), same inputs.

    python3 scripts/bench_bwd_tiles.py 64:float16:0:4:4096 128,128,12 64,128,12
Shape spec: head_dim:dtype:causal:batch:seqlen (H=16).
"""
from __future__ import annotations

import sys

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs, select_kernels, time_cuda


def main(shape_specs: list[str], tiles: list[str]) -> None:
    for spec in shape_specs:
        d, dtype, causal, b, n = spec.split(":")
        shape = Shape(int(b), 16, int(n), int(d), dtype, causal == "1")
        q, k, v = random_inputs(shape)
        dout = random_inputs(shape, seed=1)[0]
        out, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        cells = []
        for t in tiles:
            select_kernels("bwd", "auto", None if t == "default" else t)
            run = lambda: cuflash.backward(dout, q, k, v, out, lse, causal=shape.causal,  # noqa: E731
                                           dq=grads[0], dk=grads[1], dv=grads[2])
            try:
                ms = time_cuda(run, repeats=20)
                cells.append(f"{t}: {2.5 * shape.fwd_flops() / ms / 1e9:.0f}")
            except Exception as e:  # noqa: BLE001
                cells.append(f"{t}: FAILED {type(e).__name__} {str(e)[:80]}")
        print(f"{shape.label():45s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    specs = [a for a in sys.argv[1:] if a.count(":") == 4]
    main(specs, [a for a in sys.argv[1:] if a not in specs])
