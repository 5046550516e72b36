"""Backward diagnostics on a GPU: per-gradient errors for a matrix of cases (out/lse from the
kernels' forward and from the float64 reference, atomic and deterministic dQ), checks of the
intermediate delta and dq_accum, and timings.

    python scripts/bwd_diag.py [errors] [parts] [bench]
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np

import cupy
import cuflash
from cuflash import api, launch, params
from cuflash._checks import BFLOAT16
from cuflash.reference import attention_reference, attention_reference_backward

DT = {"float16": np.float16, "bfloat16": BFLOAT16, "float32": np.float32}


def rnd(rng, shape, dtype):
    return cupy.asarray(rng.standard_normal(shape).astype(np.float32).astype(DT[dtype]))


def err(x, ref):
    x = cupy.asnumpy(x).astype(np.float64)
    if not np.all(np.isfinite(x)):
        return math.inf
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((x - ref).ravel())
    return num / den if den else (0.0 if num == 0 else math.inf)


def nan_like(x):
    y = cupy.empty_like(x)
    y.fill(np.nan)
    return y


CASES = [
    # dtype, b, nq, nk, hq, hkv, d, causal
    ("float16", 1, 128, 128, 1, 1, 64, False),
    ("float16", 1, 128, 128, 1, 1, 64, True),
    ("float16", 2, 300, 333, 4, 2, 64, False),
    ("float16", 2, 333, 300, 4, 2, 64, True),
    ("bfloat16", 2, 300, 333, 4, 1, 128, True),
    ("float16", 1, 190, 257, 2, 2, 32, False),
    ("float16", 1, 190, 257, 2, 2, 96, True),
    ("float16", 1, 190, 257, 2, 2, 128, False),
    ("float16", 1, 257, 190, 2, 1, 192, True),
    ("float16", 1, 257, 190, 2, 1, 256, False),
    ("float16", 1, 100, 100, 2, 2, 40, True),
    ("float16", 1, 300, 100, 2, 2, 64, True),
    ("float16", 1, 17, 17, 1, 1, 8, False),
    ("float32", 1, 128, 128, 1, 1, 64, False),
    ("float32", 2, 333, 300, 4, 2, 64, True),
    ("float32", 1, 190, 257, 2, 1, 256, True),
    ("float32", 1, 190, 257, 2, 2, 40, False),
]


def errors():
    rng = np.random.default_rng(1)
    print(f"{'case':58s} {'src':3s} {'det':3s}   dq        dk        dv", flush=True)
    for dtype, b, nq, nk, hq, hkv, d, causal in CASES:
        q, k, v = rnd(rng, (b, nq, hq, d), dtype), rnd(rng, (b, nk, hkv, d), dtype), rnd(rng, (b, nk, hkv, d), dtype)
        dout = rnd(rng, (b, nq, hq, d), dtype)
        ref = attention_reference_backward(dout, q, k, v, causal=causal)
        ro, rl = attention_reference(q, k, v, causal=causal)
        srcs = {"ref": (cupy.asarray(ro.astype(np.float32).astype(DT[dtype])), cupy.asarray(rl.astype(np.float32)))}
        try:
            srcs["fwd"] = cuflash.forward(q, k, v, causal=causal, return_lse=True)
        except Exception as e:  # noqa: BLE001
            print("forward failed:", type(e).__name__, str(e)[:300])
        name = f"{dtype} b{b} nq{nq} nk{nk} h{hq}/{hkv} d{d} {'causal' if causal else 'full'}"
        for src, (out, lse) in srcs.items():
            for det in (False, True):
                try:
                    dq, dk, dv = cuflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det,
                                                  dq=nan_like(q), dk=nan_like(k), dv=nan_like(v))
                    cupy.cuda.runtime.deviceSynchronize()
                    e = [err(x, r) for x, r in zip((dq, dk, dv), ref)]
                    print(f"{name:58s} {src:3s} {int(det):3d}   " + "  ".join(f"{x:.2e}" for x in e), flush=True)
                except Exception as ex:  # noqa: BLE001
                    print(f"{name:58s} {src:3s} {int(det):3d}   FAILED {type(ex).__name__}: {str(ex)[:400]}", flush=True)


def parts():
    """delta after the preprocess; dq_accum after the dK/dV kernel (atomic mode)."""
    rng = np.random.default_rng(2)
    for dtype, b, nq, nk, hq, hkv, d, causal in [("float16", 1, 200, 150, 2, 1, 64, True),
                                                  ("bfloat16", 1, 130, 260, 2, 2, 128, False),
                                                  ("float32", 1, 70, 90, 2, 1, 40, True)]:
        q, k, v = rnd(rng, (b, nq, hq, d), dtype), rnd(rng, (b, nk, hkv, d), dtype), rnd(rng, (b, nk, hkv, d), dtype)
        dout = rnd(rng, (b, nq, hq, d), dtype)
        out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
        scale = 1 / math.sqrt(d)
        dq, dk, dv = nan_like(q), nan_like(k), nan_like(v)
        pre, dkdv, dqk, post = api._bwd_plan(q.dtype, d, causal, False, q.device.id)
        delta = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
        acc = cupy.full((b, hq, nq, d), np.nan, dtype=np.float32) if post is not None else None
        p = params.pack_values(params.BWD_PARAMS, (
            q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr, lse.data.ptr, delta.data.ptr,
            acc.data.ptr if acc is not None else 0, dq.data.ptr, dk.data.ptr, dv.data.ptr, 0,
            *params.element_strides(q), *params.element_strides(k), *params.element_strides(v),
            *params.element_strides(out), *params.element_strides(dout), *params.element_strides(dq),
            *params.element_strides(dk), *params.element_strides(dv),
            b, nq, nk, hq, hq // hkv, d, scale, scale * api.LOG2E, nq, d, nq, 0, 0, 0))
        kern, cfg, smem = pre
        launch.launch(kern, cfg, launch.bwd_row_grid(cfg, b, hq, nq), p, smem)
        cupy.cuda.runtime.deviceSynchronize()
        ref_delta = (cupy.asnumpy(dout).astype(np.float64) * cupy.asnumpy(out).astype(np.float64)).sum(-1)
        ref_delta = ref_delta.transpose(0, 2, 1)
        print(f"parts {dtype} d{d}: delta rel err {err(delta, ref_delta):.2e}", end="", flush=True)
        if acc is not None:
            print(f"; dq_accum zeroed: {bool((acc == 0).all())}", end="")
        kern, cfg, smem = dkdv
        launch.launch(kern, cfg, launch.bwd_dkdv_grid(cfg, b, hkv, nk), p, smem)
        cupy.cuda.runtime.deviceSynchronize()
        rq, rk, rv = attention_reference_backward(dout, q, k, v, causal=causal)
        print(f"; dk {err(dk, rk):.2e} dv {err(dv, rv):.2e}", end="")
        if acc is not None:
            print(f"; dq_accum*scale {err(acc.transpose(0, 2, 1, 3) * scale, rq):.2e}", end="")
        print(flush=True)


def _time(fn, reps=10):
    fn()
    cupy.cuda.runtime.deviceSynchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / reps


def bench():
    rng = np.random.default_rng(3)
    print(f"{'shape':44s} {'fwd ms':>8s} {'bwd ms':>8s} {'bwd TF':>7s} {'det ms':>8s} {'det TF':>7s}", flush=True)
    shapes = [("float16", 4, 4096, 16, 64, False), ("float16", 4, 4096, 16, 64, True),
              ("float16", 4, 4096, 16, 128, False), ("float16", 4, 4096, 16, 128, True),
              ("bfloat16", 4, 4096, 16, 128, True), ("float16", 2, 4096, 16, 256, True),
              ("float16", 1, 16384, 8, 128, True), ("float32", 2, 2048, 8, 64, True)]
    for dtype, b, n, h, d, causal in shapes:
        q, k, v, dout = (rnd(rng, (b, n, h, d), dtype) for _ in range(4))
        out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        tf = _time(lambda: cuflash.forward(q, k, v, causal=causal))
        tb = _time(lambda: cuflash.backward(dout, q, k, v, out, lse, causal=causal))
        td = _time(lambda: cuflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True))
        name = f"{dtype} b{b} n{n} h{h} d{d} {'causal' if causal else 'full'}"
        print(f"{name:44s} {tf:8.3f} {tb:8.3f} {2.5 * flops / tb / 1e9:7.1f} {td:8.3f} {2.5 * flops / td / 1e9:7.1f}",
              flush=True)


if __name__ == "__main__":
    what = sys.argv[1:] or ["errors", "parts", "bench"]
    t0 = time.time()
    for w in what:
        print(f"== {w}", flush=True)
        globals()[w]()
    print(f"done in {time.time() - t0:.1f} s")
