#!/usr/bin/env bash
# Network faults between two kvring daemons, on this machine only: two
# network namespaces joined by a veth pair (10.211.0.1 <-> 10.211.0.2),
#   ns kvA: coordinator, daemon node0, the client (kvring CLI)
#   ns kvB: daemon node1
# with R=2, so every block lives on both daemons. Then, on node1's side of
# the link:
#   1. delay and loss: tc netem (delay 40ms +-10ms, loss 5%) where the
#      kernel has sch_netem; otherwise a tbf shaper (2 Mbit/s, 60 ms queue),
#      which delays by queueing and drops what overflows. Puts and gets must
#      all succeed, only slower.
#   2. a partition (the link down): reads of acknowledged blocks succeed from
#      node0 within the bounded retry time; writes succeed once the
#      coordinator has marked node1 DOWN, or fail with a clear error; every
#      command ends within a bounded time.
#   3. healing: node1 comes back UP and every block reads back.
# The data plane here is gRPC (--no UCX): UCX would see one host and use
# shared memory, which bypasses the veth.
#
#   tests/fault/netns_faults.sh <build dir>
# Exit 77 (skipped) without root or network namespaces.
set -euo pipefail
BIN=${1:?usage: netns_faults.sh <build dir>}
A=kvfA$$; B=kvfB$$; VA=kva$$; VB=kvb$$
DIR=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
[ "$(id -u)" = 0 ] || { echo "SKIP: needs root for network namespaces"; exit 77; }
if ! ip netns add "$A" 2>/dev/null; then echo "SKIP: cannot create network namespaces here"; exit 77; fi
ip netns add "$B"
ip link add "$VA" type veth peer name "$VB"
ip link set "$VA" netns "$A"; ip link set "$VB" netns "$B"
ip -n "$A" addr add 10.211.0.1/24 dev "$VA"; ip -n "$B" addr add 10.211.0.2/24 dev "$VB"
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set "$VA" up; ip -n "$B" link set "$VB" up

head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$DIR/admin.token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$DIR/cluster.token"
ip netns exec "$A" "$BIN/control/kvring-coordinator" --listen=10.211.0.1:7950 --data_dir="$DIR/coord" \
  --admin_token_file="$DIR/admin.token" --cluster_token_file="$DIR/cluster.token" --replication=2 \
  --heartbeat_interval=200ms --heartbeat_timeout=1500ms >"$DIR/coord.log" 2>&1 &
PIDS+=($!)
sleep 0.5
start_node() {  # ns id ip
  ip netns exec "$1" "$BIN/control/kvringd" --listen="$3:7951" --coordinator=10.211.0.1:7950 \
    --cluster_token_file="$DIR/cluster.token" --data_dir="$DIR/$2" --node_id="$2" --host_bytes=256M \
    --page_bytes=512K --metrics_listen= >"$DIR/$2.log" 2>&1 &
  PIDS+=($!)
}
start_node "$A" node0 10.211.0.1
start_node "$B" node1 10.211.0.2
for n in node0 node1; do
  for _ in $(seq 100); do grep -q "kvringd ready" "$DIR/$n.log" && break; sleep 0.1; done
  grep -q "kvringd ready" "$DIR/$n.log" || { echo "FAIL: $n did not start"; tail "$DIR/$n.log"; exit 1; }
done
K() { ip netns exec "$A" "$BIN/clients/kvring" --coordinator=10.211.0.1:7950 --ucx=false --rpc_timeout=2s "$@"; }
K --token_file="$DIR/admin.token" tenant-create --name=net > "$DIR/tenant.token" 2> "$DIR/tc.err" || { cat "$DIR/tc.err"; exit 1; }
T=(--token_file="$DIR/tenant.token" --tokens=1024 --layers=2 --kv_heads=4 --head_dim=128)
fail() { echo "FAIL: $*"; for f in "$DIR"/*.log; do echo "--- $f"; tail -5 "$f"; done; exit 1; }
timed() {  # max_seconds label command...: runs, prints the time, fails past the bound
  local max=$1 label=$2; shift 2
  local t0; t0=$(date +%s%N)
  local rc=0; "$@" > "$DIR/out.txt" 2>&1 || rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '[netns] %-44s rc=%d  %4d.%03d s  %s\n' "$label" "$rc" $((ms / 1000)) $((ms % 1000)) "$(tail -1 "$DIR/out.txt")"
  if (( ms > max * 1000 )); then fail "$label took $ms ms (bound $max s)"; fi
  return $rc
}
stats_up() { K --token_file="$DIR/tenant.token" stats 2>/dev/null | grep -c " UP " || true; }

timed 30 "baseline put (8 sequences)" K "${T[@]}" --sequences=8 --seed=1 put || fail "baseline put"
timed 30 "baseline get" K "${T[@]}" --sequences=8 --seed=1 get || fail "baseline get"

# Both directions of node1's link (egress of each veth end).
if ip netns exec "$B" tc qdisc add dev "$VB" root netem delay 40ms 10ms loss 5% 2>/dev/null; then
  ip netns exec "$A" tc qdisc add dev "$VA" root netem delay 40ms 10ms loss 5%
  SHAPER="netem delay 40ms +-10ms, loss 5%, both directions"
else
  ip netns exec "$B" tc qdisc add dev "$VB" root tbf rate 400mbit burst 64kbit latency 50ms
  ip netns exec "$A" tc qdisc add dev "$VA" root tbf rate 400mbit burst 64kbit latency 50ms
  SHAPER="tbf 400 Mbit/s with a 50 ms queue, both directions (no sch_netem in this kernel): queueing delay, tail drops"
fi
echo "[netns] fault 1: $SHAPER"
timed 120 "put under delay/loss (8 more sequences)" K "${T[@]}" --sequences=8 --seed=2 put || fail "put under delay"
timed 120 "get under delay/loss" K "${T[@]}" --sequences=8 --seed=2 get || fail "get under delay"
ip netns exec "$A" tc -s qdisc show dev "$VA" | grep -oE "dropped [0-9]+|overlimits [0-9]+" | tr '\n' ' ' | sed 's/^/[netns]   client side: /'; echo
ip netns exec "$B" tc qdisc del dev "$VB" root; ip netns exec "$A" tc qdisc del dev "$VA" root

echo "[netns] fault 2: silent partition (node1's address removed: its packets are dropped without an error)"
ip -n "$B" addr flush dev "$VB"
timed 60 "get during the partition (reads old blocks)" K "${T[@]}" --sequences=8 --seed=1 get || fail "get during partition"
rc=0; timed 60 "put during the partition" K "${T[@]}" --sequences=4 --seed=3 put || rc=$?
if [ $rc != 0 ]; then
  grep -qiE "unavailable|deadline|replica" "$DIR/out.txt" || fail "put failed without a clear error: $(tail -2 "$DIR/out.txt")"
  echo "[netns]   (put refused with a clear error while node1 was unreachable)"
fi

echo "[netns] healing: address back"
ip -n "$B" addr add 10.211.0.2/24 dev "$VB"
for _ in $(seq 100); do [ "$(stats_up)" = 2 ] && break; sleep 0.2; done
[ "$(stats_up)" = 2 ] || fail "node1 did not come back UP"
timed 30 "get after healing (old blocks)" K "${T[@]}" --sequences=8 --seed=1 get || fail "get after healing"
timed 30 "get after healing (blocks put under delay)" K "${T[@]}" --sequences=8 --seed=2 get || fail "get after healing 2"
echo "[netns] PASS: delay/loss and a partition survived, nothing lost"
