#!/usr/bin/env bash
# A kvring cluster on this machine: one coordinator and N daemons on loopback
# (with --etcd: a 3-member etcd and two coordinators, one leading).
#
#   deploy/local-cluster.sh start  [--nodes N] [--dir DIR] [--port P] [--replication R] [--host-bytes B] [--page-bytes B] [--no-ucx] [--etcd]
#                                  [--gpu DEV | --gpus D0,D1,... --hbm-bytes B] [--chunk-blocks N] [--write-quorum W] [--bin BUILD_DIR]
#                                  [--daemon-flags "FLAGS"]  (more kvringd flags, e.g. "--ucx_spin_us=200") [--no-mps]
#   deploy/local-cluster.sh stop   [--dir DIR]
#   deploy/local-cluster.sh status [--dir DIR]
#   deploy/local-cluster.sh mps-start | mps-stop | mps-status
#
# Ports: coordinator P (default 7400), daemon i gRPC P+1+i, UCX P+101+i,
# metrics P+201+i. --etcd: etcd member j serves clients on P+301+j (peers
# P+311+j), the second coordinator listens on P+320 (metrics P+321), and
# the metadata lives in etcd, not in the coordinator's RocksDB; the daemons,
# the demo tenant and DIR/coordinators name both coordinators
# (docs/CONTROL-PLANE.md). State, logs and tokens live in DIR (default
# /tmp/kvring-cluster): DIR/admin.token, DIR/cluster.token, and
# DIR/tenant.token for a tenant 'demo' created at start. --gpu makes every
# daemon a GPU node on device DEV with --hbm-bytes of HBM each (several
# daemons may share one GPU); --gpus puts daemon i on device D(i mod n). --bin: where the binaries are (default
# $KVRING_BIN, else ./build). With --gpu/--gpus, start first starts CUDA MPS
# (nvidia-cuda-mps-control -d) unless it runs or --no-mps is given: the
# daemons and an engine started after them then share the GPU without a
# context switch on every pass-Q step (docs/MPS.md). stop leaves MPS running
# (an engine may still use it); mps-stop ends it.
set -euo pipefail
cmd=${1:-}; shift || true
NODES=4; DIR=/tmp/kvring-cluster; PORT=7400; R=2; HOST_BYTES=512M; PAGE_BYTES=2M; UCX=1; GPU=-1; HBM_BYTES=0
CHUNK=64; W=0; DAEMON_FLAGS=""; GPUS=""; MPS=1; ETCD=0
BIN=${KVRING_BIN:-$(cd "$(dirname "$0")/.." && pwd)/build}
while (($#)); do
  case "$1" in
    --nodes) NODES=$2; shift 2;;
    --dir) DIR=$2; shift 2;;
    --port) PORT=$2; shift 2;;
    --replication) R=$2; shift 2;;
    --host-bytes) HOST_BYTES=$2; shift 2;;
    --page-bytes) PAGE_BYTES=$2; shift 2;;
    --no-ucx) UCX=0; shift;;
    --gpu) GPU=$2; shift 2;;
    --gpus) GPUS=$2; GPU=${GPUS%%,*}; shift 2;;
    --hbm-bytes) HBM_BYTES=$2; shift 2;;
    --chunk-blocks) CHUNK=$2; shift 2;;
    --write-quorum) W=$2; shift 2;;
    --bin) BIN=$2; shift 2;;
    --daemon-flags) DAEMON_FLAGS=$2; shift 2;;
    --no-mps) MPS=0; shift;;
    --etcd) ETCD=1; shift;;
    -h|--help) sed -n '2,27p' "$0"; exit 0;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done

pids() { cat "$DIR"/pids/* 2>/dev/null || true; }

# CUDA MPS: one GPU context shared by every process of this user on the GPU.
MPS_PIPE=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
# (By its command line: pgrep -x would miss it, its name being longer than the
# 15 characters the kernel keeps.)
mps_running() { pgrep -f '(^|/)nvidia-cuda-mps-control -d' >/dev/null 2>&1; }
mps_start() {
  if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "[cluster] no nvidia-cuda-mps-control on PATH: an engine on the daemons' GPU pays a GPU context switch on every pass-Q step"
    return 0
  fi
  if mps_running; then echo "[cluster] MPS running (control pipe $MPS_PIPE)"; return 0; fi
  nvidia-cuda-mps-control -d
  for _ in $(seq 50); do mps_running && break; sleep 0.1; done
  mps_running || { echo "[cluster] nvidia-cuda-mps-control -d did not start" >&2; return 1; }
  echo "[cluster] started MPS (control pipe $MPS_PIPE): start engines after this to share the daemons' GPU context"
}
mps_stop() {
  if mps_running; then echo quit | nvidia-cuda-mps-control; echo "[cluster] MPS stopped"; else echo "[cluster] MPS not running"; fi
}

stop() {
  local any=0
  for f in "$DIR"/pids/*; do
    [ -f "$f" ] || continue
    pid=$(cat "$f"); any=1
    kill -TERM "$pid" 2>/dev/null || true
  done
  for _ in $(seq 50); do
    alive=0
    for f in "$DIR"/pids/*; do [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for f in "$DIR"/pids/*; do
    [ -f "$f" ] || continue
    kill -KILL "$(cat "$f")" 2>/dev/null || true
    rm -f "$f"
  done
  [ $any = 1 ] && echo "[cluster] stopped" || echo "[cluster] nothing running in $DIR"
}

# A 3-member etcd on loopback (Debian's etcd-server), its data in DIR/etcd<j>.
start_etcd() {
  command -v etcd >/dev/null 2>&1 || { echo "--etcd needs etcd (apt-get install etcd-server)" >&2; exit 1; }
  local cluster="" j
  for j in 0 1 2; do cluster="$cluster${cluster:+,}m$j=http://127.0.0.1:$((PORT+311+j))"; done
  ETCD_ENDPOINTS=""
  for j in 0 1 2; do
    ETCD_ENDPOINTS="$ETCD_ENDPOINTS${ETCD_ENDPOINTS:+,}127.0.0.1:$((PORT+301+j))"
    local state=new; [ -d "$DIR/etcd$j/member" ] && state=existing
    setsid etcd --name=m$j --data-dir="$DIR/etcd$j" --listen-client-urls=http://127.0.0.1:$((PORT+301+j)) \
      --advertise-client-urls=http://127.0.0.1:$((PORT+301+j)) --listen-peer-urls=http://127.0.0.1:$((PORT+311+j)) \
      --initial-advertise-peer-urls=http://127.0.0.1:$((PORT+311+j)) --initial-cluster="$cluster" \
      --initial-cluster-state=$state --initial-cluster-token=kvring-local \
      >"$DIR/logs/etcd$j.log" 2>&1 < /dev/null &
    echo $! > "$DIR/pids/etcd$j"
  done
  echo "[cluster] etcd members on $ETCD_ENDPOINTS"
}

# True when something on this host accepts connections on 127.0.0.1:$1.
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start() {
  [ -x "$BIN/control/kvringd" ] || { echo "build first: $BIN/control/kvringd missing" >&2; exit 1; }
  mkdir -p "$DIR/pids" "$DIR/logs"
  if [ -n "$(pids)" ]; then stop >/dev/null; fi
  # Another cluster (another DIR) on these ports would take this one's
  # daemons: they would register with its coordinator and be refused.
  local p
  for p in $PORT $(seq $((PORT+1)) $((PORT+NODES))); do
    if port_busy "$p"; then
      echo "[cluster] port $p is in use (another cluster, started with another --dir?): stop it or pick --port" >&2
      exit 1
    fi
  done
  if [ "$GPU" -ge 0 ] && [ $MPS = 1 ]; then
    mps_start || echo "[cluster] WARNING: going on without MPS: an engine on these GPUs pays a context switch per pass-Q step" >&2
  fi
  [ -f "$DIR/admin.token" ] || head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$DIR/admin.token"
  [ -f "$DIR/cluster.token" ] || head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$DIR/cluster.token"
  chmod 600 "$DIR"/*.token
  local coord_flags=(--admin_token_file="$DIR/admin.token" --cluster_token_file="$DIR/cluster.token" --replication=$R
    --heartbeat_interval=250ms --heartbeat_timeout=1500ms --sequence_chunk_blocks=$CHUNK --write_quorum=$W)
  COORDS=127.0.0.1:$PORT
  if [ $ETCD = 1 ]; then
    start_etcd
    COORDS=127.0.0.1:$PORT,127.0.0.1:$((PORT+320))
    local c=0
    for p in $PORT $((PORT+320)); do
      local m=$((PORT+200)); [ $c = 1 ] && m=$((PORT+321))
      setsid "$BIN/control/kvring-coordinator" --listen=127.0.0.1:$p --etcd="$ETCD_ENDPOINTS" --etcd_prefix=/kvring/local/ \
        --metrics_listen=127.0.0.1:$m "${coord_flags[@]}" >"$DIR/logs/coordinator$c.log" 2>&1 < /dev/null &
      echo $! > "$DIR/pids/coordinator$c"
      c=$((c+1))
    done
  else
    setsid "$BIN/control/kvring-coordinator" --listen=127.0.0.1:$PORT --data_dir="$DIR/coordinator" \
      --metrics_listen=127.0.0.1:$((PORT+200)) "${coord_flags[@]}" \
      >"$DIR/logs/coordinator.log" 2>&1 < /dev/null &
    echo $! > "$DIR/pids/coordinator"
  fi
  echo "$COORDS" > "$DIR/coordinators"
  for i in $(seq 0 $((NODES-1))); do
    ucx_flag=""
    [ $UCX = 1 ] && ucx_flag="--ucx_listen=127.0.0.1:$((PORT+101+i))"
    dev=$GPU
    if [ -n "$GPUS" ]; then IFS=, read -ra list <<< "$GPUS"; dev=${list[$((i % ${#list[@]}))]}; fi
    [ "$GPU" -ge 0 ] && ucx_flag="$ucx_flag --gpu=$dev --hbm_bytes=$HBM_BYTES"
    ucx_flag="$ucx_flag $DAEMON_FLAGS"
    setsid "$BIN/control/kvringd" --listen=127.0.0.1:$((PORT+1+i)) --coordinator="$COORDS" \
      --cluster_token_file="$DIR/cluster.token" --data_dir="$DIR/node$i" --node_id=node$i \
      --host_bytes=$HOST_BYTES --page_bytes=$PAGE_BYTES $ucx_flag --metrics_listen=127.0.0.1:$((PORT+201+i)) \
      >"$DIR/logs/node$i.log" 2>&1 < /dev/null &
    echo $! > "$DIR/pids/node$i"
  done
  # Wait for every daemon to be serving.
  for i in $(seq 0 $((NODES-1))); do
    for _ in $(seq 600); do
      grep -q "kvringd ready" "$DIR/logs/node$i.log" 2>/dev/null && break
      if ! kill -0 "$(cat "$DIR/pids/node$i")" 2>/dev/null; then
        echo "[cluster] node$i exited:" >&2; tail -5 "$DIR/logs/node$i.log" >&2; exit 1
      fi
      sleep 0.1
    done
    grep -q "kvringd ready" "$DIR/logs/node$i.log" || { echo "[cluster] node$i not ready" >&2; tail -5 "$DIR/logs/node$i.log" >&2; exit 1; }
  done
  if [ ! -f "$DIR/tenant.token" ]; then
    "$BIN/clients/kvring" --coordinator="$COORDS" --token_file="$DIR/admin.token" tenant-create --name=demo \
      > "$DIR/tenant.token" 2>/dev/null
    chmod 600 "$DIR/tenant.token"
  fi
  echo "[cluster] coordinator$([ $ETCD = 1 ] && echo "s $COORDS (etcd $ETCD_ENDPOINTS)" || echo " $COORDS"), $NODES daemons (R=$R, UCX=$UCX$([ "$GPU" -ge 0 ] && echo ", GPU $GPU, $HBM_BYTES HBM each")), state in $DIR"
}

status() {
  for f in "$DIR"/pids/*; do
    [ -f "$f" ] || continue
    n=$(basename "$f"); pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then echo "$n pid $pid running"; else echo "$n pid $pid DEAD"; fi
  done
}

case "$cmd" in
  start) start;;
  stop) stop;;
  status) status;;
  mps-start) mps_start;;
  mps-stop) mps_stop;;
  mps-status) if mps_running; then echo "MPS running (control pipe $MPS_PIPE)"; else echo "MPS not running"; fi;;
  *) sed -n '2,27p' "$0"; exit 2;;
esac
