#include <cuda_runtime.h>

#include <map>

#include "absl/synchronization/mutex.h"
#include "kvring/client/device_memory.h"
#include "kvring/common/cuda_ipc.h"
#include "kvring/common/cuda_status.h"

namespace kvring {
namespace {

class CudaDeviceMemory final : public DeviceMemory {
 public:
  ~CudaDeviceMemory() override {
    absl::MutexLock l(&mu_);
    for (auto& [n, p] : free_) (void)cudaFreeHost(p);  // nothing to report to at teardown
  }
  absl::StatusOr<Staging> Pinned(size_t bytes) override {
    const size_t n = std::max<size_t>(size_t{1} << 20, (bytes + (1 << 20) - 1) >> 20 << 20);
    {
      absl::MutexLock l(&mu_);
      auto it = free_.lower_bound(n);
      if (it != free_.end() && it->first <= 4 * n) {
        Staging s = Make(it->second, it->first);
        free_.erase(it);
        return s;
      }
    }
    void* p = nullptr;
    if (absl::Status s = CudaStatus(cudaHostAlloc(&p, n, cudaHostAllocDefault), "pinned staging"); !s.ok()) return s;
    return Make(static_cast<uint8_t*>(p), n);
  }
  absl::Status ToDevice(void* dst, const void* src, size_t bytes) override {
    return CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "copy to device memory");
  }
  absl::Status ToHost(void* dst, const void* src, size_t bytes) override {
    return CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy from device memory");
  }
  absl::StatusOr<ExportedAllocation> Export(const void* p) override {
    absl::StatusOr<DeviceAllocationRange> r = AllocationOf(p);
    if (!r.ok()) return absl::FailedPreconditionError(r.status().message());
    cudaIpcMemHandle_t h;
    if (cudaError_t e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(r->base)); e != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::FailedPreconditionError(
          absl::StrCat("this device memory cannot be shared (cudaIpcGetMemHandle: ", cudaGetErrorName(e), ")"));
    }
    return ExportedAllocation{IpcHandleBytes(h), r->base, r->bytes};
  }

 protected:
  void Return(uint8_t* p, size_t n) override {
    absl::MutexLock l(&mu_);
    free_.emplace(n, p);
    while (free_.size() > 16) {  // keep a bounded pool
      (void)cudaFreeHost(free_.begin()->second);
      free_.erase(free_.begin());
    }
  }

 private:
  absl::Mutex mu_;
  std::multimap<size_t, uint8_t*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void DeviceMemory::Staging::Release() {
  if (owner_ != nullptr) owner_->Return(p_, n_);
  owner_ = nullptr;
}

absl::StatusOr<std::unique_ptr<DeviceMemory>> DeviceMemory::Create() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    return absl::FailedPreconditionError("device pointers were given, but this process sees no CUDA device");
  }
  return std::unique_ptr<DeviceMemory>(new CudaDeviceMemory());
}

bool DeviceMemory::IsDevicePointer(const void* p) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // a host pointer the runtime does not know: not an error to keep
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

}  // namespace kvring
