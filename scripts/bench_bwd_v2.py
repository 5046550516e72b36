"""Backward kernel versions side by side (GPU): python scripts/bench_bwd_v2.py [quick].

For B=4 H=16 N=4096, D=64/128, fp16/bf16, causal and not: forward, backward with the
version-1 dK/dV kernel (default tiles) and with version 2 (CUFLASH_SM80_BWD_VARIANT=2) at each
candidate tile, the relative difference of each candidate's gradients from version 1's
deterministic result, forward+backward, and PyTorch SDPA (flash) forward+backward when
PyTorch is installed. TFLOP/s: backward 2.5x, forward+backward 3.5x the forward's FLOPs.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# NVRTC defines tried on version 2 at its first tile (CUFLASH_NVRTC_DEFINES).
# BWD2_DIAG_SKIP_DQ: measurement only (wrong dQ), the cost of the dQ product / reductions.
DEFINES = ["-DBWD2_DIAG_SKIP_DQ=1", "-DBWD2_DIAG_SKIP_DQ=2"]
V2_TILES = {64: [(64, 128, 8), (64, 64, 4), (128, 128, 8)],
            128: [(64, 128, 8), (64, 64, 8)]}


def _configs():
    from cuflash.config import KernelConfig
    out = []
    for d, tiles in V2_TILES.items():
        for dtype in ("float16", "bfloat16"):
            for causal in (False, True):
                out += [KernelConfig("sm80_bwd_dkdv2_dq", dtype, d, causal, *t) for t in tiles]
                out.append(KernelConfig("sm80_bwd_dkdv2", dtype, d, causal, *tiles[0]))
    return out


def main() -> int:
    import cupy
    import cuflash
    import cuflash.api as api
    from cuflash.bench import Shape, random_inputs, time_cuda, torch_sdpa, torch_inputs
    from precompile import precompile_parallel

    quick = "quick" in sys.argv
    failed = precompile_parallel(_configs())
    first = [c for c in _configs() if c.family == "sm80_bwd_dkdv2_dq" and (c.block_m, c.block_n, c.num_warps)
             == V2_TILES[c.head_dim][0]]
    from cuflash.heuristics import _aux_config
    first += [_aux_config(f, dt) for f in ("bwd_preprocess", "bwd_postprocess") for dt in ("float16", "bfloat16")]
    for dfn in DEFINES:
        os.environ["CUFLASH_NVRTC_DEFINES"] = dfn
        failed += precompile_parallel(first)
    del os.environ["CUFLASH_NVRTC_DEFINES"]
    for f in failed:
        print("compile failed:", f[:300], flush=True)
    sdpa = torch_sdpa("flash")
    shapes = [Shape(4, 16, 4096, d, dt, c) for dt in ("float16", "bfloat16") for d in (64, 128)
              for c in (False, True)]
    if quick:
        shapes = shapes[:4]
    rows = []
    for s in shapes:
        q, k, v = random_inputs(s)
        dout = random_inputs(s, seed=1)[0]
        out, lse = cuflash.forward(q, k, v, causal=s.causal, return_lse=True)
        f = s.fwd_flops()
        t_fwd = time_cuda(lambda: cuflash.forward(q, k, v, causal=s.causal, return_lse=True), repeats=10)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        api._bwd_plans.clear()
        base = [g.astype(cupy.float32) for g in cuflash.backward(dout, q, k, v, out, lse, causal=s.causal,
                                                                  deterministic=True)]
        sd = None
        if sdpa is not None:
            import torch
            tq, tk, tv = torch_inputs(s, requires_grad=True)
            tdo = torch.randn_like(tq)

            def sdpa_fb():
                o = sdpa(tq, tk, tv, s.causal)
                o.backward(tdo)
            sd = time_cuda(sdpa_fb, repeats=10)
        first = ",".join(map(str, V2_TILES[s.head_dim][0]))
        variants = [("v1", {"CUFLASH_SM80_BWD_VARIANT": "1"}, False),
                    ("v1 det", {"CUFLASH_SM80_BWD_VARIANT": "1"}, True),
                    ("default", {}, False), ("default det", {}, True)]
        variants += [("v2 " + t, {"CUFLASH_SM80_BWD_DKDV_TILES": t}, False)
                     for t in (",".join(map(str, x)) for x in V2_TILES[s.head_dim][1:])]
        variants += [("v2 " + dfn[2:], {"CUFLASH_SM80_BWD_DKDV_TILES": first, "CUFLASH_NVRTC_DEFINES": dfn}, False)
                     for dfn in DEFINES]
        for name, env, det in variants:
            tiles = env.get("CUFLASH_SM80_BWD_DKDV_TILES", "")
            os.environ.update(env)
            api._bwd_plans.clear()
            try:
                g = cuflash.backward(dout, q, k, v, out, lse, causal=s.causal, deterministic=det,
                                     dq=grads[0], dk=grads[1], dv=grads[2])
                diff = max(float(cupy.linalg.norm(x.astype(cupy.float32) - r) / cupy.linalg.norm(r))
                           for x, r in zip(g, base))
                fam = api._bwd_plans[next(iter(api._bwd_plans))][1][1].key()
                t_b = time_cuda(lambda: cuflash.backward(dout, q, k, v, out, lse, causal=s.causal, deterministic=det,
                                                          dq=grads[0], dk=grads[1], dv=grads[2]), repeats=10)
                fb = 3.5 * f / ((t_fwd + t_b) * 1e9)
                rows.append((s.label(), name, tiles, t_b, 2.5 * f / t_b / 1e9, fb,
                             (3.5 * f / sd / 1e9) if sd else float("nan"), diff, fam))
                print(*rows[-1], flush=True)
            except Exception as e:  # noqa: BLE001
                print(s.label(), name, tiles, "FAILED", type(e).__name__, str(e)[:300], flush=True)
            for key in env:
                del os.environ[key]
        api._bwd_plans.clear()
        del q, k, v, dout, out, lse, grads, base
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"\n{'shape':40s} {'kern':22s} {'tiles':14s} {'bwd ms':>7s} {'bwd TF':>7s} {'f+b TF':>7s} "
          f"{'sdpa f+b':>8s} {'vs sdpa':>7s} {'diff':>8s}")
    for lab, name, tiles, tb, tf, fb, sdf, diff, fam in rows:
        print(f"{lab:40s} {name:22s} {tiles:14s} {tb:7.3f} {tf:7.1f} {fb:7.1f} {sdf:8.1f} {fb / sdf:7.2f} {diff:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
