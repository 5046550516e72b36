#!/usr/bin/env bash
# On a GPU machine: every phase of scripts/device_run.sh in one go (GPU tests on the default and,
# forced, the portable kernels; compute-sanitizer with four tools; the benchmark table).
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
bash scripts/device_run.sh tests || status=1
bash scripts/device_run.sh sanitize memcheck racecheck initcheck synccheck || status=1
bash scripts/device_run.sh bench || status=1
exit $status
