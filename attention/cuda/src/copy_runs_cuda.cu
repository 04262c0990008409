// Many device-to-device copies in one launch (copy_runs_cuda.h).
#include <algorithm>

#include "kvring/attention/cuda/copy_runs_cuda.h"

namespace kvring::cuda {
namespace internal {
namespace {

struct CopyRunBatch {
  CopyRun runs[kCopyRunsPerLaunch];
};

// Whether a run copies 16 bytes a thread (its pointers and size 16-byte aligned).
__host__ __device__ inline bool Aligned16(const CopyRun& r) {
  return ((reinterpret_cast<uintptr_t>(r.dst) | reinterpret_cast<uintptr_t>(r.src) | r.bytes) & 15) == 0;
}

// blockIdx.y: the run; the blocks of x stride over its bytes.
__global__ void CopyRunsKernel(const __grid_constant__ CopyRunBatch batch) {
  const CopyRun& r = batch.runs[blockIdx.y];
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  if (Aligned16(r)) {
    uint4* d = static_cast<uint4*>(r.dst);
    const uint4* s = static_cast<const uint4*>(r.src);
    for (uint64_t i = tid; i < r.bytes / 16; i += stride) d[i] = s[i];
  } else {
    uint8_t* d = static_cast<uint8_t*>(r.dst);
    const uint8_t* s = static_cast<const uint8_t*>(r.src);
    for (uint64_t i = tid; i < r.bytes; i += stride) d[i] = s[i];
  }
}

}  // namespace
}  // namespace internal

cudaError_t CopyRuns(const CopyRun* runs, int n, cudaStream_t stream) {
  if (n < 0 || (n > 0 && runs == nullptr)) return cudaErrorInvalidValue;
  constexpr int kThreads = 256;
  for (int first = 0; first < n; first += kCopyRunsPerLaunch) {
    internal::CopyRunBatch batch;
    int k = 0;
    uint64_t most = 0;  // the largest run's units (16-byte or 1-byte) of work a thread
    for (int i = first; i < n && i < first + kCopyRunsPerLaunch; ++i) {
      const CopyRun& r = runs[i];
      if (r.bytes == 0) continue;
      if (r.dst == nullptr || r.src == nullptr) return cudaErrorInvalidValue;
      batch.runs[k++] = r;
      most = std::max<uint64_t>(most, internal::Aligned16(r) ? r.bytes / 16 : r.bytes);
    }
    if (k == 0) continue;
    // Enough blocks that the largest run is one pass at 4 units a thread,
    // at most 1024 (the grid-stride loop takes the rest).
    const uint64_t blocks = std::min<uint64_t>(1024, std::max<uint64_t>(1, (most + 4 * kThreads - 1) / (4 * kThreads)));
    internal::CopyRunsKernel<<<dim3((unsigned)blocks, (unsigned)k), kThreads, 0, stream>>>(batch);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace kvring::cuda
