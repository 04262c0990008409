#!/usr/bin/env bash
# Sets up (deploy/setup.sh), then runs every test through ctest and prints
# its summary. GPU tests (label gpu) skip themselves without a device.
#   KVRING_CTEST_ARGS  extra ctest arguments (e.g. -L unit)
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
BUILD_DIR=${KVRING_BUILD_DIR:-build}
echo "[tests] running ctest"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" --timeout 600 ${KVRING_CTEST_ARGS:-}
