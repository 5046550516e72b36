"""Interleaved A/B timing of cuflash builds on the same inputs (GPU).

    python3 dev/ab.py run PASS VARIANT [VARIANT ...] [--shape B,H,N,D,dtype[,causal] ...] [--dist D,...]
                       [--rounds 3] [--repeats 20] [--check first|reference] [--no-timing]
    python3 dev/ab.py checkouts PATH_A PATH_B [--pass fwd,bwd] [--rounds 2] [--shape ...]

``run``: one process; PASS is fwd, bwd, fwd+bwd or fp8 (forward_fp8 on the inputs quantised per tensor,
bf16 shapes). Each VARIANT is a string of tokens (dev/_common.py): NVRTC defines (``-DNAME=V``),
environment variables for that variant only (``@CUFLASH_FWD_BACKEND=sm80``, ``@CUFLASH_SM90_FWD_TILES=128,176,12``,
``@CUFLASH_SM90_BWD_SHORT=0``), another tree's kernel sources (``src=/tmp/old/kernels_cu``), ``det``
(deterministic backward), or a peer (``cudnn``, ``flash``, ``fa4``); "" is the default build. The variants
run in alternating rounds (clock drift falls on all alike); each line gives, per shape and input distribution
(cuflash/distributions.py), the median TFLOP/s of each variant over the rounds (``--ms``: milliseconds too).
``--check first`` adds each variant's relative difference from the first variant's output (backward: the
worst of dq, dk, dv), ``--check reference`` its error against the float64 reference (small shapes).
Defaults from the environment, as the older script read them: $AB_SHAPES ("B,H,N,D,dtype,causal;..."),
$AB_ROUNDS, $AB_DISTS, $AB_DETERMINISTIC=1 (``det`` on every variant).

    python3 dev/ab.py run bwd "" "-DCUFLASH_SM90_BWD_TRACE"
    python3 dev/ab.py run fwd "" "src=/tmp/old/kernels_cu" --dist normal,outlier12,mixed
    python3 dev/ab.py run fwd "@CUFLASH_FWD_BACKEND=sm80" "@CUFLASH_FWD_BACKEND=sm90" cudnn --check first
    python3 dev/ab.py run fwd "" "-DCUFLASH_SM90_FWD_KEEP_MAX=0" --shape 1,4,1031,128,bfloat16 \\
        --dist outlier8,outlier12,sharp --check reference --no-timing

``checkouts``: whole checkouts (Python and kernels), one process per checkout and round (PYTHONPATH=PATH),
alternating A B A B; their kernels are compiled first (in parallel). Prints each row's median ms and TFLOP/s
per checkout for the forward and the backward (default and deterministic).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Variant, apply_variants, cuflash_call, free_memory, peer_call, shapes_arg  # noqa: E402

DEFAULT_SHAPES = ["4,16,4096,64,float16,1", "4,16,4096,128,bfloat16,0", "4,16,4096,128,bfloat16,1",
                  "4,16,4096,96,bfloat16,0", "1,16,16384,128,bfloat16,1", "4,16,4096,192,bfloat16,0"]
# The benchmark table's rows, for checkouts
ROWS = ["4,16,4096,64,float16,0", "4,16,4096,64,float16,1", "4,16,4096,128,bfloat16,0",
        "4,16,4096,128,bfloat16,1", "4,16,4096,256,bfloat16,0", "4,16,4096,256,bfloat16,1",
        "1,16,16384,128,bfloat16,1", "16,16,1024,64,float16,0"]
PASS_FLOPS = {"fwd": 1.0, "fp8": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def _env_shapes() -> list[str] | None:
    spec = os.environ.get("AB_SHAPES")
    return [s for s in spec.split(";") if s.strip()] if spec else None


def _errors(pas, shape, results, q, k, v, dout, check):
    """Per variant: relative error against the first variant's output or the float64 reference."""
    import cupy

    from cuflash.reference import attention_reference, attention_reference_backward, rel_err

    if check == "reference":
        if pas in ("fwd", "fp8"):
            ref = [attention_reference(q, k, v, causal=shape.causal)[0]]
        else:
            ref = list(attention_reference_backward(dout, q, k, v, causal=shape.causal))
    else:
        first = next((r for r in results if r is not None), None)
        ref = None if first is None else [cupy.asnumpy(x.astype(cupy.float32)).astype("float64") for x in first]
    return [None if r is None or ref is None else max(rel_err(x, y) for x, y in zip(r, ref)) for r in results]


def cmd_run(args) -> None:
    from cuflash.bench import random_inputs, time_cuda
    from cuflash.distributions import make_inputs

    variants = [Variant.parse(t) for t in args.variants]
    if os.environ.get("AB_DETERMINISTIC") == "1":
        for v in variants:
            v.det = True
    apply = apply_variants(variants)
    shapes = shapes_arg(args.shape, _env_shapes() or DEFAULT_SHAPES)
    if args.precompile:
        _precompile_variants(args.pas, variants, shapes, apply)
    for shape in shapes:
        for dist in args.dist.split(","):
            q, k, v = make_inputs(shape, dist)
            dout = random_inputs(shape, seed=1)[0]
            runs, results = [], []
            for var in variants:
                apply(var)
                run, result = (peer_call(args.pas, var.peer, shape, q, k, v, dout) if var.peer
                               else cuflash_call(args.pas, var, shape, q, k, v, dout))
                runs.append(run)
                if args.check and run is not None:
                    run()
                    got = result() if result else None
                    results.append([x.copy() for x in got] if got else None)
                else:
                    results.append(None)
            times = [[] for _ in variants]
            for _ in range(0 if args.no_timing else args.rounds):
                for i, var in enumerate(variants):
                    if runs[i] is None:
                        continue
                    apply(var)
                    times[i].append(time_cuda(runs[i], repeats=args.repeats))
            errs = _errors(args.pas, shape, results, q, k, v, dout, args.check) if args.check else [None] * len(variants)
            flops = PASS_FLOPS[args.pas] * shape.fwd_flops()
            cells = []
            for var, run, t, e in zip(variants, runs, times, errs):
                cell = f"{var.label}: "
                if run is None:
                    cell += "n/a"
                elif t:
                    ms = statistics.median(t)
                    cell += f"{flops / ms / 1e9:.0f}" + (f" ({ms:.3f} ms)" if args.ms else "")
                if e is not None:
                    cell += f" err {e:.2e}"
                cells.append(cell.strip())
            print(f"{shape.label() + ' ' + dist:55s} " + " | ".join(cells), flush=True)
            del q, k, v, dout, runs, results
            free_memory()
    apply(Variant.parse(""))


def _shape_configs(shapes, cc: int, dets=(False, True)) -> list:
    """The forward's kernel and, per deterministic mode in ``dets``, the backward's kernels of each shape on compute
    capability ``cc`` (deduplicated)."""
    from cuflash import heuristics

    cfgs = []
    for s in shapes:
        cfgs.append(heuristics.fwd_config(s.dtype, s.head_dim, s.causal, cc))
        for det in dets:
            cfgs += heuristics.bwd_configs(s.dtype, s.head_dim, s.causal, cc, det).all()
    return list({c.key(): c for c in cfgs}.values())


def _precompile_variants(pas, variants, shapes, apply) -> None:
    """Compile each cuflash variant's kernels for ``shapes`` in parallel processes (its defines and environment
    there), so that the timed process finds them in CuPy's disk cache. Variants with other sources (src=) compile
    on first use."""
    import time

    from _common import precompile_parallel
    from cuflash import options
    from cuflash.dispatch import device_info

    t0, n = time.time(), 0
    for var in variants:
        if var.peer or var.src:
            continue
        apply(var)
        options.reload()
        cc = device_info(0)[0]
        cfgs = _shape_configs(shapes, cc, (var.det,) if pas in ("bwd", "fwd+bwd") else ())
        env = dict(var.env, CUFLASH_NVRTC_DEFINES=" ".join(var.defines))
        failed = precompile_parallel(cfgs, None, env)
        n += len(cfgs)
        for f in failed:
            print(f"precompile {var.label}: {f}", flush=True)
    apply(Variant.parse(""))
    options.reload()
    print(f"precompiled {n} kernels in {time.time() - t0:.0f} s", flush=True)


# ----------------------------------------------------------------------------------- checkouts
def _time_row(s, passes, repeats) -> dict:
    import cupy

    import cuflash
    from cuflash.bench import random_inputs, time_cuda

    q, k, v = random_inputs(s)
    dout = random_inputs(s, seed=1)[0]
    out, lse = cuflash.forward(q, k, v, causal=s.causal, return_lse=True)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    row = {"shape": s.label()}
    if "fwd" in passes:
        row["fwd"] = time_cuda(lambda: cuflash.forward(q, k, v, causal=s.causal, out=out), repeats=repeats)
    if "bwd" in passes:
        for det in (False, True):
            row["bwd det" if det else "bwd"] = time_cuda(
                lambda: cuflash.backward(dout, q, k, v, out, lse, causal=s.causal,  # noqa: B023
                                         deterministic=det, dq=grads[0], dk=grads[1], dv=grads[2]),
                repeats=repeats)
    return row


def _worker(args) -> int:
    """One checkout (cuflash from $PYTHONPATH): precompile its kernels, or time the rows (JSON lines)."""
    import cupy

    shapes = shapes_arg(args.shape, ROWS)
    passes = args.passes.split(",")
    if args.precompile:
        from _common import precompile_parallel

        try:
            cfgs = _shape_configs(shapes, 90)
        except Exception as e:  # noqa: BLE001 - another checkout's heuristics may differ
            print(f"precompile skipped ({type(e).__name__}: {e}): the first round compiles", flush=True)
            return 0
        failed = precompile_parallel(cfgs)
        print(f"precompiled, {len(failed)} failed", *failed, sep="\n", flush=True)
        return 1 if failed else 0
    for s in shapes:
        print(json.dumps(_time_row(s, passes, args.repeats)), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


def cmd_checkouts(args) -> int:
    me = os.path.abspath(__file__)
    extra = ["--passes", args.passes, "--repeats", str(args.repeats)] + sum((["--shape", s] for s in args.shape or []), [])

    def worker(path, *flags):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
        return subprocess.run([sys.executable, me, "_worker", *flags, *extra], env=env, cwd=os.path.abspath(path),
                              capture_output=True, text=True)

    status = 0
    for path in args.paths:
        res = worker(path, "--precompile")
        print(f"{path}: {res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-500:]}", flush=True)
        status |= res.returncode
    rows: dict = {}
    for _ in range(args.rounds):
        for path in args.paths:
            res = worker(path)
            if res.returncode:
                print(f"{path}: failed\n{res.stderr[-2000:]}", flush=True)
                return 1
            for line in res.stdout.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    for key, ms in r.items():
                        if key != "shape":
                            rows.setdefault((r["shape"], key), {}).setdefault(path, []).append(ms)
    for (label, key), per in rows.items():
        cells = [f"{p}: {statistics.median(t):.3f} ms" for p, t in per.items()]
        print(f"{label:45s} {key:8s} " + " | ".join(cells), flush=True)
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{run,checkouts}")
    r = sub.add_parser("run", help="variants of one build, interleaved in one process")
    r.add_argument("pas", choices=tuple(PASS_FLOPS), metavar="PASS", help="fwd | bwd | fwd+bwd | fp8")
    r.add_argument("variants", nargs="+", metavar="VARIANT")
    r.add_argument("--shape", action="append", help="B,H,N,D,dtype[,causal] (repeatable)")
    r.add_argument("--dist", default=os.environ.get("AB_DISTS", "normal"), help="input distributions, comma-separated")
    r.add_argument("--rounds", type=int, default=int(os.environ.get("AB_ROUNDS", "3")))
    r.add_argument("--repeats", type=int, default=20, help="timed calls per round")
    r.add_argument("--check", choices=("first", "reference"), help="also each variant's error")
    r.add_argument("--no-timing", action="store_true", help="only --check")
    r.add_argument("--ms", action="store_true", help="milliseconds beside TFLOP/s")
    r.add_argument("--precompile", action="store_true", help="compile the variants' kernels first, in parallel")
    c = sub.add_parser("checkouts", help="whole checkouts, one process each, alternating")
    c.add_argument("paths", nargs="+", metavar="PATH")
    c.add_argument("--passes", default="fwd,bwd", help="fwd,bwd (the backward default and deterministic)")
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--repeats", type=int, default=30)
    c.add_argument("--shape", action="append", help="B,H,N,D,dtype[,causal] (default: the table's rows)")
    w = sub.add_parser("_worker", help=argparse.SUPPRESS)
    w.add_argument("--precompile", action="store_true")
    w.add_argument("--passes", default="fwd,bwd")
    w.add_argument("--repeats", type=int, default=30)
    w.add_argument("--shape", action="append")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        cmd_run(args)
        return 0
    return cmd_checkouts(args) if args.cmd == "checkouts" else _worker(args)


if __name__ == "__main__":
    sys.exit(main())
