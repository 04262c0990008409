#include "kvring/cache/device_page_pool.h"

#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvring/common/cuda_status.h"

namespace kvring {
namespace {
absl::Status Cuda(cudaError_t e, const std::string& what) { return CudaStatus(e, what); }
}  // namespace

absl::StatusOr<std::unique_ptr<DevicePagePool>> DevicePagePool::Create(const DevicePagePoolOptions& o) {
  if (o.page_bytes == 0 || o.page_bytes % 256 != 0)
    return absl::InvalidArgumentError("page_bytes must be a positive multiple of 256");
  if (o.num_pages == 0 || o.num_pages >= kNoPage) return absl::InvalidArgumentError("num_pages out of range");
  if (absl::Status s = Cuda(cudaSetDevice(o.device), absl::StrCat("cudaSetDevice(", o.device, ")")); !s.ok()) return s;
  const size_t pps = std::max<size_t>(1, o.slab_bytes / o.page_bytes);
  std::unique_ptr<DevicePagePool> pool(new DevicePagePool(o.page_bytes, o.num_pages, pps, o.device));
  for (size_t left = o.num_pages; left > 0;) {
    const size_t n = std::min(left, pps);
    void* p = nullptr;
    if (absl::Status s =
            Cuda(cudaMalloc(&p, n * o.page_bytes), absl::StrCat("cudaMalloc of ", n * o.page_bytes, " bytes"));
        !s.ok()) {
      return s;  // the destructor frees the slabs made so far
    }
    pool->slabs_.push_back(static_cast<uint8_t*>(p));
    left -= n;
  }
  return pool;
}

DevicePagePool::~DevicePagePool() {
  for (uint8_t* s : slabs_) (void)cudaFree(s);  // nothing to report to from a destructor
}

}  // namespace kvring
