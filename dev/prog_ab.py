"""Interleaved A/B of programmable attention's kernels (issue #45) on the rows of its table (GPU).

    python3 dev/prog_ab.py [VARIANT ...] [--rows dropout,bias,...] [--passes fwd,fwd+bwd] [--dist normal]
    for r in plain dropout bias; do python3 dev/prog_ab.py VARIANT ... --rows $r --warm-only & done; wait

Rows: cuflash/bench_programmable.py's (B=4 H=16 N=4096 D=128 bf16), each beside plain attention on the same
inputs. A VARIANT is dev/decode_ab.py's tokens (``@CUFLASH_SM90_FWD_TILES=128,128,12``, ``-DNAME=V``); "" is the
default. Each cell: the median ms over interleaved repeats, x plain (plain's ms / the row's, dense pairs: the
masks' rows visit fewer), and the output's relative difference from the first variant's. The row "plain" runs
plain attention under each variant (its tiles, say) against the default."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_ab import _options_of  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="*", default=[""])
    ap.add_argument("--rows", default="dropout,bias,keypad,sparse50,relpos,docmask")
    ap.add_argument("--passes", default="fwd,fwd+bwd")
    ap.add_argument("--dist", default="normal")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--warm-only", action="store_true",
                    help="run each call once and stop (fills CuPy's kernel cache: one process per row in parallel)")
    args = ap.parse_args()

    import cupy

    from cuflash import bench_programmable as bp
    from cuflash import options
    from cuflash.bench import random_inputs, time_interleaved
    from cuflash.distributions import make_inputs

    passes = tuple(args.passes.split(","))
    per_variant = [(v or "default", _options_of(v)) for v in args.variants]
    print("row | pass | plain ms | " + " | ".join(f"{n} ms / x plain / diff" for n, _ in per_variant))
    names = args.rows.split(",")
    rows = [bp.ProgRow("plain", bp.SHAPE, "") if n == "plain" else bp.rows_by_name([n])[0] for n in names]
    for row in rows:
        for dist in args.dist.split(","):
            q, k, v = make_inputs(row.shape, dist, 0)
            inputs = bp.CaseInputs(q, k, v, random_inputs(row.shape, seed=1)[0], bp.row_operands(row))
            fns, outs = {}, {}
            plain = bp.cuflash_fns(inputs, {}, passes)
            outs["plain"] = plain.pop("_out")
            fns.update({("plain", p): f for p, f in plain.items()})
            for name, fields in per_variant:
                with options.override(**fields):
                    kwargs = {} if row.name == "plain" else bp.cuflash_kwargs(row, inputs.ops)
                    built = bp.cuflash_fns(inputs, kwargs, passes)
                outs[name] = built.pop("_out")

                def scoped(f, fields=fields):
                    def call():
                        with options.override(**fields):
                            f()
                    return call
                fns.update({(name, p): scoped(f) for p, f in built.items()})
            for f in fns.values():
                f()
            cupy.cuda.Device().synchronize()
            if args.warm_only:
                print(f"{row.name}: compiled", flush=True)
                continue
            ms = time_interleaved(fns, warmup=args.warmup, repeats=args.repeats)
            first = outs[per_variant[0][0]].astype(cupy.float32)
            for p in passes:
                cells = []
                for name, _ in per_variant:
                    diff = float(cupy.linalg.norm(outs[name].astype(cupy.float32) - first) / cupy.linalg.norm(first))
                    t = ms[(name, p)]
                    cells.append(f"{t:7.3f} / {ms[('plain', p)] / t:4.2f} / {diff:.1e}")
                print(f"{row.name}-{dist} | {p} | {ms[('plain', p)]:7.3f} | " + " | ".join(cells), flush=True)
            del q, k, v, inputs, fns, outs
            cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
