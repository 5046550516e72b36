"""Workloads for external tools, and host-side profiling (GPU).

    ncu --kernel-name regex:... python3 dev/profiling.py launch B,H,N,D,dtype[,causal] [cuflash|cudnn|flash|fa4] [fwd|bwd] [DIST]
    ncu ... python3 dev/profiling.py launch - [cuflash|fa4] [fwd|bwd] [DIST] --row window8k
    compute-sanitizer --tool memcheck python3 dev/profiling.py sanitize [fwd,bwd,sched,ring,selftest]
    python3 dev/profiling.py power [VARIANT ...] [--shape S] [--pass fwd|bwd] [--seconds 4] [--rounds 1]
    python3 dev/profiling.py host

``launch``: three forwards (or forward + backward) of cuflash, of PyTorch SDPA (cuDNN backend) or of
FlashAttention-4 ($CUFLASH_FA4_PATH), on inputs of one shape and score distribution (cuflash/distributions.py):
what ``dev/device_run.sh ncu`` profiles. Kernel selection by the environment (CUFLASH_FWD_BACKEND,
CUFLASH_SM80_FWD_TILES, ...), which ncu passes through.
``sanitize``: every kernel family once on small odd shapes, for compute-sanitizer (memcheck, racecheck,
initcheck, synccheck): fwd (default forward incl. persistent tiles, the kept max's re-base and recompute,
the cluster kernels and fp8 on Hopper), bwd (default and deterministic backward), sched (every forced Hopper
forward schedule; ``dev/precompile.py sched`` compiles them), ring (ring attention's helpers), selftest (one
write past the end: the tool must report it).
``power``: each variant (dev/_common.py: a define set, ``@ENV=...``, or ``cudnn`` / ``flash`` / ``fa4``) called
back to back for some seconds with nvidia-smi sampling the SM clock and board power, in alternating rounds:
TFLOP/s per MHz separates a kernel that does less work per clock from one that only draws more power (an
H100 at its 700 W limit clocks down).
``host``: the Python time of one small forward (and backward) call, step by step, and a cProfile.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import timeit

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCHED_SHAPES, Variant, apply_variants, cuflash_call, parse_shape, peer_call  # noqa: E402


# ------------------------------------------------------------------------------------ launch
def launch(shape, which: str, pas: str, dist: str, calls: int = 3, row: str | None = None) -> None:
    import cupy

    if row:
        return launch_variant_row(row, which, pas, dist, calls)

    import cuflash
    from cuflash.bench import fa4_fn, torch_sdpa, torch_views
    from cuflash.distributions import make_inputs

    backward = pas == "bwd"
    q, k, v = make_inputs(shape, dist, 0)
    dout = make_inputs(shape, "normal", 1)[0]
    if which == "cuflash":
        out = cupy.empty_like(q)
        for _ in range(calls):
            if backward:
                o, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
                cuflash.backward(dout, q, k, v, o, lse, causal=shape.causal)
            else:
                cuflash.forward(q, k, v, causal=shape.causal, out=out)
    else:
        import torch

        # flash: PyTorch SDPA's flash backend, FlashAttention-2 (issue #46's peer for the portable kernels)
        run, sdpa_layout = (torch_sdpa(which), True) if which in ("cudnn", "flash") else (fa4_fn(), False)
        if run is None:
            raise SystemExit(f"{which} does not run here")
        tq, tk, tv = torch_views((q, k, v), sdpa_layout=sdpa_layout, requires_grad=backward)
        (tdo,) = torch_views((dout,), sdpa_layout=sdpa_layout)
        for _ in range(calls):
            o = run(tq, tk, tv, shape.causal)
            if backward:
                torch.autograd.grad(o, (tq, tk, tv), tdo)
    cupy.cuda.runtime.deviceSynchronize()


def launch_variant_row(name: str, which: str, pas: str, dist: str, calls: int) -> None:
    """``launch`` for a row of the variant table (cuflash/bench_variants.py: window8k, gpt-oss, ...): its shape
    and variant, for cuflash or FlashAttention-4."""
    import cupy

    from cuflash import bench_variants as bv
    from cuflash.distributions import make_inputs

    (row,) = bv.rows_by_name([name])
    q, k, v = make_inputs(row.shape, dist, 0)
    dout = make_inputs(row.shape, "normal", 1)[0]
    passes = ("fwd+bwd",) if pas == "bwd" else ("fwd",)
    if which == "cuflash":
        fns = bv.cuflash_fns(q, k, v, dout, row.variant, passes)
    elif which == "fa4":
        build = bv.fa4_adapter()
        if build is None:
            raise SystemExit("fa4 does not run here")
        fns = build(row, q, k, v, dout, passes)
    else:
        raise SystemExit(f"--row takes cuflash or fa4, not {which}")
    for _ in range(calls):
        fns[passes[0]]()
    cupy.cuda.runtime.deviceSynchronize()


# ------------------------------------------------------------------------------------ sanitize
def sanitize(which: str) -> None:
    """Every kernel family once on small odd shapes (the parts named in ``which``)."""
    import cupy

    import cuflash
    from cuflash._checks import BFLOAT16

    DT = {"float16": np.float16, "bfloat16": BFLOAT16, "float32": np.float32}
    rng = np.random.default_rng(0)
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


# ------------------------------------------------------------------------------------ power
def _smi(period_ms: int):
    return subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                             "-lms", str(period_ms)], stdout=subprocess.PIPE, text=True)


def power(shape, pas: str, texts, seconds: float, rounds: int) -> None:
    import cupy

    from cuflash.bench import random_inputs

    variants = [Variant.parse(t) for t in texts]
    apply = apply_variants(variants)
    q, k, v = random_inputs(shape)
    dout = random_inputs(shape, seed=1)[0]
    flops = (2.5 if pas == "bwd" else 1.0) * shape.fwd_flops()
    calls = []
    for var in variants:
        apply(var)
        run, _ = (peer_call(pas, var.peer, shape, q, k, v, dout) if var.peer
                  else cuflash_call(pas, var, shape, q, k, v, dout))
        calls.append(run)
    print(f"{shape.label()} {pas}, {seconds:g} s back to back per variant and round")
    for rnd in range(rounds):
        for var, call in zip(variants, calls):
            if call is None:
                print(f"  round {rnd} {var.label:40s} n/a")
                continue
            apply(var)
            for _ in range(3):
                call()
            cupy.cuda.Device().synchronize()
            smi = _smi(100)
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < seconds:
                for _ in range(20):
                    call()
                n += 20
                cupy.cuda.Device().synchronize()
            per_call = (time.perf_counter() - start) / n
            smi.terminate()
            rows = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line][5:]
            clock = statistics.median(float(r[0]) for r in rows) if rows else float("nan")
            watts = statistics.median(float(r[1]) for r in rows) if rows else float("nan")
            tf = flops / per_call / 1e12
            print(f"  round {rnd} {var.label:40s} {tf:6.0f} TFLOP/s  SM clock {clock:5.0f} MHz  power {watts:4.0f} W  "
                  f"{tf / clock * 1000:5.1f} GFLOP/s per MHz", flush=True)
    apply(Variant.parse(""))


# ------------------------------------------------------------------------------------ host
def per_call_us(fn, number: int = 5000) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6


def host() -> None:
    """Host time of a small forward call, step by step, and a cProfile of the checked path."""
    import cProfile
    import pstats

    import cupy

    import cuflash
    from cuflash.bench import host_overhead_us, random_inputs

    shape = parse_shape("1,8,128,64,float16")
    q, k, v = random_inputs(shape)
    out = cupy.empty_like(q)
    total = host_overhead_us(lambda: cuflash.forward(q, k, v, out=out))
    print(f"forward B=1 H=8 N=128 D=64 fp16, out given: {total:.1f} us/call")
    print(f"forward, out allocated: {host_overhead_us(lambda: cuflash.forward(q, k, v)):.1f} us/call")
    print(f"forward, out allocated, lse returned: "
          f"{host_overhead_us(lambda: cuflash.forward(q, k, v, return_lse=True)):.1f} us/call")
    # A NumPy scalar scale is not a key the call cache takes: every call runs the checked path.
    scale = np.float64(0.125)
    print(f"checked path (call cache bypassed), out given: "
          f"{host_overhead_us(lambda: cuflash.forward(q, k, v, out=out, softmax_scale=scale)):.1f} us/call")
    o, lse = cuflash.forward(q, k, v, return_lse=True)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    print(f"backward, gradients given: "
          f"{host_overhead_us(lambda: cuflash.backward(o, q, k, v, o, lse, dq=grads[0], dk=grads[1], dv=grads[2])):.1f}"
          f" us/call (three launches)")
    try:
        _host_steps(q, k, v, out)
    except Exception as e:  # noqa: BLE001 - internals renamed since
        print(f"  step breakdown unavailable: {type(e).__name__}: {e}")

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        cuflash.forward(q, k, v, out=out, softmax_scale=scale)
    prof.disable()
    cupy.cuda.runtime.deviceSynchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def _host_steps(q, k, v, out) -> None:
    """The call cache's hit and the checked path's steps, each timed alone (cuflash's internals: may
    lag behind them)."""
    import cupy

    from cuflash import _checks, api, call_cache, launch, params, sm90, variants

    key = call_cache.fwd_key(q, k, v, out, False, None, False)
    call = api._fwd_calls[key]
    stream = cupy.cuda.get_current_stream().ptr
    print(f"  of a hit: call_cache.fwd_key {per_call_us(lambda: call_cache.fwd_key(q, k, v, out, False, None, False)):.2f} us, "
          f"replayed launch {per_call_us(lambda: call.launch(stream)):.2f} us")

    kern, cfg, smem = api._fwd_plan(q.dtype, 64, False, 0)
    kern2, cfg2, smem2, extra, _ = sm90.fwd_launch_args(kern, cfg, smem, q, k, v, 0, out)
    p = params.pack_bytes(params.FWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0, *params.element_strides(q),
        *params.element_strides(k), *params.element_strides(v), *params.element_strides(out),
        1, 128, 128, 8, 1, 64, 0.125, 0.18, *variants.NONE.param_values(128, 128, 0.125),
        *params.DENSE_VARLEN_VALUES))
    grid = launch.fwd_grid(cfg2, 1, 8, 128)
    steps = {
        "check_qkv_cached": lambda: _checks.check_qkv_cached(q, k, v, api.HEAD_DIMS),
        "check_out_cached": lambda: _checks.check_out_cached("out", out, q.shape, q.dtype, 0),
        "with Device(0)": lambda: cupy.cuda.Device(0).__enter__().__exit__(None, None, None),
        "_fwd_plan": lambda: api._fwd_plan(q.dtype, 64, False, 0),
        "sm90.fwd_launch_args": lambda: sm90.fwd_launch_args(kern, cfg, smem, q, k, v, 0, out),
        "pack_bytes + strides": lambda: params.pack_bytes(params.FWD_PARAMS, (
            q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0, *params.element_strides(q),
            *params.element_strides(k), *params.element_strides(v), *params.element_strides(out),
            1, 128, 128, 8, 1, 64, 0.125, 0.18, *variants.NONE.param_values(128, 128, 0.125),
        *params.DENSE_VARLEN_VALUES)),
        "launch.launch": lambda: launch.launch(kern2, cfg2, grid, p, smem2, extra),
        "cupy.empty(q.shape)": lambda: cupy.empty(q.shape, dtype=q.dtype),
    }
    for name, fn in steps.items():
        print(f"  {name:24s} {per_call_us(fn):6.2f} us")
        cupy.cuda.runtime.deviceSynchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("launch", help="a few calls of one shape, for ncu")
    p.add_argument("shape", nargs="?", default="4,16,4096,128,bfloat16", help="B,H,N,D,dtype[,causal]")
    p.add_argument("which", nargs="?", default="cuflash", choices=("cuflash", "cudnn", "flash", "fa4"))
    p.add_argument("pas", nargs="?", default="fwd", choices=("fwd", "bwd"), metavar="PASS", help="fwd | bwd")
    p.add_argument("dist", nargs="?", default="normal", help="input distribution (cuflash/distributions.py)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--row", help="a row of the variant table (python -m cuflash --variants): its shape and variant")
    p = sub.add_parser("sanitize", help="every kernel family on small odd shapes, for compute-sanitizer")
    p.add_argument("which", nargs="?", default="fwd,bwd", help="comma-separated: fwd bwd sched ring selftest")
    p = sub.add_parser("power", help="sustained TFLOP/s with the SM clock and board power sampled")
    p.add_argument("variants", nargs="*", default=["", "cudnn"], metavar="VARIANT", help='default: "" cudnn')
    p.add_argument("--shape", default="4,16,4096,128,bfloat16", help="B,H,N,D,dtype[,causal]")
    p.add_argument("--pass", dest="pas", default="fwd", choices=("fwd", "bwd"))
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=1)
    sub.add_parser("host", help="host time of a small call, step by step, and a cProfile")
    args = ap.parse_args(argv)
    if args.cmd == "launch":
        launch(None if args.row else parse_shape(args.shape), args.which, args.pas, args.dist, args.calls, args.row)
    elif args.cmd == "sanitize":
        sanitize(args.which)
    elif args.cmd == "power":
        power(parse_shape(args.shape), args.pas, args.variants, args.seconds, args.rounds)
    else:
        host()
    return 0


if __name__ == "__main__":
    sys.exit(main())
