"""Sequence-length sweep at D=128 bf16 (16k tokens per batch, 16 heads): TFLOP/s of cuflash,
SDPA cuDNN and SDPA FlashAttention-2, forward and forward+backward; writes JSON and a PNG.

    python scripts/sweep.py OUT_DIR
"""
from __future__ import annotations

import json
import sys

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs, tflops, time_interleaved, torch_inputs, torch_sdpa

SEQLENS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
TOKENS = 16384


def measure(causal: bool) -> list[dict]:
    rows = []
    for n in SEQLENS:
        shape = Shape(max(1, TOKENS // n), 16, n, 128, "bfloat16", causal)
        flops = shape.fwd_flops()
        row = {"seqlen": n, "batch": shape.batch, "causal": causal}
        q, k, v = random_inputs(shape)
        dout = random_inputs(shape, seed=1)[0]
        out = cupy.empty_like(q)
        grads = [cupy.empty_like(x) for x in (q, k, v)]

        def fwd_bwd():
            o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
            cuflash.backward(dout, q, k, v, o, lse, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2])

        fwd = {"cuflash": lambda: cuflash.forward(q, k, v, causal=causal, out=out)}
        fwd_bwds = {"cuflash": fwd_bwd}
        for backend in ("cudnn", "flash"):
            fn = torch_sdpa(backend)
            if fn is None:
                continue
            import torch

            tq, tk, tv = torch_inputs(shape, requires_grad=True)
            tdo = torch.randn_like(tq)
            try:
                torch.autograd.grad(fn(tq, tk, tv, causal), (tq, tk, tv), tdo)  # runs this shape?
            except RuntimeError:
                continue
            fwd[backend] = lambda fn=fn, tq=tq, tk=tk, tv=tv: fn(tq, tk, tv, causal)
            fwd_bwds[backend] = (lambda fn=fn, tq=tq, tk=tk, tv=tv, tdo=tdo:
                                 torch.autograd.grad(fn(tq, tk, tv, causal), (tq, tk, tv), tdo))
        # each pass: the implementations sample by sample in turn (the same clocks for all)
        for name, ms in time_interleaved(fwd, repeats=20).items():
            row[f"{name}_fwd"] = tflops(flops, ms)
        for name, ms in time_interleaved(fwd_bwds, repeats=10).items():
            row[f"{name}_fwd_bwd"] = tflops(3.5 * flops, ms)
        del fwd, fwd_bwds, q, k, v, dout, out, grads
        cupy.get_default_memory_pool().free_all_blocks()
        try:
            import torch

            torch.cuda.empty_cache()
        except ImportError:
            pass
        print(row, flush=True)
        rows.append(row)
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for col, causal in enumerate((False, True)):
        sel = [r for r in rows if r["causal"] == causal]
        xs = [r["seqlen"] for r in sel]
        for row_i, (suffix, title) in enumerate((("fwd", "forward"), ("fwd_bwd", "forward+backward"))):
            ax = axes[row_i][col]
            for name, label in (("cuflash", "cuflash"), ("cudnn", "SDPA cuDNN"), ("flash", "SDPA FlashAttention-2")):
                ys = [r.get(f"{name}_{suffix}") for r in sel]
                if any(y is not None for y in ys):
                    ax.plot(xs, ys, marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{title}, D=128 bf16{', causal' if causal else ''}")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend()
    for ax in axes[1]:
        ax.set_xlabel("sequence length (batch x seqlen = 16k tokens, 16 heads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    rows = measure(False) + measure(True)
    with open(f"{out_dir}/sweep_d128_bf16.json", "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, f"{out_dir}/sweep_d128_bf16.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
