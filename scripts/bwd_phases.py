"""Where a backward call's time goes: each kernel of cuflash's backward timed with events between
launches (median of repeats, L2 flushed before each call), the whole call, and, where PyTorch is
installed, the kernels of SDPA's cuDNN backward and of FlashAttention-4's (where it imports:
$CUFLASH_FA4_PATH) from torch.profiler.

    python3 scripts/bwd_phases.py [B,H,N,D,dtype,causal ...]
"""
from __future__ import annotations

import statistics
import sys

import cupy

import cuflash
from cuflash import launch
from cuflash.bench import Shape, random_inputs


def cuflash_phases(shape: Shape, repeats: int = 30) -> None:
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


def peer_kernels(shape: Shape, repeats: int = 20) -> None:
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


def main() -> int:
    specs = sys.argv[1:] or ["16,16,1024,64,float16,0", "4,16,4096,128,bfloat16,0"]
    for spec in specs:
        b, h, n, d, dtype, causal = spec.split(",")
        shape = Shape(int(b), int(h), int(n), int(d), dtype, bool(int(causal)))
        cuflash_phases(shape)
        peer_kernels(shape)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
