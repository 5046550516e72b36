"""GPU diagnostics of the sm90 backward (CUFLASH_BWD_BACKEND=sm90): per-gradient errors against
the float64 reference on small cases, then backward timings beside the sm80 kernels.

    python3 scripts/sm90_bwd_diag.py [errors|timing|all]
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np


def _set_backend(name: str, tiles: str | None = None) -> None:
    """Backend (CUFLASH_BWD_BACKEND) and sm90 tile override (CUFLASH_SM90_BWD_TILES) for the next calls."""
    from cuflash.bench import select_kernels

    select_kernels("bwd", name, tiles)


# (backend, sm90 tile override) pairs compared by `errors` and `timing`.
VARIANTS = [("sm90", None), ("sm90", "64,128,12"), ("auto", None)]


def _inputs(rng, dtype, b, nq, nk, hq, hkv, d):
    import cupy
    import ml_dtypes

    dt = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    mk = lambda *s: cupy.asarray(rng.standard_normal(s).astype(np.float32).astype(dt))  # noqa: E731
    return mk(b, nq, hq, d), mk(b, nk, hkv, d), mk(b, nk, hkv, d), mk(b, nq, hq, d)


def errors() -> None:
    import cupy
    import cuflash
    from cuflash import heuristics
    from cuflash.reference import attention_reference_backward

    cases = [  # dtype, b, nq, nk, hq, hkv, d, causal
        ("float16", 1, 128, 128, 1, 1, 64, False),
        ("float16", 1, 128, 128, 1, 1, 128, False),
        ("float16", 2, 1000, 1000, 3, 3, 64, False),
        ("float16", 2, 1000, 1000, 3, 3, 64, True),
        ("bfloat16", 1, 513, 513, 2, 2, 128, True),
        ("bfloat16", 1, 190, 257, 2, 2, 128, False),
        ("float16", 1, 113, 203, 2, 2, 64, True),
        ("float16", 1, 203, 113, 2, 2, 64, True),
        ("float16", 2, 300, 333, 8, 2, 64, True),
        ("float16", 1, 190, 257, 2, 2, 40, False),
        ("float16", 1, 300, 100, 2, 2, 64, True),
        ("bfloat16", 2, 1000, 1000, 3, 3, 64, False),
        ("float16", 2, 300, 333, 8, 2, 40, False),
    ]
    rng = np.random.default_rng(0)
    for case in cases:
        dtype, b, nq, nk, hq, hkv, d, causal = case
        q, k, v, do = _inputs(rng, dtype, b, nq, nk, hq, hkv, d)
        out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
        ref = attention_reference_backward(do, q, k, v, causal=causal)
        line = [f"{dtype} b{b} nq{nq} nk{nk} h{hq}/{hkv} d{d} causal={causal}:"]
        for backend, tiles in VARIANTS:
            _set_backend(backend, tiles)
            cfg = heuristics.bwd_configs(dtype, d, causal, 90).dkdv
            fam = f"{cfg.family}[{cfg.block_m}]"
            try:
                grads = cuflash.backward(do, q, k, v, out, lse, causal=causal)
                cupy.cuda.get_current_stream().synchronize()
                errs = []
                for x, r in zip(grads, ref):
                    xx = x.get().astype(np.float64)
                    errs.append(np.linalg.norm(xx - r) / max(np.linalg.norm(r), 1e-30)
                                if np.all(np.isfinite(xx)) else math.inf)
                line.append(f"{fam} dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} |")
            except Exception as e:  # noqa: BLE001
                line.append(f"{fam} FAILED {type(e).__name__}: {str(e)[:300]} |")
        print(" ".join(line), flush=True)
    _set_backend("sm90")


def timing() -> None:
    import cupy
    import cuflash
    from cuflash.bench import time_cuda

    rng = np.random.default_rng(1)
    b, h, n = 4, 16, 4096
    for dtype, d in (("float16", 64), ("bfloat16", 128)):
        q, k, v, do = _inputs(rng, dtype, b, n, n, h, h, d)
        for causal in (False, True):
            out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
            flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
            row = [f"B={b} H={h} N={n} D={d} {dtype} causal={causal}:"]
            for backend, tiles in VARIANTS:
                if d != 64 and tiles:
                    continue
                _set_backend(backend, tiles)
                try:
                    ms = time_cuda(lambda: cuflash.backward(do, q, k, v, out, lse, causal=causal))
                    row.append(f"{backend}{'[' + tiles + ']' if tiles else ''} {ms:.3f} ms "
                               f"{flops / ms / 1e9:.0f} TFLOP/s |")
                except Exception as e:  # noqa: BLE001
                    row.append(f"{backend} {tiles} FAILED {type(e).__name__}: {str(e)[:200]} |")
            print(" ".join(row), flush=True)
    _set_backend("sm90")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    t0 = time.time()
    if what in ("errors", "all"):
        errors()
    if what in ("timing", "all"):
        timing()
    print(f"done in {time.time() - t0:.0f} s", flush=True)
