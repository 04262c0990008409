#!/usr/bin/env bash
# Nsight Compute on kvring's decode kernel and SDPA's cuDNN decode, same
# inputs, side by side: duration, DRAM bytes and throughput, L2, occupancy.
# Run on the device machine from the repo root:
#   bash bench/gpu/profile_decode.sh [B:L,...]      (default 1:32768,64:32768)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
SHAPES=${1:-1:32768,64:32768}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -z "$NCU" ] && { echo "no ncu"; exit 0; }
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
IFS=, read -ra shapes <<< "$SHAPES"
for sh in "${shapes[@]}"; do
  timeout 240 "$NCU" --clock-control none --target-processes all --nvtx --nvtx-include "decode $sh/" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_read.sum,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,gpc__cycles_elapsed.max,launch__grid_size,launch__block_size,launch__registers_per_thread \
    python3 bench/gpu/attention_bench.py --lib .gpu/lib/libkvring_cuda_capi.so --out /tmp/ncu-decode --profile-decode "$sh" \
    > "$OUT/ncu_decode_${sh/:/x}.txt" 2>&1
  echo "== decode $sh"
  grep -E "^  [a-zA-Z_].*\(|gpu__time|dram__|lts__|sm__|gpc__|launch__" "$OUT/ncu_decode_${sh/:/x}.txt" | head -60
done
