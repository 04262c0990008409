#!/usr/bin/env bash
# The main job: set up (Debian packages + build), start a local 4-node kvring
# cluster on loopback, run a workload against it, print what happened, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
BUILD_DIR=${KVRING_BUILD_DIR:-build}
export KVRING_BIN=$PWD/$BUILD_DIR
DIR=${KVRING_DEMO_DIR:-/tmp/kvring-demo}
rm -rf "$DIR"
echo
echo "== the block store alone: sessions sharing a system prompt, prefix reuse and LRU eviction"
"$BUILD_DIR/clients/kvring-store-demo"
trap 'bash deploy/local-cluster.sh stop --dir "$DIR" >/dev/null 2>&1 || true' EXIT
echo
echo "== starting a local cluster: coordinator + 4 daemons (R=2, UCX data plane)"
bash deploy/local-cluster.sh start --nodes 4 --replication 2 --dir "$DIR" --port 7400
K="$BUILD_DIR/clients/kvring --coordinator=127.0.0.1:7400 --token_file=$DIR/tenant.token"
sleep 0.5
echo
echo "== storing 16 chat sessions of 2048 tokens that share a 1024-token system prompt"
$K put --sequences=16 --tokens=2048
echo
echo "== prefix lookup from a fresh client"
$K lookup --sequences=16 --tokens=2048 | tail -1
echo
echo "== reading every block back (checksums verified)"
$K get --sequences=16 --tokens=2048
echo
echo "== throughput: 1 MiB blocks, 4 client threads"
$K bench --blocks=256 --block_bytes=1M --threads=4
echo
echo "== cluster state"
$K stats
bash deploy/local-cluster.sh stop --dir "$DIR" >/dev/null
trap - EXIT

# The three engine-facing workloads (clients/examples), each on a local
# cluster of its own sized for its blocks; results and plots go to $OUT.
OUT=${KVRING_WORKLOAD_OUT:-bench/out/workloads}  # generated, not tracked
echo
echo "== workload 1: multi-tenant chat (prefix cache through kvring.connector, numpy reference model)"
/usr/bin/python3 clients/examples/chat.py --port 8000 --out_dir "$OUT"
echo
echo "== workload 2: agent memory (a 128K-token context in the cluster, decode by pass-Q)"
/usr/bin/python3 clients/examples/agent_memory.py --port 8300 --out_dir "$OUT"
echo
echo "== workload 3: cache backend (batched lookup / get_into / put, 256 KiB blocks)"
/usr/bin/python3 clients/examples/cache_backend.py --port 8600 --out_dir "$OUT"
echo
echo "== done: results and plots in $OUT/"
