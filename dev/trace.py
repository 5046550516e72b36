"""Where the time goes inside cuflash's kernels and calls (GPU): clock64 traces of instrumented builds,
fallback counters, per-kernel and per-pass event timings.

    python3 dev/trace.py fwd [B,H,N,D,dtype[,causal] ...]       persistent sm90 forward, per tile
    python3 dev/trace.py bwd [SHAPE ...]                        sm90 backward dK/dV kernel, per CTA and SM
    python3 dev/trace.py fallbacks [SHAPE ...] [--dist D,...]   the kept max's fallback shares
    python3 dev/trace.py phases [SHAPE ...]                     each backward kernel timed; cuDNN / FA4 kernels
    python3 dev/trace.py split [SHAPE ...]                      forward and backward inside one fwd+bwd

``fwd``: a -DCUFLASH_SM90_FWD_TRACE build; clock64 stamps per CTA, consumer warpgroup and tile (the first 16
tiles of each CTA) at the tile's start, Q landed, first K landed, key loop done and epilogue done, and when the
producer issued the tile's first K; prints the medians (and by count of key tiles, causal).
``bwd``: a -DCUFLASH_SM90_BWD_TRACE build; stamps at CTA start, K/V ready, first S^T/dP^T done, main loop done,
dK/dV stored and the last dQ reduce read, the first step durations, and the idle gap on each SM between one
CTA's end and the next one's start (and its part before the kernel's entry).
``fallbacks``: a -DCUFLASH_SM90_FWD_COUNT_FALLBACKS build; per input distribution, the share of warp key-tile
steps in the kept-max state and the re-bases and recomputes, each a fraction of all steps.
``phases``: each kernel of a backward call timed with events between launches (L2 flushed before each call),
the whole call, and where PyTorch is installed the kernels of SDPA cuDNN's and FlashAttention-4's backward
(torch.profiler; FA4 through $CUFLASH_FA4_PATH).
``split``: forward and backward timed inside one fwd+bwd sequence against each alone, with and without the L2
flush, and the SM clock / power / temperature (nvidia-smi) before and after.
Other defines can be added through $CUFLASH_NVRTC_DEFINES.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import reset_plans, shapes_arg  # noqa: E402

import cupy  # noqa: E402

import cuflash  # noqa: E402
from cuflash import dispatch, launch, params, tile_counters  # noqa: E402
from cuflash.bench import random_inputs  # noqa: E402
from cuflash.distributions import MIXED_CYCLE, make_inputs  # noqa: E402


# ------------------------------------------------------------------ fwd
SLOTS, TILES, WGS = 8, 16, 3


def trace_fwd(shape) -> None:
    """Per-tile phases of the persistent sm90 forward (a -DCUFLASH_SM90_FWD_TRACE build)."""
    q, k, v = random_inputs(shape)
    ctas = 256  # >= the persistent grid (one CTA per SM)
    buf = cupy.zeros(64 // 2 + ctas * WGS * TILES * SLOTS, dtype=cupy.uint64)   # 64 ints, then the stamps
    reset_plans()   # recorded calls keep the counter they were made with
    with tile_counters.fixed(q.device.id, buf.data.ptr):
        for _ in range(4):  # the last run's stamps count
            buf[32:] = 0
            cuflash.forward(q, k, v, causal=shape.causal)
        cupy.cuda.Device().synchronize()
    reset_plans()
    t = buf[32:].get().astype(np.int64).reshape(ctas, WGS, TILES, SLOTS)
    start, q_in, k_in, loop, epi, smid, nk = (t[..., i] for i in range(7))
    used = (start > 0) & (epi > 0) & (k_in > 0)
    keys = nk[used]
    loop_per_key = (loop - k_in)[used] / np.maximum(nk[used] - 1, 1)
    # gap: this tile's start minus the same warpgroup's previous epilogue end
    gap = start[..., 1:] - epi[..., :-1]
    gap_used = used[..., 1:] & used[..., :-1]
    print(f"{shape.label()}: {int(used.sum())} (cta, warpgroup, tile) records, key tiles per tile {np.median(keys):.0f}")
    print(f"  median cycles: wait for Q {np.median((q_in - start)[used]):.0f}, then first K {np.median((k_in - q_in)[used]):.0f}, "
          f"key loop {np.median((loop - k_in)[used]):.0f} ({np.median(loop_per_key):.0f} per key tile after the first), "
          f"epilogue {np.median((epi - loop)[used]):.0f}, gap to the next tile {np.median(gap[gap_used]):.0f}")
    for name, x in (("wait for Q", (q_in - start)[used]), ("first K", (k_in - q_in)[used]), ("epilogue", (epi - loop)[used])):
        print(f"  {name}: p10 {np.percentile(x, 10):.0f} p50 {np.percentile(x, 50):.0f} p90 {np.percentile(x, 90):.0f}")
    # first tile of each CTA vs the rest
    first = used[:, :, 0]
    print(f"  first tile of a CTA: wait for Q {np.median((q_in - start)[:, :, 0][first]):.0f}, first K "
          f"{np.median((k_in - q_in)[:, :, 0][first]):.0f}")
    # slot 7 (warpgroup 0 only): when the producer issued the tile's first K load
    k_issue = t[:, 0, :, 7]
    ok = used[:, 0, :] & (k_issue > 0)
    if ok.any():
        print(f"  first K load issued: {np.median((k_issue - start[:, 0, :])[ok]):.0f} cycles after the tile's start "
              f"(negative: before), landed {np.median((k_in[:, 0, :] - k_issue)[ok]):.0f} after its issue; "
              f"Q landed {np.median((q_in[:, 0, :] - k_issue)[ok]):.0f} after it")
    tile_time = (epi - start)[used]
    print(f"  tile (start to epilogue end) median {np.median(tile_time):.0f}; per key tile {np.median(tile_time / keys):.0f}")
    if len(np.unique(keys)) > 1:   # causal: the phases by the tile's count of key tiles
        for n in np.unique(keys)[:8]:
            sel = used & (nk == n)
            print(f"  {n} key tiles ({int(sel.sum())} records): Q {np.median((q_in - start)[sel]):.0f}, first K "
                  f"{np.median((k_in - q_in)[sel]):.0f}, key loop {np.median((loop - k_in)[sel]):.0f}, epilogue "
                  f"{np.median((epi - loop)[sel]):.0f}, tile {np.median((epi - start)[sel]):.0f}")


# ------------------------------------------------------------------ bwd
def trace_bwd(shape) -> None:
    """Per-CTA phases of the sm90 backward's dK/dV kernel (a -DCUFLASH_SM90_BWD_TRACE build)."""
    sem_offset = params.BWD_PARAMS.fields["dq_semaphore"][1]
    q, k, v = random_inputs(shape)
    dout = random_inputs(shape, seed=1)[0]
    o, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
    real_launch = launch.launch
    captured = {}

    def traced_launch(kernel, config, grid, p, smem, extra_args=()):
        if config.family == "sm90_bwd_dkdv_dqtile":
            ctas = grid[0] * grid[1] * grid[2]
            buf = captured["buf"] = cupy.zeros((ctas, 16), dtype=cupy.uint64)
            captured["cfg"] = config
            p = bytearray(p)
            p[sem_offset:sem_offset + 8] = buf.data.ptr.to_bytes(8, "little")
            p = bytes(p)
        real_launch(kernel, config, grid, p, smem, extra_args)

    for rep in range(4):  # the last run's stamps count (warm caches and clocks)
        launch.launch = traced_launch
        try:
            cuflash.backward(dout, q, k, v, o, lse, causal=shape.causal)
        finally:
            launch.launch = real_launch
    cupy.cuda.Device().synchronize()
    t = captured["buf"].get().astype(np.int64)
    cfg = captured["cfg"]
    sm, t0, kv, first, loop, epi, dq, n_iter = (t[:, i] for i in range(8))
    entry = t[:, 15]
    end = np.maximum(epi, dq)
    med = lambda x: float(np.median(x))  # noqa: E731
    steps = np.maximum(n_iter - 1, 1)
    print(f"{shape.label()} tile m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps}: {len(t)} CTAs, "
          f"{med(n_iter):.0f} steps; median cycles: K/V ready {med(kv - t0):.0f}, first S/dP done "
          f"{med(first - kv):.0f}, loop {med(loop - kv):.0f} ({med((loop - first) / steps):.0f}/step after the "
          f"first), epilogue {med(epi - loop):.0f}, last dQ read after loop {med(dq - loop):.0f}, CTA "
          f"{med(end - t0):.0f}")
    n_steps = int(min(7, n_iter.min()))
    if n_steps > 1:
        ends = t[:, 8:8 + n_steps]
        per_step = np.diff(np.concatenate([kv[:, None], ends], axis=1), axis=1)
        print("  step durations (median cycles, from K/V ready): "
              + " ".join(f"{np.median(per_step[:, j]):.0f}" for j in range(n_steps)))
    gaps, entry_gaps, spans, busy = [], [], [], []
    for s in np.unique(sm):
        idx = np.where(sm == s)[0]
        order = idx[np.argsort(t0[idx])]
        # CTAs that overlap (two per SM) make a negative gap; count the idle time between them only.
        for a, b in zip(order[:-1], order[1:]):
            gaps.append(t0[b] - end[a])
            entry_gaps.append(entry[b] - end[a])
        spans.append(end[order].max() - t0[order].min())
        busy.append(np.sum(end[order] - t0[order]))
    gaps = np.array(gaps)
    print(f"  per SM: {med([len(np.where(sm == s)[0]) for s in np.unique(sm)]):.0f} CTAs, span {med(spans):.0f} "
          f"(max {max(spans):.0f}), CTA-time / span {med(np.array(busy) / np.array(spans)):.2f}; gap to the next "
          f"CTA median {med(gaps):.0f}, p90 {float(np.percentile(gaps, 90)):.0f}; of which before the kernel's entry "
          f"{med(entry_gaps):.0f} and from the entry to the CTA's start (its coordinates, barrier set-up) {med(t0 - entry):.0f}")


# ------------------------------------------------------------------ fallbacks

def fallback_counts(shape, q, k, v):
    """Of the forward's warp key-tile steps on these inputs (a -DCUFLASH_SM90_FWD_COUNT_FALLBACKS build):
    the shares that re-based the kept max, computed S again, and stayed in the kept-max state."""
    define = "-DCUFLASH_SM90_FWD_COUNT_FALLBACKS"
    base = os.environ.get("CUFLASH_NVRTC_DEFINES", "")
    os.environ["CUFLASH_NVRTC_DEFINES"] = (base + " " + define).strip()
    reset_plans()
    try:
        cuflash.forward(q, k, v, causal=shape.causal)
        mods = dispatch.loaded_modules(define)
        for m in mods:
            cupy.ndarray((3,), cupy.uint64, memptr=m.get_global("cuflash_fwd_fallbacks")).fill(0)
        cuflash.forward(q, k, v, causal=shape.causal)
        c = sum(cupy.ndarray((3,), cupy.uint64, memptr=m.get_global("cuflash_fwd_fallbacks")).get() for m in mods)
    finally:
        os.environ["CUFLASH_NVRTC_DEFINES"] = base
        reset_plans()
    steps = shape.fwd_flops() / (4 * shape.head_dim * 16 * 128)   # warp key-tile steps of 16 x 128 (approx.)
    return c[0] / steps, c[1] / steps, c[2] / steps


def fallbacks(shapes, dists) -> None:
    for shape in shapes:
        for dist in dists:
            q, k, v = make_inputs(shape, dist)
            rebase, recompute, kept = fallback_counts(shape, q, k, v)
            print(f"{shape.label():40s} {dist:9s} kept={kept:.3f} rebase={rebase:.4f} recompute={recompute:.5f}",
                  flush=True)


# ------------------------------------------------------------------ phases
def cuflash_phases(shape, repeats: int = 30) -> None:
    """Each kernel of one backward call timed with events between launches, and the whole call (us)."""
    q, k, v = random_inputs(shape)
    dout = random_inputs(shape, seed=1)[0]
    o, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    flush = cupy.empty(256 * 1024 * 1024, dtype=cupy.uint8)
    real_launch = launch.launch
    marks: list = []

    def timed_launch(kernel, config, *args, **kwargs):
        ev = cupy.cuda.Event()
        ev.record()
        marks.append((config.family, ev))
        real_launch(kernel, config, *args, **kwargs)

    per: dict = {}
    whole = []
    for rep in range(repeats + 3):
        flush.fill(1)
        marks.clear()
        launch.launch = timed_launch
        try:
            cuflash.backward(dout, q, k, v, o, lse, causal=shape.causal, dq=grads[0], dk=grads[1], dv=grads[2])
        finally:
            launch.launch = real_launch
        end = cupy.cuda.Event()
        end.record()
        end.synchronize()
        evs = [e for _, e in marks] + [end]
        if rep >= 3:
            for i, (fam, _) in enumerate(marks):
                per.setdefault(fam, []).append(cupy.cuda.get_elapsed_time(evs[i], evs[i + 1]) * 1e3)
        flush.fill(1)
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record()
        cuflash.backward(dout, q, k, v, o, lse, causal=shape.causal, dq=grads[0], dk=grads[1], dv=grads[2])
        e.record()
        e.synchronize()
        if rep >= 3:
            whole.append(cupy.cuda.get_elapsed_time(s, e) * 1e3)
    parts = ", ".join(f"{fam} {statistics.median(t):.1f}" for fam, t in per.items())
    print(f"{shape.label()} cuflash us: {parts}; call {statistics.median(whole):.1f}")


def peer_kernels(shape, repeats: int = 20) -> None:
    """The kernels of the cuDNN (SDPA) and FlashAttention-4 backward passes, from torch.profiler."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("PyTorch not installed: no peer comparison")
        return
    from cuflash.bench import fa4_fn, torch_sdpa

    dt = getattr(torch, shape.dtype)
    for name, fn, sdpa_layout in (("cudnn", torch_sdpa("cudnn"), True), ("fa4", fa4_fn(), False)):
        if fn is None:
            print(f"  {name}: not available")
            continue
        dims = ((shape.batch, shape.heads, shape.seqlen, shape.head_dim) if sdpa_layout
                else (shape.batch, shape.seqlen, shape.heads, shape.head_dim))
        q, k, v = (torch.randn(*dims, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        out = fn(q, k, v, shape.causal)
        g = torch.randn_like(out)
        for _ in range(3):
            torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
            torch.cuda.synchronize()
        rows = []
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t > 0 and ev.count:
                rows.append((t / repeats, ev.count / repeats, ev.key[:90]))
        for t, c, kname in sorted(rows, reverse=True)[:6]:
            print(f"  {name} {t:8.1f} us x{c:.0f}  {kname}")


# ------------------------------------------------------------------ split
def clocks() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def split(shapes) -> None:
    """Forward and backward timed inside one fwd+bwd sequence against each alone, with and without the L2
    flush; the GPU clock (nvidia-smi) before and after."""
    flush = cupy.empty(256 * 1024 * 1024, dtype=cupy.uint8)
    for shape in shapes:
        q, k, v = random_inputs(shape)
        dout = random_inputs(shape, seed=1)[0]
        out = cupy.empty_like(q)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        o, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)

        def fwd():
            return cuflash.forward(q, k, v, causal=shape.causal, return_lse=True, out=out)

        def bwd(o_, lse_):
            cuflash.backward(dout, q, k, v, o_, lse_, causal=shape.causal, dq=grads[0], dk=grads[1], dv=grads[2])

        ev = [cupy.cuda.Event() for _ in range(3)]
        res = {"fwd alone": [], "bwd alone": [], "fwd in pair": [], "bwd in pair": [], "pair": [],
               "pair no flush": [], "bwd alone no flush": []}
        print(f"{shape.label()}: clocks before {clocks()}")
        for rep in range(35):
            flush.fill(1); ev[0].record(); fwd(); ev[1].record(); ev[1].synchronize()
            t_f = cupy.cuda.get_elapsed_time(ev[0], ev[1])
            flush.fill(1); ev[0].record(); bwd(o, lse); ev[1].record(); ev[1].synchronize()
            t_b = cupy.cuda.get_elapsed_time(ev[0], ev[1])
            flush.fill(1); ev[0].record(); o2, lse2 = fwd(); ev[1].record(); bwd(o2, lse2); ev[2].record()
            ev[2].synchronize()
            t_pf, t_pb = cupy.cuda.get_elapsed_time(ev[0], ev[1]), cupy.cuda.get_elapsed_time(ev[1], ev[2])
            ev[0].record(); o2, lse2 = fwd(); bwd(o2, lse2); ev[1].record(); ev[1].synchronize()
            t_pn = cupy.cuda.get_elapsed_time(ev[0], ev[1])
            ev[0].record(); bwd(o, lse); ev[1].record(); ev[1].synchronize()
            t_bn = cupy.cuda.get_elapsed_time(ev[0], ev[1])
            if rep >= 5:
                for key, t in zip(res, (t_f, t_b, t_pf, t_pb, t_pf + t_pb, t_pn, t_bn)):
                    res[key].append(t)
        print(f"  clocks after {clocks()}")
        for key, ts in res.items():
            print(f"  {key:20s} {statistics.median(ts):8.3f} ms  (min {min(ts):.3f})")


# Short and long sequences at the two head dims of the persistent overlap kernel's tiles.
FWD_SHAPES = ("16,16,1024,64,float16", "4,16,4096,64,float16", "32,16,512,128,bfloat16",
              "16,16,1024,128,bfloat16", "4,16,4096,128,bfloat16")
BWD_SHAPES = ("16,16,1024,64,float16,0", "4,16,4096,64,float16,0", "16,16,1024,128,bfloat16,0",
              "4,16,4096,128,bfloat16,0")
FALLBACK_SHAPES = ("4,16,4096,64,float16,0", "4,16,4096,64,bfloat16,0", "4,16,4096,128,float16,0",
                   "4,16,4096,128,bfloat16,1")
PHASE_SHAPES = ("16,16,1024,64,float16,0", "4,16,4096,128,bfloat16,0")
SPLIT_SHAPES = ("1,16,16384,128,bfloat16,1", "4,16,4096,128,bfloat16,1")


def _with_define(define: str) -> None:
    current = os.environ.get("CUFLASH_NVRTC_DEFINES", "")
    if define not in current.split():
        os.environ["CUFLASH_NVRTC_DEFINES"] = (current + " " + define).strip()
    reset_plans()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, default, text in (("fwd", FWD_SHAPES, "persistent sm90 forward, per tile (clock64)"),
                                ("bwd", BWD_SHAPES, "sm90 backward dK/dV kernel, per CTA (clock64)"),
                                ("fallbacks", FALLBACK_SHAPES, "the kept max's fallback shares, per distribution"),
                                ("phases", PHASE_SHAPES, "each backward kernel timed; the peers' kernels"),
                                ("split", SPLIT_SHAPES, "forward and backward inside one fwd+bwd sequence")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("shapes", nargs="*", metavar="SHAPE", help="B,H,N,D,dtype[,causal]; default: " + " ".join(default))
        p.set_defaults(default_shapes=default)
        if name == "fallbacks":
            p.add_argument("--dist", default=",".join(MIXED_CYCLE), help="input distributions, comma-separated")
    args = ap.parse_args(argv)
    shapes = shapes_arg(args.shapes, args.default_shapes)
    if args.cmd == "fwd":
        _with_define("-DCUFLASH_SM90_FWD_TRACE")
        for s in shapes:
            trace_fwd(s)
    elif args.cmd == "bwd":
        _with_define("-DCUFLASH_SM90_BWD_TRACE")
        for s in shapes:
            trace_bwd(s)
    elif args.cmd == "fallbacks":
        fallbacks(shapes, args.dist.split(","))
    elif args.cmd == "phases":
        for s in shapes:
            cuflash_phases(s)
            peer_kernels(s)
    else:
        split(shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
