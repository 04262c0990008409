#!/usr/bin/env bash
# GPU nodes on several GPUs of one host (issue: multi-GPU run), after
# bench/gpu/pack.sh here. One kvringd per GPU (daemon i on GPU i), NVLink
# multicast left off; pass-Q decode with append and chunked prefill checked
# against torch, decode-step latency on 1, 2, 4 and 8 shards (each shard its
# own GPU), then the NCCL ring of attention/cuda at world sizes 2/4/8 when
# bench/gpu/multi_gpu.sh fits.
#   bash bench/gpu/multi_gpu_e2e.sh            (uses every visible GPU)
# On one GPU it is the dry run: every daemon shares GPU 0.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=$(nvidia-smi --list-gpus | wc -l)
GPUS=$(seq -s, 0 $((N - 1)))
SHARDS=1; for s in 2 4 8; do [ "$s" -le "$N" ] && SHARDS="$SHARDS,$s"; done
[ "$N" = 1 ] && SHARDS=1,4  # dry run: four daemons share the one GPU
echo "== $N GPU(s): daemons on $GPUS, shards $SHARDS"
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
[ -d .gpu ] || { [ -f .gpu.tar.gz ] && tar xzf .gpu.tar.gz; }
[ -d .gpu ] && export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=$PWD/.gpu/lib/ucx
export PYTHONPATH=$PWD/.gpu/python:$PWD/build/python:${PYTHONPATH:-}
python3 bench/gpu/e2e.py --bin "${KVRING_GPU_BIN:-$PWD/.gpu}" --out "$OUT" --gpus "$GPUS" --shards "$SHARDS" \
  --only correctness,latency 2>&1 | tee "$OUT/multi_gpu_e2e.log" | grep -v "UCX  ERROR\|UCX  WARN"
if [ "$N" -gt 1 ]; then
  echo "== NCCL ring, world sizes 2/4/8"
  bash bench/gpu/multi_gpu.sh 2>&1 | tail -20
fi
