#!/usr/bin/env bash
# Installs kvring's Debian 12 build dependencies (idempotent), then configures
# and builds everything into ./build with CMake + Ninja.
#   KVRING_BUILD_DIR   build directory (default: build)
#   KVRING_CMAKE_ARGS  extra CMake arguments (e.g. -DKVRING_CUDA=OFF)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${KVRING_BUILD_DIR:-build}

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  librocksdb-dev libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libucx-dev ucx-utils libgtest-dev libgmock-dev libbenchmark-dev
  libzstd-dev liblz4-dev libxxhash-dev python3-numpy python3-matplotlib
  redis-server etcd-server clang libclang-rt-14-dev iproute2 procps python3-yaml libssl-dev openssl prometheus clang-format
)

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] installing ${#missing[@]} Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "[setup] all ${#PACKAGES[@]} Debian packages present"
fi

# Debian's python3 (with its numpy and pybind11), not a pyenv shim.
PY=/usr/bin/python3
echo "[setup] configuring $BUILD_DIR"
cmake -S "$ROOT" -B "$ROOT/$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython3_EXECUTABLE=$PY ${KVRING_CMAKE_ARGS:-} >"$ROOT/$BUILD_DIR.configure.log" 2>&1 || {
  cat "$ROOT/$BUILD_DIR.configure.log"; exit 1; }
grep -E "^-- kvring" "$ROOT/$BUILD_DIR.configure.log" || true
echo "[setup] building (ninja, $(nproc) jobs)"
ninja -C "$ROOT/$BUILD_DIR"
# The Python package: put build/python on Debian python3's path, so that a
# plain `python3 -c 'import kvring'` works.
SITE=$($PY -c 'import site; print(site.getsitepackages()[0])')
if [ -f "$ROOT/$BUILD_DIR/python/kvring/__init__.py" ]; then
  $SUDO mkdir -p "$SITE"
  echo "$ROOT/$BUILD_DIR/python" | $SUDO tee "$SITE/kvring.pth" >/dev/null
  echo "[setup] python: kvring importable by $PY (via $SITE/kvring.pth)"
  # A python3 earlier on PATH (e.g. pyenv) of the same version gets it too.
  OTHER=$(command -v python3 || true)
  if [ -n "$OTHER" ] && [ "$OTHER" != "$PY" ] && \
     [ "$("$OTHER" -c 'import sys; print(sys.version_info[:2])' 2>/dev/null)" = "$($PY -c 'import sys; print(sys.version_info[:2])')" ]; then
    OSITE=$("$OTHER" -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
    if [ -n "$OSITE" ] && [ -d "$OSITE" ] && [ -w "$OSITE" ]; then
      echo "$ROOT/$BUILD_DIR/python" > "$OSITE/kvring.pth"
      echo "[setup] python: also for $OTHER (via $OSITE/kvring.pth; numpy comes from Debian's python3 only)"
    fi
  fi
fi
echo "[setup] done: binaries in $BUILD_DIR/"
