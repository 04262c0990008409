#!/usr/bin/env bash
# TEMPORARY (session 18; not committed): the full run of the new code, then prev (HEAD~1) against new, quantized decode.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
OUT=/tmp/run bash bench/gpu/run.sh
for f in gpu_test.log gpu_bench.json gpu_bench.md decode_trace_flags1.log; do cp /tmp/run/$f "$OUT/"; done
cp /tmp/run/bench.log "$OUT/bench_log.txt"
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
{
for r in 1 2; do
  for which in prev new; do
    lib=.gpu/lib/libkvring_cuda_capi.so; [ $which = prev ] && lib=.gpu/lib/libkvring_cuda_capi_prev.so
    echo "== round $r $which"
    timeout 120 python3 bench/gpu/attention_bench.py --lib $lib --out /tmp/b --quant-only 2>&1 | grep -E "^decode|TB/s"
  done
done
} 2>&1 | tee "$OUT/ab.log"
