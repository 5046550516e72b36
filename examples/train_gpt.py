"""A small GPT trained twice from the same start, attention by PyTorch SDPA and by cuflash.torch: the loss
curves must agree. ``python examples/train_gpt.py [--steps 300] [--out docs/training]`` writes
``<out>.json`` (both curves, device, date, commit) and ``<out>.png`` (needs matplotlib; otherwise plot the
JSON later with ``--plot <out>.json``).

The corpus is this repository's own text (README, docs, Python and CUDA sources), read as bytes: a
character-level model, 4 layers, width 256, 4 heads of 64, 256 tokens of context, AdamW, bf16 autocast.
Both runs draw the same batches in the same order from the same initial weights.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def corpus_bytes() -> bytes:
    files = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("cuflash/**/*.py"),
                    *ROOT.glob("kernels_cu/**/*.cu*")])
    return b"\n".join(p.read_bytes() for p in files if p.is_file())


def build_model(torch, attention: str, vocab: int = 256, width: int = 256, layers: int = 4, heads: int = 4,
                context: int = 256):
    nn, F = torch.nn, torch.nn.functional
    if attention == "cuflash":
        from cuflash.torch import flash_attn_func

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, heads, width // heads).unbind(2)   # (b, n, h, d) each
            if attention == "cuflash":
                y = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
            else:   # SDPA takes (b, h, n, d)
                y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True).transpose(1, 2)
            x = x + self.proj(y.reshape(b, n, width))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.pos = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(context, width))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

        def forward(self, idx):
            x = self.embed(idx) + self.pos[: idx.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    return GPT()


def train(attention: str, steps: int, batch: int, context: int, seed: int) -> list[float]:
    import torch

    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long().cuda()
    torch.manual_seed(seed)
    model = build_model(torch, attention, context=context).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    losses = []
    for step in range(steps):
        starts = torch.randint(0, data.numel() - context - 1, (batch,), device="cuda", generator=gen)
        idx = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
        lr = 1e-3 * min(1.0, (step + 1) / 50) * (0.5 + 0.5 * math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in result["losses"].items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(f"4-layer GPT on this repository's text: SDPA vs cuflash.torch\n{result['device']}, "
                 f"{result['date']}, commit {result['commit']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def summary(result: dict) -> str:
    a, b = result["losses"]["sdpa"], result["losses"]["cuflash"]
    tail = slice(len(a) - 50, len(a))
    mean = lambda x: sum(x) / len(x)  # noqa: E731
    return (f"final 50 steps: sdpa {mean(a[tail]):.4f}, cuflash {mean(b[tail]):.4f}; largest per-step gap "
            f"{max(abs(x - y) for x, y in zip(a, b)):.4f}; first step {a[0]:.4f} / {b[0]:.4f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "training_gpt"))
    ap.add_argument("--commit", help="the commit to name (default: git rev-parse of this checkout)")
    ap.add_argument("--plot", help="only plot this JSON (made on a GPU machine) to its .png")
    args = ap.parse_args(argv)
    if args.plot:
        result = json.loads(Path(args.plot).read_text())
        plot(result, Path(args.plot).with_suffix(".png"))
        print(summary(result))
        return 0
    import torch

    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    result = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit,
              "steps": args.steps, "batch": args.batch, "context": args.context,
              "losses": {name: train(name, args.steps, args.batch, args.context, args.seed)
                         for name in ("sdpa", "cuflash")}}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result))
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib missing: plot later with --plot", file=sys.stderr)
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
