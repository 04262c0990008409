#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time from the committed seed corpus
# (read-only; new inputs go to a temporary directory) and fails on any crash,
# leak or sanitizer report.
#   run_fuzz.sh <fuzzer binary> <seed corpus dir> <seconds>
set -euo pipefail
bin=$1; seeds=$2; secs=${3:-30}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$bin" -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
  -artifact_prefix="$work/" "$work" "$seeds" 2>&1 | tail -25
status=${PIPESTATUS[0]}
if ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* >/dev/null 2>&1; then
  echo "fuzzer found a failing input:"; ls -l "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* 2>/dev/null || true
  exit 1
fi
exit "$status"
