"""The multi-GPU check: ring attention over real NCCL against one GPU and against float64.

``python -m cuflash.distributed.check [--gpus N] [--seqlen 32768] ...`` starts one process per GPU; each
draws the whole sequence from the same seed, runs the ring forward and backward on its zig-zag shard and
hands its shard back. This process then runs single-GPU cuflash on the whole sequence and a float64
reference (on the GPU, by chunks of query rows) and compares all three. Exit code 1 if a bound fails.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import numpy as np

# Relative-norm bounds against float64 (those of the single-GPU tests, tests/conftest.py).
FWD_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
BWD_TOL = {"float16": 2.5e-3, "bfloat16": 2e-2, "float32": 1.5e-5}
LSE_TOL = 1e-3   # absolute, times max(1, |lse|)


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    dist: str = "normal"
    seed: int = 0

    def label(self) -> str:
        return (f"B={self.batch} N={self.seqlen} H={self.heads}/{self.kv_heads} D={self.head_dim} {self.dtype}"
                f"{' causal' if self.causal else ''} {self.dist}")


def global_inputs(case: Case):
    """(q, k, v, dout) of the whole sequence on the current GPU, the same on every GPU for one seed."""
    import cupy

    from ..bench import Shape
    from ..distributions import make_inputs

    shape = Shape(case.batch, case.heads, case.seqlen, case.head_dim, case.dtype, case.causal, heads_kv=case.kv_heads)
    q, k, v = make_inputs(shape, case.dist, case.seed)
    dout = cupy.random.RandomState(case.seed + 1).standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    return q, k, v, dout


def _host(x):
    """A CuPy array as NumPy, bfloat16 kept as its bits' ml_dtypes view (pickles between processes)."""
    return x.get()


def _ring_rank(group, case: Case, deterministic: bool):
    """One rank: the whole sequence from the seed, the ring on this rank's shard, the shard back."""
    from . import ring_backward, ring_forward, zigzag_shard

    q, k, v, dout = (zigzag_shard(x, group.world, group.rank) for x in global_inputs(case))
    out, lse = ring_forward(q, k, v, group, causal=case.causal, return_lse=True)
    dq, dk, dv = ring_backward(dout, q, k, v, out, lse, group, causal=case.causal, deterministic=deterministic)
    return {name: _host(x) for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))}


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| on the GPU in float64; NaN or inf in x gives inf."""
    import cupy

    x = cupy.asarray(x).astype(cupy.float64)
    ref = cupy.asarray(ref).astype(cupy.float64)
    if not bool(cupy.isfinite(x).all()):
        return math.inf
    return float(cupy.linalg.norm((x - ref).ravel()) / cupy.linalg.norm(ref.ravel()))


def lse_err(x, ref) -> float:
    """max |x - ref| / max(1, max |ref|); NaN or inf gives inf."""
    import cupy

    x = cupy.asarray(x).astype(cupy.float64)
    if not bool(cupy.isfinite(x).all()):
        return math.inf
    return float(cupy.abs(x - ref).max() / max(1.0, float(cupy.abs(ref).max())))


def check_case(world: int, case: Case, *, deterministic: bool = False) -> dict:
    """Runs the ring on ``world`` GPUs and compares. Returns {"ring": errs, "single": errs, "ring_vs_single":
    errs, "pass": bool}, each errs {out, lse, dq, dk, dv}."""
    import cupy

    import cuflash
    from ..reference import attention_reference_chunked
    from .launch import run_ranks
    from .plan import zigzag_unshard

    shards = run_ranks(_ring_rank, world, (case, deterministic), timeout_s=240)
    ring = {name: zigzag_unshard([cupy.asarray(s[name]) for s in shards], axis=2 if name == "lse" else 1)
            for name in ("out", "lse", "dq", "dk", "dv")}
    q, k, v, dout = global_inputs(case)
    out, lse = cuflash.forward(q, k, v, causal=case.causal, return_lse=True)
    dq, dk, dv = cuflash.backward(dout, q, k, v, out, lse, causal=case.causal, deterministic=deterministic)
    single = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    ref = dict(zip(("out", "lse", "dq", "dk", "dv"),
                   attention_reference_chunked(q, k, v, dout, causal=case.causal, chunk_rows=2048)))

    def errs(x, r):
        return {name: (lse_err if name == "lse" else rel_err)(x[name], r[name]) for name in x}

    result = {"ring": errs(ring, ref), "single": errs(single, ref), "ring_vs_single": errs(ring, single)}
    bounds = bounds_of(case.dtype)
    result["pass"] = all(result["ring"][name] <= bounds[name] for name in bounds)
    return result


def bounds_of(dtype: str) -> dict:
    return {"out": FWD_TOL[dtype], "lse": LSE_TOL, "dq": BWD_TOL[dtype], "dk": BWD_TOL[dtype], "dv": BWD_TOL[dtype]}


def main(argv=None) -> int:
    from .launch import gpu_count

    ap = argparse.ArgumentParser(prog="python -m cuflash.distributed.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=0, help="ranks (default: every visible GPU)")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    ap.add_argument("--dist", default="normal")
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args(argv)
    world = args.gpus or gpu_count()
    if world < 1:
        print("cuflash.distributed.check: no GPU visible", file=sys.stderr)
        return 1
    ok = True
    print("| case | GPUs | vs float64: out | lse | dq | dk | dv | one GPU vs float64: out | dq | dk | dv | pass |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for causal in (False, True):
        case = Case(args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim, args.dtype, causal, args.dist)
        r = check_case(world, case, deterministic=args.deterministic)
        ok &= r["pass"]
        e, s = r["ring"], r["single"]
        print(f"| {case.label()} | {world} | {e['out']:.2e} | {e['lse']:.1e} | {e['dq']:.2e} | {e['dk']:.2e} | "
              f"{e['dv']:.2e} | {s['out']:.2e} | {s['dq']:.2e} | {s['dk']:.2e} | {s['dv']:.2e} | "
              f"{'yes' if r['pass'] else 'NO'} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    # The package's copy of this module, not __main__: the ranks' functions and cases pickle by that name.
    from cuflash.distributed import check as _module

    sys.exit(_module.main())
