"""Fill CuPy's on-disk kernel cache with many processes, so that a test run finds every
kernel compiled: python scripts/precompile.py [bwd] [fwd] [-j N]."""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _configs(which):
    from cuflash import heuristics
    from cuflash.dispatch import device_info

    cc, _ = device_info(0)
    out = []
    if "bwd" in which:
        out += heuristics.all_bwd_configs(cc)
    if "fwd" in which:
        out += heuristics.all_fwd_configs(cc)
    return out


def _compile(cfgs):
    from cuflash.dispatch import get_kernel

    failed = []
    for cfg in cfgs:
        try:
            get_kernel(cfg, 0)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{cfg.key()}: {type(e).__name__}: {str(e)[:500]}")
    return failed


def main() -> int:
    args = sys.argv[1:]
    jobs = os.cpu_count() or 4
    if "-j" in args:
        jobs = int(args[args.index("-j") + 1])
    which = [a for a in args if a in ("bwd", "fwd")] or ["bwd", "fwd"]
    cfgs = _configs(which)
    t0 = time.time()
    chunks = [cfgs[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs) as ex:
        failed = [f for part in ex.map(_compile, chunks) for f in part]
    print(f"precompiled {len(cfgs)} kernels with {jobs} processes in {time.time() - t0:.1f} s; "
          f"{len(failed)} failed", flush=True)
    for f in failed:
        print("  ", f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
