#!/usr/bin/env bash
# The README's test command. Sets up (deploy/setup.sh), then:
#  0. the format check: every C++/CUDA file as .clang-format has it
#     (fix with: git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i);
#  1. every test of the main build through ctest (GPU tests, label gpu, skip
#     themselves without a device);
#  2. a clang build (build-asan/) with ASan + UBSan, libFuzzer and
#     -Werror=thread-safety: the unit tests again under the sanitizers, and
#     each fuzz target for KVRING_FUZZ_SECONDS (default 30) from the corpus.
# Environment:
#   KVRING_CTEST_ARGS     extra ctest arguments for phase 1 (e.g. -L unit)
#   KVRING_SANITIZE_TESTS 0 skips phase 2
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
echo "[tests] phase 0: clang-format check"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror
else
  find . -path ./build\* -prune -o \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print \
    | xargs clang-format --dry-run --Werror
fi
BUILD_DIR=${KVRING_BUILD_DIR:-build}
echo "[tests] phase 1: ctest in $BUILD_DIR"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" --timeout 600 ${KVRING_CTEST_ARGS:-}

if [ "${KVRING_SANITIZE_TESTS:-1}" != 0 ]; then
  ASAN_DIR=${KVRING_ASAN_DIR:-build-asan}
  echo "[tests] phase 2: clang + ASan/UBSan + libFuzzer + thread-safety analysis in $ASAN_DIR"
  CC=clang CXX=clang++ cmake -S . -B "$ASAN_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS=-O1 \
    -DKVRING_CUDA=OFF -DKVRING_BUILD_BENCH=OFF -DKVRING_BUILD_PYTHON=OFF -DKVRING_SANITIZE=ON -DKVRING_FUZZ=ON \
    -DKVRING_FUZZ_SECONDS="${KVRING_FUZZ_SECONDS:-30}" >"$ASAN_DIR.configure.log" 2>&1 || {
    cat "$ASAN_DIR.configure.log"; exit 1; }
  ninja -C "$ASAN_DIR"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir "$ASAN_DIR" --output-on-failure -j"$(nproc)" --timeout 600 -L "unit|fuzz"
fi
echo "[tests] all phases passed"
