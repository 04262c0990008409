#!/usr/bin/env bash
# kvring vs redis-server, block put/get over loopback, one run:
#   bash bench/cluster_bench.sh [--nodes N] [--replication R] [--threads T]
# Starts a local cluster (host tier big enough that nothing is evicted) and a
# redis-server (no persistence), runs build/bench/cluster_bench, stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=2; R=1; THREADS=4; EXTRA=()
while (($#)); do
  case "$1" in
    --nodes) NODES=$2; shift 2;;
    --replication) R=$2; shift 2;;
    --threads) THREADS=$2; shift 2;;
    *) EXTRA+=("$1"); shift;;
  esac
done
DIR=/tmp/kvring-bench-cluster
rm -rf "$DIR"
bash deploy/local-cluster.sh start --nodes "$NODES" --replication "$R" --dir "$DIR" --port 7700 --host-bytes 3G >/dev/null
redis-server --port 6390 --save '' --appendonly no --daemonize yes --logfile "$DIR/redis.log" --dir "$DIR" >/dev/null
trap 'redis-cli -p 6390 shutdown nosave >/dev/null 2>&1 || true; bash deploy/local-cluster.sh stop --dir "$DIR" >/dev/null' EXIT
sleep 0.5
echo "kvring: $NODES daemons, R=$R; redis-server $(redis-server --version | awk '{print $3}'); $THREADS client threads; $(nproc) cores"
build/bench/cluster_bench --coordinator=127.0.0.1:7700 --token_file="$DIR/tenant.token" --redis=127.0.0.1:6390 \
  --threads="$THREADS" "${EXTRA[@]}"
