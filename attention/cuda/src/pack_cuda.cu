#include "cuda_common.cuh"

namespace kvring::cuda {
namespace {
__global__ void PackKernel(const char* __restrict__ pool, uint64_t stride, uint64_t slice_off, uint64_t slice_bytes,
                           const int32_t* __restrict__ ids, char* __restrict__ dst) {
  // A dependent launched with programmatic dependent launch (the decode
  // kernel) may begin its launch now; it waits for our completion before it
  // reads what we write.
  internal::GridDepLaunchDependents();
  const int page = blockIdx.y;
  const uint4* src = reinterpret_cast<const uint4*>(pool + (uint64_t)ids[page] * stride + slice_off);
  uint4* d = reinterpret_cast<uint4*>(dst + (uint64_t)page * slice_bytes);
  const uint64_t n = slice_bytes / 16;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) d[i] = src[i];
}
__global__ void IotaKernel(int32_t* d, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) d[i] = i;
}
}  // namespace

cudaError_t PackLayerPages(const PagedKvView& kv, const int32_t* page_ids, int num_pages, void* dst,
                           cudaStream_t stream) {
  if (num_pages == 0) return cudaSuccess;
  const uint64_t slice = LayerSliceBytes(kv);
  const uint64_t off = (uint64_t)kv.layer * slice;
  dim3 grid(8, num_pages);
  PackKernel<<<grid, 256, 0, stream>>>(static_cast<const char*>(kv.pool), kv.page_stride, off, slice, page_ids,
                                       static_cast<char*>(dst));
  return cudaGetLastError();
}

cudaError_t Iota(int32_t* dst, int n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  IotaKernel<<<(n + 255) / 256, 256, 0, stream>>>(dst, n);
  return cudaGetLastError();
}

}  // namespace kvring::cuda
