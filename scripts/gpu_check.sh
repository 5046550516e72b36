#!/usr/bin/env bash
# On a GPU machine: every phase of scripts/device_run.sh in one go (GPU tests on the default and,
# forced, the portable kernels; the fuzz and concurrency tests; JAX; ring attention (multi-GPU parts
# where several GPUs are visible); compute-sanitizer with four tools; the benchmark table).
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
bash scripts/device_run.sh tests || status=1
bash scripts/device_run.sh tests80 || status=1
bash scripts/device_run.sh fuzz || status=1
bash scripts/device_run.sh jax || status=1
bash scripts/device_run.sh ring || status=1
bash scripts/device_run.sh sanitize memcheck racecheck initcheck synccheck || status=1
bash scripts/device_run.sh bench || status=1
exit $status
