#!/usr/bin/env bash
# On a GPU machine: install cuflash, run the GPU tests, compute-sanitizer, then the benchmark table.
#   bash scripts/gpu_check.sh            # everything
#   PYTEST_ARGS="-k fwd" SANITIZE=0 BENCH=quick bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuflash-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0

if ! python3 -c "import cuflash" 2>/dev/null; then
  # offline-friendly: the GPU image already has CuPy and the build backend
  python3 -m pip install -q --no-deps --no-build-isolation -e . || python3 -m pip install -q -e ".[cuda12,test]"
fi

echo "== pytest"
python3 -m pytest -q -ra ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -n 60
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# On Hopper the dispatcher picks the sm90 kernels; run the forward/backward suites again
# on the portable (mma.sync) kernels so both families are exercised on this GPU.
if [ "${BOTH_FAMILIES:-1}" = "1" ] && python3 -c "import cupy,sys; sys.exit(cupy.cuda.Device().compute_capability != '90')"; then
  echo "== pytest (portable kernels forced: CUFLASH_FWD_BACKEND=sm80 CUFLASH_BWD_BACKEND=sm80)"
  CUFLASH_FWD_BACKEND=sm80 CUFLASH_BWD_BACKEND=sm80 python3 -m pytest -q tests/test_fwd.py tests/test_bwd.py \
    -k "not float32" 2>&1 | tee "$OUT/pytest-sm80.log" | tail -n 5
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ "${SANITIZE:-1}" = "1" ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck initcheck synccheck; do
    echo "== compute-sanitizer --tool $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 9 python3 scripts/sanitize.py "${SANITIZE_WHAT:-fwd,bwd}" \
      > "$OUT/sanitize-$tool.log" 2>&1
    rc=$?
    tail -n 3 "$OUT/sanitize-$tool.log"
    [ $rc -eq 0 ] || { echo "compute-sanitizer $tool FAILED (rc=$rc)"; status=1; }
  done
fi

case "${BENCH:-full}" in
  none) ;;
  quick) python3 -m cuflash --quick --json "$OUT/bench.json" || status=1 ;;
  *) python3 -m cuflash --json "$OUT/bench.json" || status=1 ;;
esac
exit $status
