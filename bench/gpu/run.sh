#!/usr/bin/env bash
# Everything for one device call: GPU tests, the NCCL probe, the benchmark
# against torch SDPA, and the decode kernel's phase trace. Run on the device machine from the repo root
# after bench/gpu/pack.sh ran here:
#   bash bench/gpu/run.sh [--quick] [--profile]
# Logs and results go to $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_DIR=$(dirname "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')" 2>/dev/null || true)
[ -z "$NCCL_DIR" ] && NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(os.path.dirname(nvidia.nccl.__file__), "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${NCCL_DIR}:${LD_LIBRARY_PATH:-}
echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.txt"
echo "== gpu tests"
timeout 420 .gpu/bin/gpu_test --gtest_color=no 2>&1 | tee "$OUT/gpu_test.log" | grep -E "^\[ +(OK|FAILED|SKIPPED|PASSED) |Failure|error|Expected|Which|Value of|Actual" | head -80
echo "== nccl probe"
timeout 60 .gpu/bin/nccl_probe 2>&1 | tail -3 | tee "$OUT/nccl_probe.txt"
echo "== ring, world size 1 (dry run of bench/gpu/multi_gpu.sh)"
bash bench/gpu/multi_gpu.sh --quick 2>&1 | tail -6
PROFILE=0
BENCH_ARGS=()
for a in "$@"; do
  if [ "$a" = "--profile" ]; then PROFILE=1; else BENCH_ARGS+=("$a"); fi
done
echo "== benchmark"
PYTHONUNBUFFERED=1 timeout 420 python3 bench/gpu/attention_bench.py --lib .gpu/lib/libkvring_cuda_capi.so --out "$OUT" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/bench.log" | grep -v "^|"
if [ -f .gpu/lib/libkvring_cuda_capi_trace.so ]; then
  echo "== decode phases, CTA by CTA (diagnostic build)"
  for flags in 1 0; do  # the tables read before the grid-dependency wait (stable tables), and after it
    echo "-- kvring_cuda_decode flags $flags"
    timeout 120 python3 bench/gpu/decode_trace.py --lib .gpu/lib/libkvring_cuda_capi_trace.so --shapes 1:32768,1:131072 \
      --flags $flags --out "$OUT" 2>&1 | tee "$OUT/decode_trace_flags$flags.log" | grep -v "^    "
  done
fi
if [ "$PROFILE" = 1 ]; then
  echo "== nsight compute (one launch of each kernel)"
  bash bench/gpu/profile.sh
fi
