"""Fill CuPy's on-disk kernel cache in parallel, so that a test or benchmark run finds its kernels
compiled (dev/device_run.sh runs it before each phase).

    python3 dev/precompile.py [fwd] [bwd] [fp8] [small] [ring] [sched] [fwdall] [variants] [-j N] [-D DEFINE ...]

Groups (default: fwd bwd), for the device's compute capability:
  fwd     every forward the dispatcher picks (and, on Hopper, the Hopper kernels)
  bwd     every backward (and, on Hopper, the Hopper backward kernels)
  fp8     the fp8 forward and its helpers (Hopper)
  small   the backward tiles of ~99 KB-shared-memory devices, to run them on a large one
  ring    ring attention's merge helpers (cuflash.distributed)
  sched   the forced Hopper forward schedules that ``dev/profiling.py sanitize sched`` runs
  fwdall  every forced Hopper forward schedule (tests/test_fwd_sm90.py)
  variants the kernels of the variant table's rows, variant and plain (cuflash/bench_variants.py)
  variant_tests the kernels of tests/test_variants.py's cases
  varlen_tests the kernels of tests/test_varlen_fwd.py's cases
  varlen_bench the kernels of the varlen table's rows, varlen and dense (cuflash/bench_varlen.py)
  large   the head dims above 256 (tests/test_large_head_dims.py's pairs, forward and backward) and the head-dim
          table's kernels (cuflash/bench_shapes.py)
``-D`` defines go into $CUFLASH_NVRTC_DEFINES of the compiling processes (a traced or A/B build).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCHED_SHAPES, precompile_parallel  # noqa: E402

GROUPS = ("fwd", "bwd", "fp8", "small", "ring", "sched", "fwdall", "variants", "variant_tests", "varlen_tests",
          "varlen_bench", "large")


def configs(which, cc: int) -> list:
    """The KernelConfigs of the named groups on compute capability ``cc`` (deduplicated)."""
    from cuflash import heuristics

    out = []
    if "bwd" in which:
        out += heuristics.all_bwd_configs(cc)
        if cc == 90:
            out += heuristics.all_sm90_bwd_configs()
    if "small" in which:
        out += heuristics.all_bwd_configs(86)
    if "fwd" in which:
        out += heuristics.all_fwd_configs(cc)
        if cc == 90:
            out += heuristics.all_sm90_fwd_configs()
    if "fp8" in which and cc == 90:
        from cuflash import fp8

        out += heuristics.all_fp8_fwd_configs() + fp8.aux_configs()
    if "ring" in which:
        from cuflash.distributed import partials

        out += partials.configs()
    if "sched" in which and cc == 90:
        out += sched_configs()
    if "fwdall" in which and cc == 90:
        for b in heuristics.SM90_FWD_BACKENDS:
            out += heuristics.all_sm90_fwd_configs(b)
    if "variants" in which:
        from cuflash.bench_variants import kernel_configs

        out += kernel_configs(cc)
    if "varlen_bench" in which:
        from cuflash import bench_varlen

        out += bench_varlen.kernel_configs(cc, bench_varlen.VARLEN_ROWS)
    if "large" in which:
        from cuflash import bench_shapes

        out += [c for c in heuristics.large_fwd_configs() if cc == 90 or c.dtype == "float32"]
        out += [c for causal in (False, True) for c in heuristics.bwd_configs("float32", 512, causal, cc).all()]
        if cc == 90:
            out += heuristics.all_large_bwd_configs() + bench_shapes.kernel_configs(cc)
    if "variant_tests" in which:
        from _common import add_tests_to_path

        add_tests_to_path()
        import test_variants

        out += test_variants.kernel_configs(cc)
    if "varlen_tests" in which:
        from _common import add_tests_to_path

        add_tests_to_path()
        import test_dv_fwd
        import test_varlen_bwd
        import test_varlen_fwd

        out += test_varlen_fwd.kernel_configs(cc) + test_varlen_bwd.kernel_configs(cc) + test_dv_fwd.kernel_configs(cc)
    return list({c.key(): c for c in out}.values())


def sched_configs() -> list:
    """The kernels of every forced Hopper forward schedule on SCHED_SHAPES, fp16 and bf16."""
    from cuflash import heuristics

    return [heuristics.fwd_config(dtype, d, causal, 90, backend=backend)
            for backend in heuristics.SM90_FWD_BACKENDS[1:] for dtype in ("float16", "bfloat16")
            for (_, _, _, _, _, d, causal) in SCHED_SHAPES]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("groups", nargs="*", choices=GROUPS, metavar="GROUP", help=" | ".join(GROUPS))
    ap.add_argument("-j", "--jobs", type=int, default=None, help="processes (default: every core)")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME[=V]",
                    help="an NVRTC define for every kernel (repeatable)")
    args = ap.parse_args(argv)
    from cuflash.dispatch import device_info

    cfgs = configs(args.groups or ["fwd", "bwd"], device_info(0)[0])
    env = {"CUFLASH_NVRTC_DEFINES": " ".join(f"-D{d}" for d in args.defines)} if args.defines else None
    t0 = time.time()
    failed = precompile_parallel(cfgs, args.jobs, env)
    print(f"precompiled {len(cfgs)} kernels in {time.time() - t0:.1f} s; {len(failed)} failed", flush=True)
    for f in failed:
        print("  ", f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
