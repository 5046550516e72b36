#!/usr/bin/env bash
# Device session 2026-11-26: GPU tests of the kept-max forward, its diagnostics, then the A/B on distributions.
#   bash scripts/dev_keep_max.sh [tests] [diag] [ab]      (carry .ab_old: the previous commit's kernels_cu)
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 scripts/precompile.py fwd | tail -1
for phase in "$@"; do case $phase in
  tests)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fwd_keep_max.py 2>&1 | tail -n 8
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fwd_sm90.py -k "growing or other_head_dims or main_head_dims" 2>&1 | tail -n 4 ;;
  diag)
    timeout 150 python3 scripts/keep_max_diag.py 2>&1 | tail -n 50 ;;
  ab)
    AB_ROUNDS=${AB_ROUNDS:-3} AB_DISTS=${AB_DISTS:-normal,outlier8,outlier12,sharp,sink} \
    AB_SHAPES=${AB_SHAPES:-"4,16,4096,128,bfloat16,0;4,16,4096,128,bfloat16,1;4,16,4096,64,float16,0;4,16,4096,256,bfloat16,0;4,16,4096,256,bfloat16,1"} \
      timeout 330 python3 scripts/ab_defines.py fwd "src=.ab_old/kernels_cu" "" "-DCUFLASH_SM90_FWD_KEEP_MAX=0" 2>&1 | tail -n 30 ;;
esac; done
