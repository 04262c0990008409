#!/usr/bin/env bash
# Nsight Compute on one decode and one prefill launch (hardware counters,
# clocks left alone): memory throughput, achieved occupancy, warp stalls.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -z "$NCU" ] && { echo "no ncu"; exit 0; }
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
timeout 240 "$NCU" --clock-control none --target-processes all -k regex:"Decode.*Kernel|Prefill.*Kernel" -c 4 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
  python3 bench/gpu/attention_bench.py --lib .gpu/lib/libkvring_cuda_capi.so --out /tmp/ncu-bench --profile-one \
  > "$OUT/ncu.txt" 2>&1
grep -E "Kernel|Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Compute \(SM\)|Registers|Stall|L1/TEX Hit|L2 Hit|Issued Warp|No Eligible|Theoretical Occupancy|Block Limit" "$OUT/ncu.txt" | head -80
# The wgmma prefill kernel's stall reasons and tensor-pipe use.
timeout 120 "$NCU" --clock-control none --target-processes all -k regex:"PrefillSm90Kernel" -c 1 \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
  python3 bench/gpu/attention_bench.py --lib .gpu/lib/libkvring_cuda_capi.so --out /tmp/ncu-bench --profile-one \
  > "$OUT/ncu_stalls.txt" 2>&1
grep -E "stalled|gmma|inst_executed|issue_active" "$OUT/ncu_stalls.txt" | sort -k3 -n -r | head -30
