#!/usr/bin/env bash
# GPU nodes end to end on a GPU host (the README's third command).
#   here:          bash bench/gpu/pack.sh          (builds and packs .gpu/ and .gpu.tar.gz)
#   on the host:   bash bench/gpu/e2e.sh [--quick] [--no-tests] [--no-e2e] [--no-hf] [--no-workloads]
#                  [--only=PARTS] [--hf-only=PARTS] [--wl-only=PARTS] [--tests=GTEST_FILTER]
# On a Debian 12 GPU host with a full build (bash deploy/setup.sh), the
# binaries come from build/ instead. Runs the GPU tests (gtest, label gpu),
# then bench/gpu/e2e.py (a coordinator and kvringd --gpu daemons sharing the
# GPU, checked against torch and timed), then bench/gpu/hf_e2e.py
# (transformers' Llama on kvring: pass-Q attention and the prefix cache),
# then bench/gpu/hf_decode.py (pass-Q decode in generate against local sdpa),
# then bench/gpu/hf_spec.py (assisted generation with rollbacks on kvring),
# then bench/gpu/hf_fork.py (transformers sessions forked from one prompt),
# then bench/gpu/seq_lifecycle.py (forks share one context; sessions give memory back),
# then bench/gpu/hf_workloads.py (chat, a 128K agent, a cache-backend batch).
# Logs and results go to $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
[ -d .gpu ] || { [ -f .gpu.tar.gz ] && tar xzf .gpu.tar.gz; }
if [ -d .gpu ]; then
  BIN=$PWD/.gpu; TEST=$BIN/bin/gpu_test; PY=$BIN/python
  export LD_LIBRARY_PATH=$BIN/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  export UCX_MODULE_DIR=$BIN/lib/ucx
else
  BIN=$PWD/build; TEST=$BIN/tests/gpu/gpu_test; PY=$BIN/python
fi
export PYTHONPATH=$PY:${PYTHONPATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
TESTS=1; E2E=1; HF=1; WL=1; ARGS=(); HF_ARGS=(); WL_ARGS=(); FILTER='*'

for a in "$@"; do
  case "$a" in
    --no-tests) TESTS=0;;
    --no-e2e) E2E=0;;
    --no-hf) HF=0;;
    --no-workloads) WL=0;;
    --wl-only=*) WL_ARGS+=("--only" "${a#--wl-only=}");;
    --tests=*) FILTER="${a#--tests=}";;
    --quick) ARGS+=("$a"); HF_ARGS+=("$a");;
    --only=*) ARGS+=("--only" "${a#--only=}");;
    --hf-only=*) HF_ARGS+=("--only" "${a#--hf-only=}");;
    *) echo "unknown option $a" >&2; exit 2;;
  esac
done
echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$OUT/nvidia-smi.txt"
rc=0
if [ $TESTS = 1 ]; then
  echo "== gpu tests"
  for t in "$TEST" "$(dirname "$TEST")/gpu_cluster_test"; do
    log="$OUT/$(basename "$t").log"
    timeout 300 "$t" --gtest_color=no --gtest_filter="$FILTER" 2>&1 | tee "$log" | grep -E "^\[ +(OK|FAILED|SKIPPED|PASSED) |Failure|error:|Expected|Which|Value of|Actual" | head -80
    grep -q "^\[  PASSED  \]" "$log" && ! grep -q "^\[  FAILED  \]" "$log" || rc=1
  done
fi
# The default deployment of GPU nodes shares the GPU through CUDA MPS; every
# process below joins it at its first CUDA call (docs/MPS.md). (The gtests
# above run without it: one of them faults a kernel on purpose, which under
# MPS would reach every client of the server.)
bash deploy/local-cluster.sh mps-start
if [ $E2E = 1 ]; then
  echo "== e2e"
  timeout 480 python3 bench/gpu/e2e.py --bin "$BIN" --out "$OUT" "${ARGS[@]}" 2>&1 | tee "$OUT/e2e.log" | grep -v "UCX  ERROR\|UCX  WARN"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ $HF = 1 ]; then
  echo "== transformers on kvring"
  timeout 540 python3 bench/gpu/hf_e2e.py --bin "$BIN" --out "$OUT" "${HF_ARGS[@]}" 2>&1 | tee "$OUT/hf_e2e.log" | grep -v "UCX  ERROR\|UCX  WARN\|^W1\|^I1"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "== pass-Q decode inside generate against local sdpa (default deployment)"
  timeout 560 python3 bench/gpu/hf_decode.py --bin "$BIN" --out "$OUT" --budget 420 2>&1 | tee "$OUT/hf_decode.log" | grep -v "UCX  ERROR\|UCX  WARN\|^W1\|^I1"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "== speculative decoding on pass-Q (rollbacks by TruncateSequence)"
  timeout 300 python3 bench/gpu/hf_spec.py --bin "$BIN" --out "$OUT" 2>&1 | tee "$OUT/hf_spec.log" | grep -v "UCX  ERROR\|UCX  WARN\|^W1\|^I1"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "== transformers sessions forked from one shared prompt"
  timeout 300 python3 bench/gpu/hf_fork.py --bin "$BIN" --out "$OUT" 2>&1 | tee "$OUT/hf_fork.log" | grep -v "UCX  ERROR\|UCX  WARN\|^W1\|^I1"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "== sequence lifecycle: 64 forks of a 64K context, sessions opened and ended"
  timeout 420 python3 bench/gpu/seq_lifecycle.py --bin "$BIN" --out "$OUT" --sessions 200 2>&1 | tee "$OUT/seq_lifecycle.log" | grep -v "UCX  ERROR\|UCX  WARN\|^W1\|^I1"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ $WL = 1 ]; then
  echo "== workloads: transformers on kvring GPU nodes"
  timeout 540 python3 bench/gpu/hf_workloads.py --bin "$BIN" --out "$OUT" "${WL_ARGS[@]}" 2>&1 | tee "$OUT/hf_workloads.log" | grep -v "UCX  ERROR\|UCX  WARN\|^W1\|^I1"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit $rc
