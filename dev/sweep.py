"""Sweeps on the GPU: throughput against sequence length beside the peers, and tile candidates.

    python3 dev/sweep.py seqlen [OUT_DIR] [--head-dim 128] [--dtype bfloat16] [--tokens 16384] [--heads 16]
    python3 dev/sweep.py tiles PASS --env NAME TILES [TILES ...] [--shape S ...] [--backend B] [--det] [--check]

``seqlen``: sequence lengths 512 to 32k at a fixed number of tokens per batch: TFLOP/s of cuflash, SDPA cuDNN
and SDPA FlashAttention-2 (where PyTorch runs them), forward and forward+backward, causal and not, timed
interleaved; writes OUT_DIR/sweep_d<D>_<dtype>.json and .png (needs matplotlib), the README's sweep figure.
``tiles``: PASS (fwd or bwd) timed on each shape with each tile candidate TILES ("bm,bn,warps", or
"D:bm,bn,warps" for shapes of head dim D only; "default" for no override) given through the environment
variable NAME, e.g. CUFLASH_SM80_FWD_TILES, CUFLASH_SM90_FWD_TILES, CUFLASH_SM90_BWD_TILES,
CUFLASH_SM80_BWD_DKDV_TILES, CUFLASH_SM80_BWD_DQ_TILES, CUFLASH_SM90_FP8_TILES. The candidates' kernels are
compiled first, in parallel. ``--backend`` forces CUFLASH_FWD_BACKEND / CUFLASH_BWD_BACKEND; ``--det`` times the
deterministic backward; ``--check`` adds each candidate's relative difference from the default tiles' result.

    python3 dev/sweep.py tiles fwd --backend sm80 --env CUFLASH_SM80_FWD_TILES 64:128,64,4 64:128,128,4 \
        128:128,32,4 128:128,64,4 --shape 4,16,4096,64,float16 --shape 4,16,4096,128,bfloat16,1
    python3 dev/sweep.py tiles bwd --env CUFLASH_SM90_BWD_TILES default 128,128,12 64,128,12 --check
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Variant, cuflash_call, free_memory, precompile_parallel, reset_plans, shapes_arg  # noqa: E402

SEQLENS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
TILE_SHAPES = ["4,16,4096,64,float16,0", "4,16,4096,64,float16,1", "4,16,4096,128,bfloat16,0",
               "4,16,4096,128,bfloat16,1"]


# ------------------------------------------------------------------------------------ seqlen
def measure(causal: bool, seqlens, tokens: int, heads: int, head_dim: int, dtype: str) -> list[dict]:
    """One row per sequence length: TFLOP/s of cuflash and the SDPA backends, forward and fwd+bwd."""
    import cupy

    import cuflash
    from cuflash.bench import Shape, random_inputs, tflops, time_interleaved, torch_sdpa

    rows = []
    for n in seqlens:
        shape = Shape(max(1, tokens // n), heads, n, head_dim, dtype, causal)
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

            from cuflash.bench import torch_inputs

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
        fwd = fwd_bwds = q = k = v = dout = out = grads = None   # the buffers go before the next shape
        cupy.get_default_memory_pool().free_all_blocks()
        try:
            import torch

            torch.cuda.empty_cache()
        except ImportError:
            pass
        print(row, flush=True)
        rows.append(row)
    return rows


def plot(rows: list[dict], path: str, head_dim: int, dtype: str, tokens: int, heads: int) -> None:
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
            ax.set_title(f"{title}, D={head_dim} {dtype}{', causal' if causal else ''}")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend()
    for ax in axes[1]:
        ax.set_xlabel(f"sequence length (batch x seqlen = {tokens} tokens, {heads} heads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------ tiles
def _candidates(tiles: list[str], head_dim: int) -> list[str]:
    """The candidates that apply to a head dim ("default" first if given), without their "D:" prefix."""
    out = []
    for t in tiles:
        d, sep, rest = t.partition(":")
        if not sep:
            out.append(t)
        elif int(d) == head_dim:
            out.append(rest)
    return out


def _set_tiles(env: str, tiles: str | None) -> None:
    if tiles and tiles != "default":
        os.environ[env] = tiles
    else:
        os.environ.pop(env, None)
    reset_plans()


def _precompile(pas: str, env: str, tiles: list[str], shapes, det: bool) -> None:
    """The kernels each candidate selects (from the heuristics, under the override), compiled in parallel."""
    try:
        from cuflash import heuristics
        from cuflash.dispatch import device_info

        cc = device_info(0)[0]
        cfgs = []
        for s in shapes:
            for t in _candidates(tiles, s.head_dim):
                _set_tiles(env, t)
                if pas == "fwd":
                    cfgs.append(heuristics.fwd_config(s.dtype, s.head_dim, s.causal, cc))
                else:
                    cfgs += heuristics.bwd_configs(s.dtype, s.head_dim, s.causal, cc, det).all()
        _set_tiles(env, None)
    except Exception as e:  # noqa: BLE001 - compiled at the first call instead
        print(f"precompile skipped: {type(e).__name__}: {e}", flush=True)
        return
    failed = precompile_parallel(list({c.key(): c for c in cfgs}.values()))
    for f in failed:
        print("compile failed:", f[:300], flush=True)


def sweep_tiles(pas: str, env: str, tiles: list[str], shapes, det: bool, check: bool, repeats: int) -> None:
    import cupy

    from cuflash.bench import random_inputs, time_cuda

    _precompile(pas, env, tiles, shapes, det)
    var = Variant.parse("det" if det else "")
    flops_factor = 2.5 if pas == "bwd" else 1.0
    for s in shapes:
        q, k, v = random_inputs(s)
        dout = random_inputs(s, seed=1)[0]
        base = None
        if check:
            _set_tiles(env, None)
            run, result = cuflash_call(pas, var, s, q, k, v, dout)
            run()
            base = [x.astype(cupy.float32) for x in result()]
        for t in _candidates(tiles, s.head_dim):
            _set_tiles(env, t)
            try:
                run, result = cuflash_call(pas, var, s, q, k, v, dout)
                ms = time_cuda(run, repeats=repeats)
                line = f"{s.label():45s} {env[8:]}={t:14s} {ms:8.3f} ms {flops_factor * s.fwd_flops() / ms / 1e9:7.1f} TFLOP/s"
                if base is not None:
                    diff = max(float(cupy.linalg.norm(x.astype(cupy.float32) - r) / cupy.linalg.norm(r))
                               for x, r in zip(result(), base))
                    line += f"  vs default {diff:.1e}"
                print(line, flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{s.label():45s} {env[8:]}={t:14s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        _set_tiles(env, None)
        del q, k, v, dout, base
        free_memory()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("seqlen", help="TFLOP/s against sequence length beside SDPA; JSON and PNG")
    p.add_argument("out_dir", nargs="?", default=".")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    p.add_argument("--heads", type=int, default=16)
    p = sub.add_parser("tiles", help="tile candidates through a tile-override variable")
    p.add_argument("pas", choices=("fwd", "bwd"), metavar="PASS", help="fwd | bwd")
    p.add_argument("tiles", nargs="+", metavar="TILES", help='"bm,bn,warps", "D:bm,bn,warps" or "default"')
    p.add_argument("--env", required=True, help="the override variable, e.g. CUFLASH_SM90_BWD_TILES")
    p.add_argument("--shape", action="append", help="B,H,N,D,dtype[,causal] (repeatable; default: " + " ".join(TILE_SHAPES) + ")")
    p.add_argument("--backend", help="CUFLASH_FWD_BACKEND / CUFLASH_BWD_BACKEND for the sweep")
    p.add_argument("--det", action="store_true", help="the deterministic backward")
    p.add_argument("--check", action="store_true", help="relative difference from the default tiles' result")
    p.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if args.cmd == "seqlen":
        dims = dict(tokens=args.tokens, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype)
        rows = measure(False, SEQLENS, **dims) + measure(True, SEQLENS, **dims)
        stem = os.path.join(args.out_dir, f"sweep_d{args.head_dim}_{'bf16' if args.dtype == 'bfloat16' else args.dtype}")
        with open(stem + ".json", "w") as f:
            json.dump(rows, f, indent=1)
        plot(rows, stem + ".png", **dims)
        return 0
    if args.backend:
        os.environ["CUFLASH_FWD_BACKEND" if args.pas == "fwd" else "CUFLASH_BWD_BACKEND"] = args.backend
    sweep_tiles(args.pas, args.env, args.tiles, shapes_arg(args.shape, TILE_SHAPES), args.det, args.check, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
