#!/usr/bin/env bash
# Builds the GPU binaries here and packs them, with the Debian libraries they
# need (the device machine has CUDA and NCCL but none of Debian's), into .gpu/
# (git-ignored; pass it to the device tool as `carry`).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${KVRING_BUILD_DIR:-build}
ninja -C "$BUILD" gpu_test nccl_probe ring_bench kvring_cuda_capi
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
cp "$BUILD/tests/gpu/gpu_test" "$BUILD/bench/gpu/nccl_probe" "$BUILD/bench/gpu/ring_bench" .gpu/bin/
cp "$BUILD/attention/cuda/libkvring_cuda_capi.so" .gpu/lib/
for b in .gpu/bin/*; do
  ldd "$b" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libgcc_s.so*|libstdc++.so*|ld-linux*) ;;
      libcudart*|libnccl*|libcuda.so*) ;;   # the device machine's own
      *) cp -L "$lib" .gpu/lib/ ;;
    esac
  done
done
# The decode kernel's phase trace (a diagnostic build of the C API; run.sh
# runs bench/gpu/decode_trace.py with it).
TRACE=${KVRING_TRACE_BUILD_DIR:-build-trace}
if [ ! -f "$TRACE/build.ninja" ]; then
  cmake -S . -B "$TRACE" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVRING_GPU_ONLY=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_CUDA_FLAGS=-DKVRING_DECODE_TRACE > /dev/null
fi
ninja -C "$TRACE" kvring_cuda_capi
cp "$TRACE/attention/cuda/libkvring_cuda_capi.so" .gpu/lib/libkvring_cuda_capi_trace.so
du -sh .gpu
