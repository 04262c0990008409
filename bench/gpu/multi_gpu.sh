#!/usr/bin/env bash
# Multi-GPU rings on the device machine: one process per GPU (NCCL, NVLink
# multicast off as the device docs require), world sizes 1, 2, 4, 8 up to the
# GPUs present. For each shape: pass-KV and pass-Q causal prefill, and pass-Q
# decode, with the KV in the load-balanced layout; each rank checks its ring
# result against one GPU attending over the whole sequence. Writes
# $OUT/ring.jsonl (one line per rank and run) and $OUT/ring.md (latency,
# parallel efficiency T1 / (N x TN), exposed communication).
#   bash bench/gpu/multi_gpu.sh [--quick]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
BIN=${RING_BENCH:-.gpu/bin/ring_bench}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$NGPU" -ge 1 ] || { echo "no GPU"; exit 1; }
if [ "${1:-}" = "--quick" ]; then
  SHAPES=("32768 32 8")
else
  # tokens q_heads kv_heads: Llama-3-8B-like and -70B-like heads; 1M tokens where memory allows.
  SHAPES=("131072 32 8" "524288 32 8" "1048576 32 8" "131072 64 8" "524288 64 8")
fi
: > "$OUT/ring.jsonl"
for shape in "${SHAPES[@]}"; do
  read -r L HQ HKV <<< "$shape"
  for N in 1 2 4 8; do
    [ "$N" -le "$NGPU" ] || continue
    for run in "prefill passkv" "prefill passq" "decode passq"; do
      read -r MODE ALGO <<< "$run"
      ID=$(mktemp -u /tmp/kvring_nccl_id.XXXX)
      pids=()
      for r in $(seq 0 $((N - 1))); do
        timeout 300 "$BIN" --rank="$r" --world="$N" --id_file="$ID" --tokens="$L" --q_heads="$HQ" --kv_heads="$HKV" \
          --mode="$MODE" --algo="$ALGO" --reps=3 >> "$OUT/ring.jsonl" 2>> "$OUT/ring.err" &
        pids+=($!)
      done
      rc=0
      for p in "${pids[@]}"; do wait "$p" || rc=$?; done
      rm -f "$ID"
      echo "[ring] L=$L heads=$HQ/$HKV N=$N $MODE $ALGO rc=$rc"
    done
  done
done
python3 - "$OUT" <<'PY'
import json, sys, collections
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/ring.jsonl") if l.startswith("{")]
runs = collections.defaultdict(list)
for r in rows:
    runs[(r["tokens"], r["q_heads"], r["mode"], r["algo"], r["world"])].append(r)
lines = ["| tokens | heads | mode | algo | N | ring ms (max over ranks) | T1/(N*TN) | exposed comm ms | max rel err |", "|---|---|---|---|---|---|---|---|---|"]
for (L, HQ, mode, algo, N), rs in sorted(runs.items()):
    t = max(r["ring_ms"] for r in rs)
    one = runs.get((L, HQ, mode, algo, 1))
    t1 = max(r["ring_ms"] for r in one) if one else None
    eff = f"{t1 / (N * t):.2f}" if t1 and mode == "prefill" else ("n/a" if not t1 else f"{t1 / t:.2f}x speedup")
    lines.append(f"| {L} | {HQ}/{rs[0]['kv_heads']} | {mode} | {algo} | {N} | {t:.2f} | {eff} | "
                 f"{max(r['exposed_comm_ms'] for r in rs):.2f} | {max(r['rel_err'] for r in rs):.1e} |")
open(f"{out}/ring.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
