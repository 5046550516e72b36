"""Time the backward with candidate tiles (GPU): python scripts/tune_bwd.py.

For each shape, every dK/dV tile candidate (atomic dQ) and every dQ-kernel tile candidate
(deterministic mode, with the default dK/dV tiles) is compiled (in parallel, first), then
timed; the table gives ms, TFLOP/s (backward = 2.5 x forward FLOPs) and the largest relative
difference of dq, dk, dv from the default tiles' deterministic result (a correctness check of
each candidate on these shapes).
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

DKDV = {64: [(64, 128, 8), (128, 128, 8), (128, 64, 8), (64, 64, 4), (64, 64, 8)],
        128: [(64, 64, 8), (32, 128, 8), (128, 64, 8), (64, 128, 8), (64, 32, 4)],
        256: [(64, 64, 8), (32, 64, 8), (64, 32, 8), (32, 32, 4)]}
DQ = {64: [(64, 128, 4), (128, 64, 8), (64, 64, 4), (128, 128, 8)],
      128: [(64, 64, 4), (128, 64, 8), (64, 128, 4), (128, 32, 8)],
      256: [(64, 32, 4), (64, 64, 4), (128, 32, 8)]}
SHAPES = [("float16", 4, 4096, 16, 64, False), ("float16", 4, 4096, 16, 64, True),
          ("float16", 4, 4096, 16, 128, False), ("float16", 4, 4096, 16, 128, True),
          ("float16", 2, 4096, 16, 256, False), ("float16", 2, 4096, 16, 256, True)]


def main() -> int:
    import cupy
    import cuflash
    import cuflash.api as api
    from cuflash import heuristics
    from cuflash.config import KernelConfig
    from precompile import precompile_parallel
    from bwd_diag import _time, rnd

    cands = []
    for d in DKDV:
        for causal in (False, True):
            cands += [KernelConfig("sm80_bwd_dkdv_dq", "float16", d, causal, *t) for t in DKDV[d]]
            cands += [KernelConfig("sm80_bwd_dq", "float16", d, causal, *t) for t in DQ[d]]
    failed = precompile_parallel(cands)
    bad = {f.split(":")[0] for f in failed}
    for f in failed:
        print("compile failed:", f[:300])
    rng = np.random.default_rng(0)
    for dtype, b, n, h, d, causal in SHAPES:
        q, k, v, dout = (rnd(rng, (b, n, h, d), dtype) for _ in range(4))
        out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
        flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        name = f"{dtype} b{b} n{n} h{h} d{d} {'causal' if causal else 'full'}"
        api._bwd_plans.clear()
        base = [g.astype(cupy.float32) for g in cuflash.backward(dout, q, k, v, out, lse, causal=causal,
                                                                  deterministic=True)]
        for env, det, tiles in [("CUFLASH_SM80_BWD_DKDV_TILES", False, DKDV[d]),
                                ("CUFLASH_SM80_BWD_DQ_TILES", True, DQ[d])]:
            for t in tiles:
                os.environ[env] = ",".join(map(str, t))
                api._bwd_plans.clear()
                try:
                    grads = cuflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
                    diff = max(float(cupy.linalg.norm(g.astype(cupy.float32) - r) / cupy.linalg.norm(r))
                               for g, r in zip(grads, base))
                    ms = _time(lambda: cuflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det))
                    print(f"{name:40s} {'det' if det else 'atomic':6s} {env[17:21]} {str(t):14s} "
                          f"{ms:8.3f} ms {flops / ms / 1e9:7.1f} TF  vs default {diff:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"{name:40s} {str(t):14s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                del os.environ[env]
        api._bwd_plans.clear()
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
