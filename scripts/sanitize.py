"""Run the kernels once on small odd shapes, for compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

    compute-sanitizer --tool memcheck python scripts/sanitize.py [fwd,bwd,sched,ring]
"""
from __future__ import annotations

import os
import sys

import numpy as np

import cupy
import cuflash
from cuflash._checks import BFLOAT16

DT = {"float16": np.float16, "bfloat16": BFLOAT16, "float32": np.float32}


# the shapes each forced Hopper forward schedule runs on (b, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal)
SCHED_SHAPES = [(1, 70, 33, 2, 2, 128, True), (2, 300, 390, 4, 2, 64, False),
                (1, 150, 170, 2, 1, 256, True), (1, 257, 300, 2, 2, 128, False)]


def sched_configs() -> list:
    """The kernels the "sched" part runs (scripts/precompile.py sched compiles them beforehand)."""
    from cuflash import heuristics

    return [heuristics.fwd_config(dtype, d, causal, 90, backend=backend)
            for backend in heuristics.SM90_FWD_BACKENDS[1:] for dtype in ("float16", "bfloat16")
            for (_, _, _, _, _, d, causal) in SCHED_SHAPES]


def main() -> int:
    rng = np.random.default_rng(0)
    which = sys.argv[1] if len(sys.argv) > 1 else "fwd,bwd"
    for dtype in ("float16", "bfloat16", "float32"):
        for (b, nq, nk, hq, hkv, d, causal) in [(1, 17, 17, 2, 1, 64, True), (1, 33, 70, 2, 2, 40, False),
                                                (1, 70, 33, 2, 2, 128, True), (1, 1, 5, 1, 1, 256, False),
                                                (2, 100, 130, 4, 2, 64, False),
                                                # several query and key tiles: the backward's rotated
                                                # query order (non-causal, head dims <= 64)
                                                (1, 300, 390, 2, 1, 64, False),
                                                # split-D backward tiles (head dims > 128): several query
                                                # tiles per key tile, both step parities
                                                (1, 150, 170, 2, 1, 256, True), (1, 130, 100, 2, 2, 192, False)]:
            q = cupy.asarray(rng.standard_normal((b, nq, hq, d)).astype(DT[dtype]))
            k = cupy.asarray(rng.standard_normal((b, nk, hkv, d)).astype(DT[dtype]))
            v = cupy.asarray(rng.standard_normal((b, nk, hkv, d)).astype(DT[dtype]))
            out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)  # the backward needs them
            if "bwd" in which and hasattr(cuflash, "backward"):
                dout = cupy.asarray(rng.standard_normal(q.shape).astype(DT[dtype]))
                for det in (False, True):
                    cuflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
    if "bwd" in which:  # the Hopper backward's 1-D grid over several L2 sections (70 groups), fp16 only
        b, nq, nk, hq, hkv, d = 7, 257, 300, 20, 10, 64
        q, dout = (cupy.asarray(rng.standard_normal((b, nq, hq, d)).astype(np.float16)) for _ in range(2))
        k, v = (cupy.asarray(rng.standard_normal((b, nk, hkv, d)).astype(np.float16)) for _ in range(2))
        for causal in (False, True):
            out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
            for det in (False, True):
                cuflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
    if "fwd" in which:  # more tiles than SMs: each persistent CTA (short sequences) runs several
        for d in (64, 128, 256):
            q = cupy.asarray(rng.standard_normal((4, 777, 8, d)).astype(np.float16))
            k, v = (cupy.asarray(rng.standard_normal((4, 901, 4, d)).astype(np.float16)) for _ in range(2))
            for causal in (False, True):
                cuflash.forward(q, k, v, causal=causal, return_lse=True)
    if "fwd" in which:  # scores that grow along the key loop: the Hopper forward's kept max moves
        for d in (64, 128, 256):   # (kernels_cu/sm90/fwd.cu, kKeepMax)
            q = cupy.asarray(rng.standard_normal((1, 200, 2, d)).astype(np.float16))
            ramp = np.linspace(5.0, 1.0, 333, dtype=np.float32).reshape(1, 333, 1, 1)
            k = cupy.asarray((rng.standard_normal((1, 333, 2, d)) * ramp).astype(np.float16))
            v = cupy.asarray(rng.standard_normal((1, 333, 2, d)).astype(np.float16))
            for causal in (False, True):
                cuflash.forward(q, k, v, causal=causal, softmax_scale=8.0, return_lse=True)
    if "fwd" in which:  # a settled max, then a jump: the warps re-base (gap 12.5) or compute S again (40)
        for d in (64, 128, 256):
            for gap in (12.5, 40.0):
                u = rng.standard_normal(d).astype(np.float32)
                u /= np.linalg.norm(u)
                qh = rng.standard_normal((1, 300, 2, d)).astype(np.float32) * 0.3
                qh[:, ::2] += 4.0 * u
                kh = rng.standard_normal((1, 400, 2, d)).astype(np.float32) * 0.1
                kh[:, 0] = gap * u
                q, k = cupy.asarray(qh.astype(np.float16)), cupy.asarray(kh.astype(np.float16))
                v = cupy.asarray(rng.standard_normal((1, 400, 2, d)).astype(np.float16))
                for causal in (False, True):
                    cuflash.forward(q, k, v, causal=causal, softmax_scale=1.0, return_lse=True)
    if "fwd" in which and int(cupy.cuda.Device().compute_capability) == 90:
        # the cluster kernels (K / V multicast; their stages are released by every warp)
        from cuflash import api
        from cuflash.bench import Shape
        from cuflash.distributions import make_inputs

        for backend in ("sm90_overlap_x2", "sm90_overlap_x2_p"):
            os.environ["CUFLASH_FWD_BACKEND"] = backend
            api._fwd_plans.clear()
            for d in (128, 256):
                q, k, v = make_inputs(Shape(1, 2, 300, d, "bfloat16", False, seqlen_k=333), "outlier12", seed=1)
                cuflash.forward(q, k, v, return_lse=True)
        os.environ.pop("CUFLASH_FWD_BACKEND")
        api._fwd_plans.clear()
    if "sched" in which and int(cupy.cuda.Device().compute_capability) == 90:
        # every forced Hopper forward schedule (the tuned table above runs only some of them), each on
        # shapes with a partial query tile, a partial key tile, GQA and more tiles than one CTA
        from cuflash import api, heuristics

        for backend in heuristics.SM90_FWD_BACKENDS[1:]:
            os.environ["CUFLASH_FWD_BACKEND"] = backend
            api._fwd_plans.clear()
            for dtype in ("float16", "bfloat16"):
                for (b, nq, nk, hq, hkv, d, causal) in SCHED_SHAPES:
                    q = cupy.asarray(rng.standard_normal((b, nq, hq, d)).astype(DT[dtype]))
                    k = cupy.asarray(rng.standard_normal((b, nk, hkv, d)).astype(DT[dtype]))
                    v = cupy.asarray(rng.standard_normal((b, nk, hkv, d)).astype(DT[dtype]))
                    cuflash.forward(q, k, v, causal=causal, return_lse=True)
        os.environ.pop("CUFLASH_FWD_BACKEND")
        api._fwd_plans.clear()
    if "fwd" in which and int(cupy.cuda.Device().compute_capability) == 90:  # fp8 forward and its helpers
        for (b, nq, nk, hq, hkv, d, causal) in [(1, 17, 17, 2, 1, 64, True), (1, 33, 70, 2, 2, 48, False),
                                                (1, 70, 33, 2, 2, 128, True), (1, 1, 5, 1, 1, 256, False),
                                                (1, 300, 300, 2, 1, 128, True)]:
            pairs = [cuflash.quantize_fp8(cupy.asarray(rng.standard_normal(shape).astype(np.float32)))
                     for shape in ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d))]
            cuflash.forward_fp8(*(x for x, _ in pairs), *(s for _, s in pairs), causal=causal, return_lse=True)
    if "selftest" in which:  # one write past the end: the tool must report it (proof that it watches this process)
        bad = cupy.RawKernel(r'extern "C" __global__ void past_end(float* x, int n) { x[n + threadIdx.x] = 1.f; }',
                             "past_end")
        x = cupy.zeros(4, cupy.float32)
        bad((1,), (32,), (x, np.int32(4096)))
    if "ring" in which:  # ring attention's merge / accumulate / convert kernels, every rank in this process
        import cuflash.distributed as cfd

        for dtype, world, chunk, d in (("float16", 2, 37, 64), ("bfloat16", 3, 19, 128), ("float32", 2, 5, 32)):
            n = 2 * world * chunk
            q, k, v, dout = (cupy.asarray(rng.standard_normal((2, n, 2, d)).astype(DT[dtype])) for _ in range(4))
            shards = [[cfd.zigzag_shard(x, world, r) for r in range(world)] for x in (q, k, v, dout)]
            for causal in (False, True):
                outs, lses = cfd.local_ring_forward(*shards[:3], causal=causal, return_lse=True)
                cfd.local_ring_backward(shards[3], *shards[:3], outs, lses, causal=causal)
    cupy.cuda.runtime.deviceSynchronize()
    print("sanitize run done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
