#!/usr/bin/env bash
# Issue 32's decode figures in one device call (about 9 minutes): pass-Q
# decode inside transformers' generate with the settings from before the
# default deployment changed (no MPS, fixed UCX spin, the unprepared step),
# then on the default deployment (MPS, adaptive spin, the prepared step),
# then the teacher-forced pass-Q check on the final code.
#   here:          bash bench/gpu/pack.sh
#   on the host:   bash bench/gpu/decode_targets.sh [--configs=1x1x32K,...] [--no-before] [--no-check] [--tests] [--profile]
#                                                   [--baseline=DIR]
#                  (--baseline: DIR holds an earlier build's control/, clients/ and python/ (pack.sh's layout);
#                   it runs the default deployment's configurations first, as hf_decode_default_base.json)
#                  (results in $OUT or ./gpu-out; --tests runs the GPU gtests first, without MPS)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
[ -d .gpu ] || tar xzf .gpu.tar.gz
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export UCX_MODULE_DIR=$PWD/.gpu/lib/ucx PYTHONPATH=$PWD/.gpu/python:${PYTHONPATH:-} KVRING_BIN=$PWD/.gpu KVRING_ROOT=$PWD
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
CONFIGS=1x1x32K,4x1x32K,1x8x32K,4x8x32K,1x1x128K,4x1x128K
BEFORE=1; CHECK=1; TESTS=0; BUDGET=250; PROFILE=; BASELINE=
for a in "$@"; do
  case "$a" in
    --configs=*) CONFIGS=${a#--configs=};;
    --budget=*) BUDGET=${a#--budget=};;
    --no-before) BEFORE=0;;
    --no-check) CHECK=0;;
    --tests) TESTS=1;;
    --profile) PROFILE=--profile;;
    --baseline=*) BASELINE=${a#--baseline=};;
    *) echo "unknown option $a" >&2; exit 2;;
  esac
done
quiet() { grep -v "UCX  ERROR\|UCX  WARN\|^W1\|^I1\|^  File \|^    "; }
rc=0
bash deploy/local-cluster.sh mps-stop
if [ $TESTS = 1 ]; then
  bash bench/gpu/e2e.sh --no-e2e --no-hf --no-workloads || rc=1
  bash deploy/local-cluster.sh mps-stop
fi
if [ $BEFORE = 1 ]; then
  echo "== before: no MPS, fixed spin, unprepared step"
  timeout 150 python3 bench/gpu/hf_decode.py --bin .gpu --out "$OUT" --deployment before \
    --configs 1x1x32K,4x1x32K --budget 100 2>&1 | tee "$OUT/hf_decode_before.log" | quiet
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
bash deploy/local-cluster.sh mps-start
if [ -n "$BASELINE" ]; then
  [ -d "$BASELINE" ] || tar xzf "$BASELINE.tar.gz"
  echo "== default deployment, baseline binaries ($BASELINE)"
  PYTHONPATH=$PWD/$BASELINE/python:$PYTHONPATH timeout $((BUDGET + 90)) python3 bench/gpu/hf_decode.py --bin "$PWD/$BASELINE" \
    --out "$OUT" --configs "$CONFIGS" --budget "$BUDGET" --tag base 2>&1 | tee "$OUT/hf_decode_default_base.log" | quiet
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
echo "== default deployment"
timeout $((BUDGET + 90)) python3 bench/gpu/hf_decode.py --bin .gpu --out "$OUT" --configs "$CONFIGS" --budget "$BUDGET" $PROFILE 2>&1 \
  | tee "$OUT/hf_decode_default.log" | quiet
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
if [ $CHECK = 1 ]; then
  echo "== teacher-forced pass-Q check (final code, default deployment)"
  timeout 120 python3 bench/gpu/hf_e2e.py --bin .gpu --out "$OUT" --only passq 2>&1 | tee "$OUT/hf_e2e.log" | quiet | tail -4
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit $rc
