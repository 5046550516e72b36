#!/usr/bin/env bash
# Backward checks on a GPU machine (one device session): install, precompile, diagnostics,
# the GPU tests in three parallel pytest processes next to compute-sanitizer; logs under $OUT.
#   STEPS="diag tests bench tune" SAN="memcheck racecheck" bash scripts/gpu_bwd_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuflash-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4 MKL_NUM_THREADS=4
STEPS=${STEPS:-"diag tests"}
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/pytest-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
python3 -c "import cupy, ml_dtypes, pytest; print('cupy', cupy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())"
timeout ${PRE_T:-120} python3 scripts/precompile.py bwd fwd small 2>&1 | tail -20
for s in $STEPS; do
  case $s in
  diag) timeout ${DIAG_T:-90} python3 scripts/bwd_diag.py errors parts 2>&1 | tee "$OUT/diag.txt" ;;
  bench) timeout ${BENCH_T:-90} python3 scripts/bwd_diag.py bench 2>&1 | tee "$OUT/bench.txt" ;;
  tune) timeout ${TUNE_T:-150} python3 scripts/tune_bwd.py 2>&1 | tee "$OUT/tune.txt" ;;
  tests)
    export CUFLASH_ERRLOG="$OUT/errs.txt"
    T=${TEST_T:-200}; P="python3 -m pytest -q -rf -p no:cacheprovider"
    timeout $T $P tests/test_bwd.py -k "seqlens or long or unequal" > "$OUT/t1.txt" 2>&1 &
    timeout $T $P tests/test_bwd.py -k "head_dims or deterministic_mode or gqa" > "$OUT/t2.txt" 2>&1 &
    timeout $T $P tests/test_bwd.py tests/test_determinism.py -k "not seqlens and not long and not unequal and not head_dims and not deterministic_mode and not gqa" > "$OUT/t3.txt" 2>&1 &
    for tool in ${SAN:-racecheck}; do
      timeout ${SAN_T:-150} compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize.py fwd,bwd > "$OUT/$tool.txt" 2>&1
      echo "== $tool rc=$?"; grep -m 12 -E "ERROR SUMMARY|Invalid|Race|Hazard|rror" "$OUT/$tool.txt"
    done
    wait
    for f in t1 t2 t3; do echo "== $f"; grep -E "passed|failed|FAILED|Error|error" "$OUT/$f.txt" | tail -n 40; done
    echo "== worst errors"; python3 - "$OUT/errs.txt" <<'PY'
import re, sys
rows = []
for line in open(sys.argv[1]):
    m = re.search(r"(float16|bfloat16|float32).*dq ([\d.e+-]+|inf) dk ([\d.e+-]+|inf) dv ([\d.e+-]+|inf)", line)
    if m:
        rows.append((m.group(1), max(float(x) for x in m.group(2, 3, 4)), line.strip()))
for dt in ("float16", "bfloat16", "float32"):
    r = sorted([x for x in rows if x[0] == dt], key=lambda x: -x[1])
    print(dt, len(r), "cases; worst:"); [print("  ", x[2]) for x in r[:4]]
PY
    grep -E "^(fd|memory|determinism)" "$OUT/errs.txt" | head -30 ;;
  esac
done
