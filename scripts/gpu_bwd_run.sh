#!/usr/bin/env bash
# Backward checks on a GPU machine (one device session): install, precompile, diagnostics,
# the GPU tests in three parallel pytest processes, compute-sanitizer; everything under $OUT.
#   STEPS="diag tests memcheck racecheck bench" bash scripts/gpu_bwd_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuflash-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4 MKL_NUM_THREADS=4
STEPS=${STEPS:-"diag tests memcheck"}
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/pytest-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
python3 -c "import cupy, ml_dtypes, pytest; print('cupy', cupy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())"
timeout ${PRE_T:-150} python3 scripts/precompile.py bwd fwd 2>&1 | tail -20
for s in $STEPS; do
  case $s in
  diag) timeout ${DIAG_T:-120} python3 scripts/bwd_diag.py errors parts 2>&1 | tee "$OUT/diag.txt" ;;
  bench) timeout ${BENCH_T:-120} python3 scripts/bwd_diag.py bench 2>&1 | tee "$OUT/bench.txt" ;;
  tests)
    export CUFLASH_ERRLOG="$OUT/errs.txt"
    T=${TEST_T:-240}
    timeout $T python3 -m pytest -q -rf -p no:cacheprovider tests/test_bwd.py -k "seqlens or long or unequal" > "$OUT/t1.txt" 2>&1 &
    timeout $T python3 -m pytest -q -rf -p no:cacheprovider tests/test_bwd.py -k "head_dims or deterministic_mode or gqa" > "$OUT/t2.txt" 2>&1 &
    timeout $T python3 -m pytest -q -rf -p no:cacheprovider tests/test_bwd.py tests/test_determinism.py -k "not seqlens and not long and not unequal and not head_dims and not deterministic_mode and not gqa" > "$OUT/t3.txt" 2>&1 &
    wait
    for f in t1 t2 t3; do echo "== $f"; tail -n 25 "$OUT/$f.txt"; done ;;
  memcheck|racecheck)
    timeout ${SAN_T:-120} compute-sanitizer --tool $s --error-exitcode 9 python3 scripts/sanitize.py fwd,bwd > "$OUT/$s.txt" 2>&1
    echo "== $s rc=$?"; grep -m 20 -E "ERROR SUMMARY|Invalid|Race|Hazard|error" "$OUT/$s.txt" | head -20 ;;
  esac
done
