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
if [ -x "$BUILD_DIR/clients/examples/kvring-workloads" ]; then
  echo
  "$BUILD_DIR/clients/examples/kvring-workloads" --coordinator=127.0.0.1:7400 --admin_token_file="$DIR/admin.token" --out_dir="$DIR"
fi
