#!/usr/bin/env bash
# The main job: set up, then run the demo workload.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
BUILD_DIR=${KVRING_BUILD_DIR:-build}
"$BUILD_DIR/clients/kvring-store-demo"
