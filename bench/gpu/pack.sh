#!/usr/bin/env bash
# Builds the GPU binaries here and packs them, stripped, with the Debian
# libraries they need (the device machine has CUDA and NCCL but none of
# Debian's) into .gpu/ (git-ignored; pass it to the device tool as `carry`):
#   .gpu/bin/       gpu_test, gpu_cluster_test (starts ../control's daemons), nccl_probe, ring_bench
#   .gpu/control/   kvringd, kvring-coordinator   (the layout deploy/local-cluster.sh --bin expects)
#   .gpu/clients/   kvring (the CLI)
#   .gpu/python/    the kvring Python package with libkvring_c.so (any Python 3: the device's 3.12 + torch)
#   .gpu/lib/       the libraries, the kernels' C API (+ the trace build), ucx/ (UCX's modules: UCX_MODULE_DIR)
# and .gpu.tar.gz of it (what travels: carry [".gpu.tar.gz"]; the device
# scripts unpack it when .gpu/ is not there).
#   bash bench/gpu/pack.sh [--no-trace]   (--no-trace: without the trace build, which compiles
#                                          every kernel a second time; decode_trace.py then cannot run)
set -euo pipefail
TRACE_BUILD=1
for a in "$@"; do
  case "$a" in
    --no-trace) TRACE_BUILD=0;;
    *) echo "unknown option $a (usage: pack.sh [--no-trace])" >&2; exit 2;;
  esac
done
cd "$(dirname "$0")/../.."
BUILD=${KVRING_BUILD_DIR:-build}
ninja -C "$BUILD" gpu_test gpu_cluster_test nccl_probe ring_bench kvring_cuda_capi kvringd kvring-coordinator kvring kvring_c kvring_python
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib .gpu/control .gpu/clients .gpu/python
cp "$BUILD/tests/gpu/gpu_test" "$BUILD/tests/gpu/gpu_cluster_test" "$BUILD/bench/gpu/nccl_probe" "$BUILD/bench/gpu/ring_bench" .gpu/bin/
cp "$BUILD/control/kvringd" "$BUILD/control/kvring-coordinator" .gpu/control/
cp "$BUILD/clients/kvring" .gpu/clients/
cp -r "$BUILD/python/kvring" .gpu/python/
rm -rf .gpu/python/kvring/__pycache__
cp "$BUILD/attention/cuda/libkvring_cuda_capi.so" .gpu/lib/
for b in .gpu/bin/* .gpu/control/* .gpu/clients/* .gpu/python/kvring/libkvring_c.so; do
  ldd "$b" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libgcc_s.so*|libstdc++.so*|ld-linux*) ;;
      libcudart*|libnccl*|libcuda.so*) ;;   # the device machine's own
      *) [ -f ".gpu/lib/$(basename "$lib")" ] || cp -L "$lib" .gpu/lib/ ;;
    esac
  done
done
# UCX loads its transports as modules at run time.
cp -rL /usr/lib/x86_64-linux-gnu/ucx .gpu/lib/ucx
# The decode kernel's phase trace (a diagnostic build of the C API; run.sh
# runs bench/gpu/decode_trace.py with it).
TRACE=${KVRING_TRACE_BUILD_DIR:-build-trace}
if [ $TRACE_BUILD = 1 ]; then
  if [ ! -f "$TRACE/build.ninja" ]; then
    cmake -S . -B "$TRACE" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVRING_GPU_ONLY=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
          -DCMAKE_CUDA_FLAGS=-DKVRING_DECODE_TRACE > /dev/null
  fi
  ninja -C "$TRACE" kvring_cuda_capi
  cp "$TRACE/attention/cuda/libkvring_cuda_capi.so" .gpu/lib/libkvring_cuda_capi_trace.so
fi
# Strip: the carry limit is 64 MiB.
find .gpu -type f \( -name '*.so*' -o -perm -u+x \) ! -name '*.py' ! -name '*.sh' -exec strip --strip-unneeded {} + 2>/dev/null || true
tar czf .gpu.tar.gz .gpu
du -sh .gpu .gpu.tar.gz
