#!/usr/bin/env bash
# Before/after in one device call: the same decode and prefill shapes timed
# with two builds of the kernels' C API, alternated (A, B, A, B) so that the
# card's state drifts over both alike. Run on the device machine from the
# repo root:
#   bash bench/gpu/ab.sh OLD.so NEW.so [rounds]
# OLD.so: e.g. libkvring_cuda_capi.so built from an earlier commit (here:
# `git worktree add /tmp/old REV && cmake ... && ninja kvring_cuda_capi`),
# copied into .gpu/lib before the call. Results: $OUT/ab_*.json. Shapes:
# AB_DECODE and AB_PREFILL (B:L lists; AB_PREFILL=none: decode only).
set -uo pipefail
OLD=$1 NEW=$2 ROUNDS=${3:-2}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
DECODE=${AB_DECODE:-1:4096,1:32768,1:131072,8:32768}
PREFILL=${AB_PREFILL:-4:8192,1:32768,16:2048}
for r in $(seq 1 "$ROUNDS"); do
  for which in old new; do
    lib=$OLD; [ "$which" = new ] && lib=$NEW
    echo "== round $r, $which ($lib)"
    python3 bench/gpu/attention_bench.py --lib "$lib" --out "$OUT/ab_${which}_${r}_decode" --decode-only "$DECODE" 2>&1 |
      grep -E "^decode|TB/s"
    [ "$PREFILL" = none ] ||
      python3 bench/gpu/attention_bench.py --lib "$lib" --out "$OUT/ab_${which}_${r}_prefill" --prefill-only "$PREFILL" 2>&1 |
        grep -E "^prefill"
  done
done
