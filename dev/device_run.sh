#!/usr/bin/env bash
# One device call, by phase (each fits a 10-minute call on an H100):
#   tests : GPU tests on the default kernels, PyTorch and DLPack included (FA4 parked too when .fa4a is carried)
#   tests80 : the forward, backward and determinism tests on the portable kernels (forced)
#   tables80 [PLAN_CC...] : the portable kernels' forward, backward, variant, varlen and programmable GPU tests under
#              the A100's and the 99 KB cards' tables (CUFLASH_PLAN_CC, default 80 86), in 14 processes where .whl/
#              carries pytest-xdist and execnet
#   fa2 [ARGS...] : issue #46's rows, forward+backward and forward, under CUFLASH_PLAN_CC=80 and 86 beside
#              FlashAttention-2 (SDPA's flash backend), interleaved (dev/ab.py run; ARGS to it, e.g. --dist sharp)
#   sanitize TOOL... : compute-sanitizer over small odd shapes, default and portable kernels
#   bench : the benchmark table (Markdown) and the deterministic-cost table (dev/bench.py deterministic)
#   fp8 [SPEC...] : the fp8 tests and dev/bench.py fp8 SPEC...
#   fuzz : threads, streams, devices and CUDA graphs (tests/test_concurrency.py), then 1000 random valid
#          configurations against float64 (tests/test_fuzz.py; CUFLASH_FUZZ_SEED repeats a run)
#   jax : cuflash.jax (tests/test_jax.py): the XLA FFI custom calls against jax.nn.dot_product_attention, CPU and GPU
#   ring [ARGS...] : ring attention (cuflash.distributed): local-ring tests on GPU 0; with 2+ GPUs the NCCL check
#              at N=32k for each ring size and the N=128k speed-up (ARGS to python -m cuflash.distributed.bench)
#   fa4setup : install FlashAttention-4 into $FA4_SITE from the wheels of ../shared/tools/fa4_wheels.sh
#              (../shared/notes/fa4-on-device.md): a call carrying .fa4a parks its part in /root/fa4, the
#              next call (machine still warm) carrying .fa4b joins and installs
#   ncu SHAPE PASS [DIST] : Nsight Compute sections of the main kernel of PASS (fwd|bwd) on SHAPE
#              (B,H,N,D,dtype[,causal], or row:NAME for a row of the variant table) for cuflash, then FA4 where $FA4_SITE exists (dev/profiling.py launch),
#              then FA2 (SDPA flash) with NCU_FLASH=1;
#              NCU_SOURCE=1 adds warp-stall samples per SASS instruction (ncu-src-*.csv); NCU_CLOCK=base
#              locks the clock at base (cycles comparable across inputs and kernels; default: none)
#   dists [ARGS...] : the score-distribution table (python -m cuflash --dists; FA4 column if $FA4_SITE
#              exists, installed first from .fa4b if that was carried), extra ARGS to python -m cuflash
#   variants [ARGS...] : the attention-variant table (python -m cuflash --variants --markdown: issue #41's rows,
#              cuflash/bench_variants.py) beside plain cuflash, SDPA cuDNN (plain call), FlashAttention-4 (if
#              $FA4_SITE exists, installed first from .fa4b if that was carried: fa4setup's two calls) and cuDNN
#              through cudnn-frontend (its wheel carried in .cudnnfe/: bash dev/cudnnfe_wheel.sh here first; installed
#              into $CUDNNFE_SITE). Extra ARGS to python -m cuflash, e.g. --rows window8k,window16k,alibi --dists normal
#              (FA4 compiles each row's kernels on first use: split the eight rows over two calls)
#   varlen [setup] [ARGS...] : the varlen table (python -m cuflash --varlen --markdown: issue #43's bar,
#              cuflash/bench_varlen.py): forward_varlen / backward_varlen on 64 sequences of 128-8192 tokens beside the
#              dense API at the mean length, FlashAttention-4's varlen path and cuDNN's ragged layout (cudnn-frontend),
#              FA4 and cudnn-frontend installed as for variants. .fa4b and .cudnnfe together pass the 64 MiB a call may
#              carry, so two calls back to back (the machine stays warm 30 s): first `varlen setup` carrying .fa4a and
#              .cudnnfe (parks FA4's part, installs cudnn-frontend, precompiles, runs nothing), then `varlen` carrying
#              .fa4b. Extra ARGS to python -m cuflash, e.g. --varlen-dists normal --repeats 5, or a quick batch
#              --varlen-shape B=8,lens=128:1024. The header's commit reads "unknown" there (the copy has no .git):
#              name it by hand. Not part of all
#   large [setup] [ARGS...] : head dims above 256 (issue #43): tests/test_large_head_dims.py
#              and the forced split-V forward in tests/test_fwd_sm90.py, then the head-dim table (python -m cuflash
#              --head-dims --markdown: (192, 128), 512, (576, 512) beside cuDNN through cudnn-frontend and FA4),
#              FA4 and cudnn-frontend installed as for varlen (two calls: `large setup` carrying .fa4a and .cudnnfe,
#              then `large` carrying .fa4b); extra ARGS to python -m cuflash. Not part of all
#   decode [setup] [ARGS...] : issue #44: the KV-cache tests (tests/test_kvcache.py, the JAX and torch wrappers', the
#              decode table's), then the decode table (python -m cuflash --decode --markdown: batch 1 / 8 / 64, caches of
#              4k / 32k / 128k, contiguous and paged 64, beside SDPA, FlashInfer and FA4 where they import); FA4 as
#              for varlen (`decode setup` carrying .fa4a, then `decode` carrying .fa4b); extra ARGS to python -m cuflash,
#              e.g. --decode-rows 'b8-*' --decode-dists normal. Not part of all
#   decode-ab [ROWS] : issue #44's decode kernels side by side: the KV-cache tests (every fixture: the portable
#              kernel, the Hopper cp.async and TMA rings), then dev/decode_ab.py A/B rows (default
#              b1-4k-*,b1-32k-*,b1-128k-*,b8-4k-*,b8-32k-*,b64-32k-*) of the TMA ring against its switches under
#              measurement (CUFLASH_DECODE_PDL=1, -DCUFLASH_DECODE_TMA_STAGES=4 / 5). Not part of all
#   prog [ARGS...] : issue #45's programmable attention: its GPU tests on both families (the forward and
#              backward against the float64 reference: bias, dropout, block masks, modifiers; cuflash.torch.attention),
#              then any pytest ARGS (e.g. -k bias); in eight processes where .whl/ carries pytest-xdist and execnet.
#              Not part of all
#   progbench [ARGS...] : issue #45's table (python -m cuflash --programmable --markdown: dropout, bias, keypad,
#              sparse50, relpos, docmask beside plain cuflash, cuDNN through cudnn-frontend, FA4, FlexAttention),
#              FA4 and cudnn-frontend installed as for variants; ARGS to python -m cuflash, e.g. --rows dropout,bias
#              (each row compiles NVRTC, FA4 and FlexAttention kernels on first use: two rows a call). Not part of all
#   all : every phase but fa4setup, ncu, fp8, dists and variants in one go (GPU tests on the default and the forced
#         portable kernels, fuzz, JAX, ring, compute-sanitizer with four tools, the benchmark table)
# Outputs go to $OUT (default /tmp/cuflash-out); FA4 is installed in $FA4_SITE (default /tmp/fa4site);
# scratch files in ${TMPDIR:-/tmp}.
set -uo pipefail
cd "$(dirname "$0")/.."
HERE=dev
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cuflash-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q -e .
status=0
phase=$1; shift

FA4_SITE=${FA4_SITE:-/tmp/fa4site}
TMP=${TMPDIR:-/tmp}
fa4_setup() {  # the note's steps 2 and 3, whichever the carried folders allow
  if [ -f .fa4a/cu13part00 ]; then
    mkdir -p /root/fa4 && cp .fa4a/cu13part00 /root/fa4/ && echo "fa4setup: parked .fa4a/cu13part00 in /root/fa4"
  fi
  [ -d .fa4b ] || { echo "fa4setup: no .fa4b here (carry it on the next call)"; return 0; }
  [ -f /root/fa4/cu13part00 ] || { echo "fa4setup: /root/fa4/cu13part00 missing: first a call carrying .fa4a"; return 1; }
  local w=$TMP/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  cat /root/fa4/cu13part00 .fa4b/cu13part01 > $w || return 1
  # the libs_core wheel overlaps the others' files: installed apart, then copied without overwriting
  python3 -m pip install -q --no-index --no-deps --no-compile --target $FA4_SITE $w $(ls .fa4b/*.whl | grep -v libs_core) || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target $TMP/fa4site2 .fa4b/nvidia_cutlass_dsl_libs_core*.whl || return 1
  cp -rn $TMP/fa4site2/* $FA4_SITE/ && echo "fa4setup: FlashAttention-4 installed in $FA4_SITE"
}
fa4_env() {  # the DSL's own cutlass package must come before the site itself
  if [ -d $FA4_SITE ]; then export CUFLASH_FA4_PATH=$FA4_SITE/nvidia_cutlass_dsl/dsl_packages:$FA4_SITE; fi
}
xdist_args() {  # "-n N" where pytest-xdist and execnet are carried in .whl/ (pip download pytest-xdist execnet)
  ls .whl/pytest_xdist-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps --no-index .whl/execnet-*.whl \
    .whl/pytest_xdist-*.whl >/dev/null 2>&1 && echo "-n $1"
}
CUDNNFE_SITE=${CUDNNFE_SITE:-/tmp/cudnnfe-site}
cudnnfe_env() {  # cudnn-frontend (the Python package "cudnn") from the wheel carried in .cudnnfe/, on PYTHONPATH
  if [ ! -d $CUDNNFE_SITE ] && ls .cudnnfe/nvidia_cudnn_frontend-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target $CUDNNFE_SITE .cudnnfe/nvidia_cudnn_frontend-*.whl \
      || { echo "cudnn-frontend: install from .cudnnfe/ failed"; return 1; }
  fi
  if [ -d $CUDNNFE_SITE ]; then
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$CUDNNFE_SITE
    python3 -c "import cudnn; print('cudnn-frontend', cudnn.__version__, 'cuDNN', cudnn.backend_version())" \
      || echo "cudnn-frontend: installed in $CUDNNFE_SITE but does not import (the cudnn column will say n/a)"
  else
    echo "cudnn-frontend: not installed (carry .cudnnfe/ from bash dev/cudnnfe_wheel.sh): the cudnn column will say n/a"
  fi
}

case $phase in
  fa4setup|ncu) ;;  # nothing of cuflash's to compile (ncu: the script compiles what it runs)
  all) ;;  # each phase below compiles its own
  fp8) python3 $HERE/precompile.py fp8 | tail -1 ;;
  ring) python3 $HERE/precompile.py fwd bwd ring | tail -1 ;;
  jax) python3 $HERE/precompile.py fwd bwd | tail -1 ;;
  fuzz) ;;  # the fuzz compiles the kernels its cases take, on every core (a full precompile takes longer)
  variants) python3 $HERE/precompile.py fwd bwd variants | tail -n 12 ;;  # a variant kernel that fails is named here
  varlen) python3 $HERE/precompile.py fwd bwd varlen_bench | tail -n 12 ;;  # a kernel that fails is named here
  large) python3 $HERE/precompile.py large | tail -n 12 ;;
  decode|decode-ab|prog|progbench|tables80|fa2) ;;  # the tests and rows compile the few kernels they take
  *) python3 $HERE/precompile.py fwd bwd fp8 | tail -1 ;;
esac
case $phase in
  fa4setup)
    fa4_setup || status=1
    ;;
  dists)
    if [ -d .fa4b ] && [ ! -d $FA4_SITE ]; then fa4_setup || status=1; fi
    fa4_env
    # 12 shapes x 6 distributions x (fwd, fwd+bwd), 3 warm-ups and 15 interleaved repeats: about 12 minutes
    # on an H100 with FA4, so run it in two calls of six shapes each (--shape B,H,N,D,dtype[,causal] ...)
    python3 -m cuflash --dists --markdown --json "$OUT/dists.json" --repeats 15 --warmup 3 "$@" 2>&1 \
      | tee "$OUT/dists.log" | tail -n 130 || status=1
    ;;
  variants)
    if [ -d .fa4b ] && [ ! -d $FA4_SITE ]; then fa4_setup || status=1; fi
    fa4_env
    cudnnfe_env || status=1
    # exit status 1 if cuflash failed a call or a peer's output differs from cuflash's (the FAILED lines at the end)
    python3 -m cuflash --variants --markdown --json "$OUT/variants.json" --repeats 20 --warmup 3 "$@" 2>&1 \
      | tee "$OUT/variants.log" | tail -n 160 || status=1
    ;;
  varlen)
    # FA4: park .fa4a's part (setup call) or join and install with .fa4b (run call); cudnn-frontend from .cudnnfe
    if [ -f .fa4a/cu13part00 ] || { [ -d .fa4b ] && [ ! -d $FA4_SITE ]; }; then fa4_setup || status=1; fi
    fa4_env
    cudnnfe_env || status=1
    if [ "${1:-}" = setup ]; then
      echo "varlen setup: done; now \`bash dev/device_run.sh varlen\` carrying .fa4b, while this machine is warm"
      exit $status
    fi
    # exit status 1 if cuflash failed a call or an output differs from cuflash varlen's (the FAILED lines at the end)
    python3 -m cuflash --varlen --markdown --json "$OUT/varlen.json" "$@" 2>&1 \
      | tee "$OUT/varlen.log" | tail -n 120 || status=1
    ;;
  large)
    # FA4 and cudnn-frontend as for varlen: `large setup` carrying .fa4a and .cudnnfe first, then `large` carrying .fa4b
    if [ -f .fa4a/cu13part00 ] || { [ -d .fa4b ] && [ ! -d $FA4_SITE ]; }; then fa4_setup || status=1; fi
    fa4_env
    cudnnfe_env || status=1
    if [ "${1:-}" = setup ]; then
      echo "large setup: done; now \`bash dev/device_run.sh large\` carrying .fa4b, while this machine is warm"
      exit $status
    fi
    python3 -m pytest -q -x tests/test_large_head_dims.py 2>&1 | tee "$OUT/large-tests.log" | tail -n 30 || status=1
    python3 -m pytest -q tests/test_fwd_sm90.py -k sm90_split 2>&1 | tail -n 5 || status=1
    python3 -m cuflash --head-dims --markdown --json "$OUT/head-dims.json" "$@" 2>&1 \
      | tee "$OUT/head-dims.log" | tail -n 60 || status=1
    ;;
  prog)
    # eight processes compile and run at once where .whl/ carries pytest-xdist
    xdist=($(xdist_args 8))
    # (JAX takes 75 % of the GPU's memory per process unless told not to: eight processes share one GPU)
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 540 python3 -m pytest -q -p no:cacheprovider \
      --require-gpu "${xdist[@]}" \
      tests/test_programmable.py tests/test_programmable_host.py tests/test_torch_programmable.py \
      tests/test_jax_programmable.py tests/test_programmable_varlen.py tests/test_jax_varlen_programmable.py "$@" 2>&1 \
      | tee "$OUT/prog-tests.log" | grep -av "arn" | tail -n 40 || status=1
    ;;
  progbench)
    if [ -d .fa4b ] && [ ! -d $FA4_SITE ]; then fa4_setup || status=1; fi
    fa4_env
    cudnnfe_env || status=1
    timeout 560 python3 -m cuflash --programmable --markdown --json "$OUT/programmable.json" "$@" 2>&1 \
      | tee "$OUT/programmable.log" | tail -n 80 || status=1
    ;;
  decode-ab)
    rows=${1:-'b1-4k-*,b1-32k-*,b1-128k-*,b8-4k-*,b8-32k-*,b64-32k-*'}
    timeout 420 python3 -m pytest -q -p no:cacheprovider --require-gpu tests/test_kvcache.py 2>&1 \
      | tee "$OUT/decode-ab-tests.log" | grep -av "arn" | tail -n 25 || status=1
    # the decode kernels side by side (extra variants after the rows: dev/decode_ab.py's tokens)
    shift || true
    timeout 300 python3 $HERE/decode_ab.py --rows "$rows" --repeats 8 --warmup 1 -- \
      "@CUFLASH_DECODE_BACKEND=sm80" "@CUFLASH_DECODE_BACKEND=sm90" "@CUFLASH_DECODE_BACKEND=sm90_tma" "$@" 2>&1 \
      | tee "$OUT/decode-ab.log" | tail -n 12
    ;;
  decode)
    # FA4 as for varlen (`decode setup` carrying .fa4a, then `decode` carrying .fa4b), for its paged decode column
    if [ -f .fa4a/cu13part00 ] || { [ -d .fa4b ] && [ ! -d $FA4_SITE ]; }; then fa4_setup || status=1; fi
    fa4_env
    if [ "${1:-}" = setup ]; then
      echo "decode setup: done; now \`bash dev/device_run.sh decode\` carrying .fa4b, while this machine is warm"
      exit $status
    fi
    python3 -m pytest -q -p no:cacheprovider --require-gpu tests/test_kvcache.py tests/test_jax_kvcache.py \
      tests/test_bench_decode.py tests/test_torch.py -k "kvcache or decode or KvCache" 2>&1 \
      | tee "$OUT/decode-tests.log" | tail -n 12 || status=1
    python3 -m cuflash --decode --markdown --json "$OUT/decode.json" "$@" 2>&1 \
      | tee "$OUT/decode.log" | tail -n 60 || status=1
    ;;
  tests)
    [ -f .fa4a/cu13part00 ] && fa4_setup
    T="tests/test_distributed.py tests/test_fwd_keep_max.py tests/test_distributions.py tests/test_fwd.py tests/test_bwd.py tests/test_determinism.py tests/test_api_errors.py tests/test_call_cache.py tests/test_fwd_sm90.py tests/test_sm90_primitives.py tests/test_fp8.py"
    T="$T tests/test_torch.py tests/test_interop.py"   # skip where PyTorch is missing
    python3 -m pytest -q -p no:cacheprovider --require-gpu $T 2>&1 | tee "$OUT/pytest.log" | tail -n 12 || status=1
    ;;
  tables80)
    xdist=($(xdist_args 14))
    for cc in ${@:-80 86}; do
      echo "== CUFLASH_PLAN_CC=$cc"
      CUFLASH_PLAN_CC=$cc timeout 280 python3 -m pytest -q -p no:cacheprovider --require-gpu "${xdist[@]}" --maxfail=5 \
        tests/test_fwd.py tests/test_bwd.py tests/test_determinism.py tests/test_variants.py tests/test_varlen_fwd.py \
        tests/test_varlen_bwd.py tests/test_programmable.py -k "not float32" 2>&1 | tee "$OUT/pytest-plan$cc.log" \
        | grep -av "arn" | tail -n 4 || status=1
    done
    ;;
  fa2)
    rows="--shape 4,16,4096,64,float16,0 --shape 4,16,4096,64,float16,1 --shape 4,16,4096,128,bfloat16,0"
    rows="$rows --shape 4,16,4096,128,bfloat16,1 --shape 4,16,4096,256,bfloat16,0 --shape 16,16,1024,64,float16,0"
    for pas in fwd+bwd fwd; do
      echo "== $pas"
      PYTHONPATH=$PWD timeout 280 python3 $HERE/ab.py run $pas "@CUFLASH_PLAN_CC=80" "@CUFLASH_PLAN_CC=86" flash \
        --precompile --rounds 5 $rows "$@" 2>&1 | grep -av "arn" | tee -a "$OUT/fa2.log" || status=1
    done
    ;;
  tests80)
    echo "== portable kernels forced (CUFLASH_FWD_BACKEND=sm80 CUFLASH_BWD_BACKEND=sm80)"
    CUFLASH_FWD_BACKEND=sm80 CUFLASH_BWD_BACKEND=sm80 python3 -m pytest -q -p no:cacheprovider --require-gpu \
      tests/test_fwd.py tests/test_bwd.py tests/test_determinism.py -k "not float32" 2>&1 | tee "$OUT/pytest-sm80.log" | tail -n 3 || status=1
    ;;
  sanitize)
    # compiled first without the tool (in parallel, into CuPy's disk cache): under it only the kernels run.
    # The default kernels with every forced Hopper forward schedule and the ring helpers, then the portable ones.
    python3 $HERE/precompile.py ring sched -j 16 2>&1 | tail -n 1
    # initcheck does not see bulk-async (TMA) stores: reads of the persistent forward's O and of the
    # backward's dQ slices (bulk store / bulk reduce) are reported as uninitialised although the tests find
    # every value right. So its gated run is the forward alone, and the "-tma" run reports the backward's,
    # ungated (the expected readers: the backward's pre- and postprocess).
    for tool in "$@"; do
      for run in auto sm80 $( [ "$tool" = initcheck ] && echo auto-tma ); do
        backend=${run%%-*}; env=(); which=fwd,bwd,sched,ring; [ $backend = sm80 ] && which=fwd,bwd
        case $run in
          auto) [ "$tool" = initcheck ] && which=fwd,sched ;;
          auto-tma) which=bwd,ring ;;
        esac
        t0=$(date +%s)
        env CUFLASH_FWD_BACKEND=$backend CUFLASH_BWD_BACKEND=$backend "${env[@]}" timeout 200 compute-sanitizer \
          --tool "$tool" --error-exitcode 9 --show-backtrace no --print-limit 1000 \
          python3 $HERE/profiling.py sanitize $which > "$OUT/sanitize-$tool-$run.log" 2>&1
        rc=$?
        echo "compute-sanitizer $tool ($run kernels, $which): rc=$rc in $(( $(date +%s) - t0 )) s" \
          "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool-$run.log" | tail -1)"
        if [ $run = auto-tma ]; then   # which kernels read what (expected: the backward's pre- and postprocess)
          grep -E "^=========     at" "$OUT/sanitize-$tool-$run.log" | sed 's/+0x.*//; s/^=* *at //' | sort | uniq -c
        elif [ $rc -ne 0 ]; then status=1; fi
      done
    done
    ;;
  fuzz)
    python3 -m pytest -q -p no:cacheprovider --require-gpu -o faulthandler_timeout=240 tests/test_concurrency.py tests/test_fuzz.py \
      2>&1 | tee "$OUT/pytest-fuzz.log" | tail -n 40 || status=1
    ;;
  fp8)
    python3 -m pytest -q -p no:cacheprovider --require-gpu tests/test_fp8.py 2>&1 | tee "$OUT/pytest-fp8.log" | tail -n 25 || status=1
    python3 $HERE/bench.py fp8 "$@" 2>&1 | tee "$OUT/bench-fp8.md" || status=1
    ;;
  jax)
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
    # a handler that deadlocked would hang the call: tracebacks after 120 s in a test, killed after 480 s
    timeout 480 python3 -m pytest -q -p no:cacheprovider --require-gpu --maxfail=10 -o faulthandler_timeout=120 tests/test_jax.py 2>&1 \
      | tee "$OUT/pytest-jax.log" | tail -n 40 || status=1
    ;;
  ring)
    # ring attention: every rank in one process on GPU 0 (tests), then on 2+ GPUs the NCCL ring against one
    # GPU and float64 at N=32k (check) and the speed-up at N=128k (bench; extra ARGS go to it)
    python3 -m pytest -q -p no:cacheprovider --require-gpu -m "not slow" tests/test_distributed.py 2>&1 \
      | tee "$OUT/pytest-ring.log" | tail -n 12 || status=1
    gpus=$(python3 -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())")
    worlds=""
    for w in 2 4 8; do [ "$gpus" -ge $w ] && worlds="$worlds${worlds:+,}$w"; done
    if [ -n "$worlds" ]; then
      for w in ${worlds//,/ }; do
        python3 -m cuflash.distributed.check --gpus "$w" 2>&1 | tee -a "$OUT/ring-check.md" || status=1
      done
      python3 -m cuflash.distributed.bench --gpus "$worlds" --json "$OUT/ring-bench.json" "$@" 2>&1 \
        | tee "$OUT/ring-bench.md" || status=1
    fi
    ;;
  ncu)
    if [ -d .fa4b ] && [ ! -d $FA4_SITE ]; then fa4_setup || status=1; fi
    fa4_env
    shape=$1; pass=$2; dist=${3:-normal}
    row_args=(); [ "${shape#row:}" != "$shape" ] && row_args=(--row "${shape#row:}")   # row:NAME, a variant row
    # FA2 (SDPA's flash backend) too with NCU_FLASH=1: the portable kernels' peer (issue #46; CUFLASH_PLAN_CC=80 or
    # 86 for the A100's or the 99 KB cards' tables)
    [ "$pass" = bwd ] && kernels='bwd_dkdv|BackwardSm90|flash_bwd_dq_dk_dv' || kernels='fwd_.*kernel|ForwardSm90'
    for who in cuflash $( [ -d $FA4_SITE ] && echo fa4 ) $( [ -n "${NCU_FLASH:-}" ] && echo flash ); do
      echo "== $who $pass $shape $dist"
      ncu --clock-control ${NCU_CLOCK:-none} --kernel-name "regex:$kernels" --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section InstructionStats --section LaunchStats --section Occupancy \
        python3 $HERE/profiling.py launch "$shape" $who $pass "$dist" "${row_args[@]}" > "$OUT/ncu-$who-$pass.txt" 2>&1 || status=1
      if [ -n "${NCU_SOURCE:-}" ]; then   # per-SASS-instruction warp-stall samples, as CSV
        ncu --clock-control none --kernel-name "regex:$kernels" --launch-skip 1 --launch-count 1 --set none \
          --section SourceCounters --section WarpStateStats -f -o $TMP/ncu-src-$who \
          python3 $HERE/profiling.py launch "$shape" $who $pass "$dist" "${row_args[@]}" > /dev/null 2>&1 || status=1
        ncu --import $TMP/ncu-src-$who.ncu-rep --page source --csv --print-source sass > "$OUT/ncu-src-$who-$pass.csv" 2>&1
        ncu --import $TMP/ncu-src-$who.ncu-rep --page details --print-details all > "$OUT/ncu-stall-$who-$pass.txt" 2>&1
      fi
      grep -E "^  [a-zA-Z_].*\(|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Executed Ipc A|Issue Slots Busy|Registers Per|Shared Memory Configuration Size|Dynamic Shared|Warp Cycles Per Issued|Executed Instructions  |L1/TEX Hit|L2 Hit|Block Size|Grid Size" \
        "$OUT/ncu-$who-$pass.txt" | head -40
    done
    ;;
  all)
    for p in tests tests80 fuzz jax ring "sanitize memcheck racecheck initcheck synccheck" bench; do
      bash $HERE/device_run.sh $p || status=1
    done
    ;;
  bench)
    fa4_env  # the fa4 column, where fa4setup has run on this machine
    python3 -m cuflash --markdown --json "$OUT/bench.json" --repeats 30 2>&1 | tee "$OUT/bench.log" | tail -n 60 || status=1
    python3 $HERE/bench.py deterministic 2>&1 | tee "$OUT/deterministic.md" || status=1
    ;;
esac
exit $status
