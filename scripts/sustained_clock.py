"""Sustained forward throughput with the SM clock and board power sampled meanwhile (nvidia-smi).

    python3 scripts/sustained_clock.py "" "-DCUFLASH_SM90_FWD_K_AHEAD=0" cudnn

Each argument is a define set (CUFLASH_NVRTC_DEFINES) for cuflash's forward, or "cudnn" for PyTorch
SDPA's cuDNN backend on the same inputs. Calls run back to back for 4 seconds (no cache flush, unlike
the benchmark), so the H100 sits at its power limit: TFLOP/s per MHz separates a kernel that does
less work per clock from one that only draws more power.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import cupy

import cuflash
from cuflash import api
from cuflash.bench import Shape, random_inputs

SHAPE = Shape(4, 16, 4096, 128, "bfloat16", False)


def _caller(var: str, q, k, v, out):
    if var != "cudnn":
        os.environ["CUFLASH_NVRTC_DEFINES"] = var
        api._fwd_plans.clear()
        return lambda: cuflash.forward(q, k, v, out=out)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
    return call


def main(variants: list[str], seconds: float = 4.0) -> None:
    q, k, v = random_inputs(SHAPE)
    out = cupy.empty_like(q)
    for var in variants:
        call = _caller(var, q, k, v, out)
        for _ in range(3):
            call()
        cupy.cuda.Device().synchronize()
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "100"], stdout=subprocess.PIPE, text=True)
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            for _ in range(20):
                call()
            n += 20
            cupy.cuda.Device().synchronize()
        per_call = (time.perf_counter() - start) / n
        smi.terminate()
        rows = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line][5:]
        clock = statistics.median(float(r[0]) for r in rows)
        power = statistics.median(float(r[1]) for r in rows)
        tflops = SHAPE.fwd_flops() / per_call / 1e12
        print(f"{var or 'default':40s} {tflops:6.0f} TFLOP/s  SM clock {clock:5.0f} MHz  power {power:4.0f} W  "
              f"{tflops / clock * 1000:5.1f} GFLOP/s per MHz", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or [""])
