"""Fill CuPy's on-disk kernel cache with many processes, so that a test run finds every
kernel compiled: python scripts/precompile.py [bwd] [fwd] [fp8] [small] [ring] [sched] [fwdall] [-j N]."""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def configs(which, cc: int):
    from cuflash import heuristics

    out = []
    if "bwd" in which:
        out += heuristics.all_bwd_configs(cc)
        if cc == 90:
            out += heuristics.all_sm90_bwd_configs()
    if "small" in which:  # the tiles for ~99 KB devices, to run them on a large one
        out += heuristics.all_bwd_configs(86)
    if "fwd" in which:
        out += heuristics.all_fwd_configs(cc)
        if cc == 90:  # the Hopper kernels the dispatcher picks by default there
            out += heuristics.all_sm90_fwd_configs()
    if "fp8" in which and cc == 90:  # the fp8 forward and its helpers
        from cuflash import fp8

        out += heuristics.all_fp8_fwd_configs() + fp8.aux_configs()
    if "ring" in which:  # the ring attention's merge helpers
        from cuflash.distributed import partials

        out += partials.configs()
    if "sched" in which and cc == 90:  # the forced sm90 schedules of scripts/sanitize.py
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from sanitize import sched_configs

        out += sched_configs()
    if "fwdall" in which and cc == 90:  # every forced sm90 schedule (tests/test_fwd_sm90.py)
        for b in heuristics.SM90_FWD_BACKENDS:
            out += heuristics.all_sm90_fwd_configs(b)
    return list({c.key(): c for c in out}.values())


def _compile(cfgs):
    from cuflash.dispatch import get_kernel

    failed = []
    for cfg in cfgs:
        try:
            get_kernel(cfg, 0)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{cfg.key()}: {type(e).__name__}: {str(e)[:500]}")
    return failed


def precompile_parallel(cfgs, jobs: int | None = None) -> list[str]:
    """Compile ``cfgs`` in ``jobs`` fresh (spawned) processes; returns the failures."""
    jobs = jobs or os.cpu_count() or 4
    chunks = [cfgs[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        return [f for part in ex.map(_compile, chunks) for f in part]


def main() -> int:
    from cuflash.dispatch import device_info

    args = sys.argv[1:]
    jobs = int(args[args.index("-j") + 1]) if "-j" in args else None
    which = [a for a in args if a in ("bwd", "fwd", "fwdall", "small", "fp8", "ring", "sched")] or ["bwd", "fwd"]
    cfgs = configs(which, device_info(0)[0])
    t0 = time.time()
    failed = precompile_parallel(cfgs, jobs)
    print(f"precompiled {len(cfgs)} kernels in {time.time() - t0:.1f} s; {len(failed)} failed", flush=True)
    for f in failed:
        print("  ", f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
