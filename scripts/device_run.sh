#!/usr/bin/env bash
# One device call, by phase (each fits a 10-minute call on an H100):
#   tests : GPU tests on the default kernels, then on the portable ones (forced)
#   sanitize TOOL... : compute-sanitizer over small odd shapes, default and portable kernels
#   bench : the benchmark table (Markdown) and the deterministic-cost table
#   fp8 : the fp8 tests and scripts/bench_fp8.py
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cuflash-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q -e .
status=0
phase=$1; shift
if [ "$phase" = fp8 ]; then python3 scripts/precompile.py fp8 | tail -1; else python3 scripts/precompile.py fwd bwd fp8 | tail -1; fi
case $phase in
  tests)
    T="tests/test_fwd.py tests/test_bwd.py tests/test_determinism.py tests/test_api_errors.py tests/test_call_cache.py tests/test_fwd_sm90.py tests/test_sm90_primitives.py tests/test_fp8.py"
    python3 -m pytest -q -p no:cacheprovider $T 2>&1 | tee "$OUT/pytest.log" | tail -n 8 || status=1
    echo "== portable kernels forced (CUFLASH_FWD_BACKEND=sm80 CUFLASH_BWD_BACKEND=sm80)"
    CUFLASH_FWD_BACKEND=sm80 CUFLASH_BWD_BACKEND=sm80 python3 -m pytest -q -p no:cacheprovider \
      tests/test_fwd.py tests/test_bwd.py tests/test_determinism.py -k "not float32" 2>&1 | tee "$OUT/pytest-sm80.log" | tail -n 3 || status=1
    ;;
  sanitize)
    for tool in "$@"; do
      for backend in auto sm80; do
        CUFLASH_FWD_BACKEND=$backend CUFLASH_BWD_BACKEND=$backend compute-sanitizer --tool "$tool" --error-exitcode 9 \
          python3 scripts/sanitize.py > "$OUT/sanitize-$tool-$backend.log" 2>&1
        rc=$?
        echo "compute-sanitizer $tool ($backend kernels): rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool-$backend.log" | tail -1)"
        [ $rc -eq 0 ] || status=1
      done
    done
    ;;
  fp8)
    python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py 2>&1 | tee "$OUT/pytest-fp8.log" | tail -n 25 || status=1
    python3 scripts/bench_fp8.py "$@" 2>&1 | tee "$OUT/bench-fp8.md" || status=1
    ;;
  bench)
    python3 -m cuflash --markdown --json "$OUT/bench.json" --repeats 30 2>&1 | tee "$OUT/bench.log" | tail -n 60 || status=1
    python3 scripts/bench_deterministic.py 2>&1 | tee "$OUT/deterministic.md" || status=1
    ;;
esac
exit $status
