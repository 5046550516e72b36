"""Break the kernels on purpose and check that the tests catch it (docs/testing.md lists what catches what).

Each fault is a small edit of the kernel sources' text. For each fault this tool copies kernels_cu/ to a
scratch folder, applies the edit there (never to the checkout), points cuflash at the copy
($CUFLASH_KERNEL_DIR, Options.kernel_dir, part of the kernel cache key) and runs the named tests, each in
its own pytest process stopping at its first failure; then it prints a table: a fault is caught by a test
that fails under it. The tests must pass on the unbroken sources (``--baseline`` runs them once without a
fault first), and a test run in which no GPU test ran says nothing ("skipped").

    python3 dev/fault_injection.py                      # every fault, the default tests (GPU)
    python3 dev/fault_injection.py --fault scale_x1.01 --tests test_fwd test_fuzz
    python3 dev/fault_injection.py --list               # the faults and the tests
    python3 dev/fault_injection.py --check-compile      # CPU: the edits apply and compile for sm_80, sm_90a

Each fault's copy stays at the same place (``--workdir``, default /tmp/cuflash-faults/<fault>), so that
CuPy's kernel cache holds its compiled kernels from one test run to the next. The first run of a fault
compiles the kernels its tests take (cold: a minute or more each test file); split a long run with
``--fault``.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` in kernels_cu/``path``: exactly ``count`` occurrences must be there."""

    path: str
    old: str
    new: str
    count: int = 1


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    edits: tuple
    families: tuple = ()   # kernel families whose compile --check-compile tries (a "<kernel>" substring)


# The key range every family asks (common/block_range.cuh, through its mask policy): one tile fewer.
_DROP_TILE = Edit("common/block_range.cuh",
                  "        return n_max;\n",
                  "        return n_max > 1 ? n_max - 1 : n_max;   // FAULT: the last key tile is skipped\n")

# The forward's probabilities: the sm80 / sm90 online softmax (common/softmax.cuh) and the SIMT forward.
_SCALE_STEP = Edit("common/softmax.cuh",
                   "    __device__ __forceinline__ bool step(float (&s)[kMTiles][kNTiles][4], float scale_log2,\n"
                   "                                         float (&rescale)[kRows]) {\n",
                   "    __device__ __forceinline__ bool step(float (&s)[kMTiles][kNTiles][4], float scale_log2_,\n"
                   "                                         float (&rescale)[kRows]) {\n"
                   "        const float scale_log2 = scale_log2_ * 1.01f;   // FAULT: the scale 1% off\n")
_SCALE_RUNNING = Edit("common/softmax.cuh",
                      "    __device__ __forceinline__ bool probs_at_running_max(float (&s)[kMTiles][kNTiles][4], "
                      "float scale_log2,\n"
                      "                                                         float (&sums)[kRows]) const {\n",
                      "    __device__ __forceinline__ bool probs_at_running_max(float (&s)[kMTiles][kNTiles][4], "
                      "float scale_log2_,\n"
                      "                                                         float (&sums)[kRows]) const {\n"
                      "        const float scale_log2 = scale_log2_ * 1.01f;   // FAULT: the scale 1% off\n")
_SCALE_SIMT = Edit("simt/fwd.cu", "p.scale_log2", "(p.scale_log2 * 1.01f) /* FAULT */", count=2)

FAULTS = {f.name: f for f in (
    Fault("drop_key_tile", "every query tile skips its last key tile (BlockRange::n_block_max - 1), forward and "
          "backward", (_DROP_TILE,), ("fwd", "bwd")),
    Fault("scale_x1.01", "the forward's softmax scale multiplied by 1.01 (sm80, sm90 and SIMT forwards)",
          (_SCALE_STEP, _SCALE_RUNNING, _SCALE_SIMT), ("fwd",)),
    Fault("causal_diag_off_by_one", "the causal mask hides the diagonal (key j visible for j < i + Nk - Nq)",
          (Edit("common/block_range.cuh", "(!kIsCausal || col <= row + seqlen_k - seqlen_q)",
                "(!kIsCausal || col < row + seqlen_k - seqlen_q) /* FAULT */"),), ("fwd", "bwd")),
    Fault("window_left_off_by_one", "a window hides its leftmost key (key_lo one too far right), every family "
          "with a window (key_lo, and col_rows for the Hopper backward)",
          (Edit("common/mask.cuh", "        int lo = pos - left;\n", "        int lo = pos - left + 1;   // FAULT\n"),
           Edit("common/mask.cuh", "            hi = col - diag + left;\n",
                "            hi = col - diag + left - 1;   // FAULT\n")), ("fwd", "bwd")),
    Fault("softcap_derivative", "the backward's softcap derivative dropped (1 instead of 1 - tanh^2)",
          (Edit("common/mask.cuh", "            return fmaf(-t, t, 1.f);\n",
                "            return 1.f + 0.f * t;   // FAULT\n"),), ("bwd",)),
    Fault("bwd_prob_scale", "the backward recomputes P with the scale 1% off (every backward family)",
          (Edit("common/bwd_math.cuh", "return exp2f(fmaf(s, scale_log2, -lse2));",
                "return exp2f(fmaf(s, scale_log2 * 1.01f, -lse2));   // FAULT"),), ("bwd",)),
    # The large head dims' kernels (head_dims.py).
    Fault("split_rescale_dropped", "the Hopper split-V forward's second warpgroup ignores the rescale factors (its "
          "half of O keeps the old running max's scale)",
          (Edit("sm90/fwd_split.cuh",
                "        if (__any_sync(0xffffffff, r0 != 1.f || r1 != 1.f)) Split::template rescale_o<kCols>(acc_o, r0, r1);\n",
                "        (void)r0; (void)r1;   // FAULT: warpgroup 1 keeps O's old scale\n"),), ("fwd_split",)),
    Fault("split_bwd_delta_dropped", "the Hopper split backward forms dS = P dP (delta dropped)",
          (Edit("sm90/bwd_split.cu", "* (s[4 * j + e] - dl);", "* (s[4 * j + e] + 0.f * dl);   // FAULT"),),
          ("bwd_split",)),
    Fault("col_split_same_columns", "the portable forward's column split gives every warp O's first columns",
          (Edit("sm80/fwd.cu", "    const int col0 = Tile::kColSplit == 1 ? 0 : warp / Tile::kRowWarps * Tile::kNTilesO * 8;\n",
                "    const int col0 = 0;   // FAULT: every warp on the first columns\n"),), ("fwd_kernel",)),
)}


@dataclass(frozen=True)
class TestRun:
    """One pytest process: its arguments (run from the checkout's root) and environment."""

    name: str
    args: tuple
    env: dict = field(default_factory=dict)


TESTS = {t.name: t for t in (
    TestRun("test_fwd", ("tests/test_fwd.py",)),
    TestRun("test_bwd", ("tests/test_bwd.py",)),
    TestRun("test_fuzz", ("tests/test_fuzz.py", "-k", "random_valid"),
            {"CUFLASH_FUZZ_CASES": "150", "CUFLASH_FUZZ_SEED": "20261128"}),
    TestRun("test_keep_max", ("tests/test_fwd_keep_max.py",)),
    TestRun("test_interop", ("tests/test_interop.py", "-k", "equal_cupy or jax_arrays")),
    TestRun("test_torch", ("tests/test_torch.py", "-k", "against_sdpa")),
    TestRun("test_jax", ("tests/test_jax.py", "-k", "gpu")),
    TestRun("test_variants", ("tests/test_variants.py", "-k", "tuned or portable or float32")),
    TestRun("test_large", ("tests/test_large_head_dims.py", "-k", "dense or distributions or test_backward")),
)}
DEFAULT_TESTS = ("test_fwd", "test_bwd", "test_fuzz", "test_interop", "test_torch", "test_jax")


def patched_copy(fault: Fault | None, dest: Path, source: Path | None = None) -> Path:
    """A fresh copy of kernels_cu/ at ``dest`` with ``fault``'s edits (None: unchanged); ValueError naming the
    edit whose text is not found exactly ``count`` times (the sources changed: update the edit)."""
    from cuflash.compile import package_kernel_dir

    source = source or package_kernel_dir()
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    for edit in fault.edits if fault else ():
        path = dest / edit.path
        text = path.read_text()
        found = text.count(edit.old)
        if found != edit.count:
            raise ValueError(f"fault {fault.name}: kernels_cu/{edit.path} holds the text to replace {found} times, "
                             f"not {edit.count}:\n{edit.old}")
        path.write_text(text.replace(edit.old, edit.new))
    return dest


_COUNTS = re.compile(r"(\d+) (failed|passed|skipped|errors?|xfailed|xpassed)\b")


def run_test(test: TestRun, kernel_dir: Path | None, timeout: float, extra: list) -> dict:
    """Runs one TestRun with the kernels of ``kernel_dir`` (None: the package's); its counts and verdict."""
    env = dict(os.environ, **test.env)
    env.pop("CUFLASH_KERNEL_DIR", None)
    if kernel_dir is not None:
        env["CUFLASH_KERNEL_DIR"] = str(kernel_dir)
    # --require-gpu (tests/conftest.py): a run in which no GPU test ran is not a pass
    cmd = [sys.executable, "-m", "pytest", *test.args, "-x", "-q", "-p", "no:cacheprovider", "--require-gpu", *extra]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"verdict": "timeout", "seconds": time.time() - t0, "tail": ""}
    out = proc.stdout + proc.stderr
    counts = {}
    for n, what in _COUNTS.findall(out.strip().splitlines()[-1] if out.strip() else ""):
        counts["errors" if what.startswith("error") else what] = int(n)
    failed = counts.get("failed", 0) + counts.get("errors", 0)
    if proc.returncode == 1 and failed:
        verdict = "fails"
    elif proc.returncode == 0 and counts.get("passed", 0):
        verdict = "passes"
    elif proc.returncode in (1, 5) or "--require-gpu" in out:
        verdict = "skipped"   # no GPU test ran: no GPU, no torch / JAX on the GPU, or nothing selected
    else:
        verdict = f"error rc={proc.returncode}"
    first = next((line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
    return {"verdict": verdict, "counts": counts, "seconds": time.time() - t0, "first": first[:160],
            "tail": "\n".join(out.splitlines()[-30:])}


def _cell(result: dict, baseline: bool) -> str:
    v = result["verdict"]
    if baseline:
        return {"passes": "ok", "fails": "FAILS unbroken"}.get(v, v)
    return {"fails": "CAUGHT", "passes": "missed"}.get(v, v)


def print_table(rows: list, tests: list) -> None:
    """rows: (label, {test: result}) with the baseline (if any) first."""
    width = max([len("fault")] + [len(label) for label, _ in rows])
    cols = [max(len(t), 14) for t in tests]
    print("\n" + "  ".join([f"{'fault':<{width}}"] + [f"{t:<{w}}" for t, w in zip(tests, cols)]))
    print("  ".join(["-" * width] + ["-" * w for w in cols]))
    for label, results in rows:
        cells = [_cell(results[t], label == "(none: baseline)") if t in results else "-" for t in tests]
        print("  ".join([f"{label:<{width}}"] + [f"{c:<{w}}" for c, w in zip(cells, cols)]))
    missed = [(label, t) for label, results in rows if label != "(none: baseline)"
              for t in tests if results.get(t, {}).get("verdict") == "passes"]
    caught = {label for label, results in rows if any(r["verdict"] == "fails" for r in results.values())}
    faults = [label for label, _ in rows if label != "(none: baseline)"]
    print(f"\n{len(caught & set(faults))} of {len(faults)} faults caught by at least one test; "
          f"{len(missed)} (fault, test) pairs passed under a fault")


def check_compile(faults: list, workdir: Path, jobs: int) -> int:
    """CPU: each fault's edits apply, and one kernel of each touched family compiles (NVRTC, no GPU) for
    sm_80 (portable families) and sm_90a (Hopper families) from the patched copy."""
    from concurrent.futures import ProcessPoolExecutor

    from cuflash import heuristics, options
    from cuflash.compile import load_source

    large = heuristics.large_fwd_configs() + heuristics.all_large_bwd_configs()
    portable = heuristics.all_fwd_configs(80) + heuristics.all_bwd_configs(80) + \
        [c for c in large if not c.fam.arch_specific]
    hopper = heuristics.all_sm90_fwd_configs() + heuristics.all_sm90_bwd_configs() + \
        [c for c in large if c.fam.arch_specific]
    jobs_list = []
    for fault in faults:
        copy = patched_copy(fault, workdir / fault.name / "kernels_cu")
        with options.override(kernel_dir=str(copy)):
            patched = {c.source for c in portable + hopper if "FAULT" in load_source(c.source)}
        missing = [f for f in fault.families if not any(f in c.fam.kernel for c in portable + hopper
                                                         if c.source in patched)]
        if missing:
            print(f"{fault.name}: no {' / '.join(missing)} kernel source holds the edit")
            return 1
        for cc, configs in (("80", portable), ("90a", hopper)):
            one_per_family = {}
            for c in configs:
                if c.source in patched and any(part in c.fam.kernel for part in fault.families):
                    one_per_family.setdefault(c.family, c)
            jobs_list += [(fault.name, str(copy), c, cc) for c in one_per_family.values()]
    print(f"compiling {len(jobs_list)} kernels from the patched copies ({jobs} processes)", flush=True)
    failures = 0
    with ProcessPoolExecutor(jobs) as ex:
        for (name, _, cfg, cc), err in zip(jobs_list, ex.map(_compile_one, jobs_list)):
            print(f"  {name:<24} sm_{cc:<4} {cfg.family:<28} {'ok' if err is None else 'FAILED'}", flush=True)
            if err is not None:
                failures += 1
                print(err[:2000])
    print(f"{len(jobs_list) - failures} of {len(jobs_list)} compiled")
    return 1 if failures else 0


def _compile_one(job) -> str | None:
    name, copy, cfg, cc = job
    from cuflash import options
    from cuflash.compile import compile_offline, load_source

    with options.override(kernel_dir=copy):
        if "FAULT" not in load_source(cfg.source):
            return f"{name}: the patched text is not in {cfg.source}'s source"
        try:
            compile_offline(cfg, cc, verbose_ptxas=False)
        except Exception as e:  # noqa: BLE001 - reported with the others
            return f"{type(e).__name__}: {e}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fault", action="append", choices=sorted(FAULTS), metavar="NAME",
                    help=f"a fault to inject (repeatable; default: all of {', '.join(FAULTS)})")
    ap.add_argument("--tests", nargs="+", choices=sorted(TESTS), metavar="TEST",
                    help=f"the test runs (default: {' '.join(DEFAULT_TESTS)}; also: "
                         f"{' '.join(sorted(set(TESTS) - set(DEFAULT_TESTS)))})")
    ap.add_argument("--baseline", action="store_true", help="run the tests on the unbroken sources first")
    ap.add_argument("--timeout", type=float, default=480, help="seconds per test run (default: %(default)s)")
    ap.add_argument("--precompile", action="store_true",
                    help="compile every forward and backward kernel of each patched copy first, in parallel "
                         "(dev/precompile.py fwd bwd), instead of as the tests ask for them")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cuflash-faults"),
                    help="where the patched copies go (default: %(default)s)")
    ap.add_argument("--list", action="store_true", help="list the faults and the tests, and exit")
    ap.add_argument("--check-compile", action="store_true",
                    help="no GPU: apply each fault and compile one kernel of each family it touches for sm_80 "
                         "and sm_90a")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2,
                    help="processes for --check-compile (default: every core)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each run's last lines")
    args, extra = ap.parse_known_args(argv)   # anything else goes to pytest
    sys.path.insert(0, str(ROOT))
    faults = [FAULTS[n] for n in (args.fault or FAULTS)]
    tests = list(args.tests or DEFAULT_TESTS)
    if args.list:
        for f in FAULTS.values():
            print(f"{f.name:<24} {f.what}")
        print()
        for t in TESTS.values():
            env = " ".join(f"{k}={v}" for k, v in t.env.items())
            print(f"{t.name:<24} {(env + ' ') if env else ''}pytest {' '.join(t.args)}")
        return 0
    if args.check_compile:
        return check_compile(faults, args.workdir, args.jobs)
    rows = []
    plan = ([None] if args.baseline else []) + faults
    for fault in plan:
        label = fault.name if fault else "(none: baseline)"
        # the baseline compiles from the package's own sources (CuPy's kernel cache already holds them)
        copy = patched_copy(fault, args.workdir / fault.name / "kernels_cu") if fault else None
        results = {}
        if args.precompile:
            t0 = time.time()
            subprocess.run([sys.executable, str(ROOT / "dev" / "precompile.py"), "fwd", "bwd"], cwd=ROOT,
                           env=dict(os.environ, CUFLASH_KERNEL_DIR=str(copy or "")), check=False)
            print(f"{label:<24} precompiled in {time.time() - t0:.0f} s", flush=True)
        for name in tests:
            r = results[name] = run_test(TESTS[name], copy, args.timeout, extra)
            print(f"{label:<24} {name:<14} {_cell(r, fault is None):<16} {r['seconds']:6.0f} s  "
                  f"{r.get('counts', '')} {r.get('first', '')}", flush=True)
            if args.verbose or r["verdict"].startswith("error"):
                print(r["tail"])
        rows.append((label, results))
    print_table(rows, tests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
