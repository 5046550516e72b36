"""TFLOP/s of sm90 forward variants (schedule x tiles, persistent or not) on the issue's rows,
with PyTorch SDPA (cuDNN) on the same inputs for the ratio.

    python3 tools/bench_sm90_persistent.py [row ...]
"""
import os
import sys

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs, select_kernels, time_cuda, torch_inputs, torch_sdpa

ROWS = {  # name: shape
    "d64": Shape(4, 16, 4096, 64, "float16", False),
    "d64c": Shape(4, 16, 4096, 64, "float16", True),
    "d128h": Shape(4, 16, 4096, 128, "float16", False),
    "d128hc": Shape(4, 16, 4096, 128, "float16", True),
    "d128": Shape(4, 16, 4096, 128, "bfloat16", False),
    "d128c": Shape(4, 16, 4096, 128, "bfloat16", True),
    "d256": Shape(4, 16, 4096, 256, "bfloat16", False),
    "d256c": Shape(4, 16, 4096, 256, "bfloat16", True),
    "long": Shape(1, 16, 16384, 128, "bfloat16", True),
    "short": Shape(16, 16, 1024, 64, "float16", False),
}
PERSISTENT = ("sm90_simple_p", "sm90_overlap_p", "sm90_pingpong_p")
EXTRA_TILES = {  # more (backend, tiles) per row
    "d64": [(b, "128,128,12") for b in ("sm90_pingpong_p", "sm90_overlap_p")],
    "d64c": [(b, "128,128,12") for b in ("sm90_pingpong_p", "sm90_pingpong")],
    "short": [(b, "128,128,12") for b in ("sm90_pingpong_p", "sm90_overlap_p", "sm90_simple")],
    "d128c": [("sm90_pingpong_p", "128,176,12")],
}


def main():
    rows = sys.argv[1:] or list(ROWS)
    sdpa = torch_sdpa("cudnn")
    for name in rows:
        s = ROWS[name]
        flops = s.fwd_flops()
        q, k, v = random_inputs(s)
        results = []
        if sdpa is not None:
            tq, tk, tv = torch_inputs(s)
            ms = time_cuda(lambda: sdpa(tq, tk, tv, s.causal))
            results.append(("cudnn", "", ms))
            print(f"{name:7s} {'cudnn':16s} {'':11s} {ms:.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
            del tq, tk, tv
        for backend, tiles in [("sm90", None)] + [(b, None) for b in PERSISTENT] + EXTRA_TILES.get(name, []):
            select_kernels("fwd", backend, tiles)
            try:
                out = cuflash.forward(q, k, v, causal=s.causal)
                ms = time_cuda(lambda: cuflash.forward(q, k, v, causal=s.causal, out=out))
                results.append((backend, tiles or "", ms))
                ratio = f" x{results[0][2] / ms:.3f}" if results[0][0] == "cudnn" else ""
                print(f"{name:7s} {backend:16s} {tiles or '':11s} {ms:.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s{ratio}",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name:7s} {backend:16s} {tiles or '':11s} FAILED {type(e).__name__}: {str(e)[:200]}",
                      flush=True)
        os.environ.pop("CUFLASH_FWD_BACKEND", None)
        os.environ.pop("CUFLASH_SM90_FWD_TILES", None)
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
