#include <cuda_runtime.h>

#include <map>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kvring/attention/cuda/merge_cuda.h"
#include "kvring/client/device_memory.h"
#include "kvring/common/cuda_ipc.h"
#include "kvring/common/cuda_status.h"
#include "kvring/common/status_macros.h"

namespace kvring {
namespace {

class CudaDeviceMemory final : public DeviceMemory {
 public:
  ~CudaDeviceMemory() override {
    absl::MutexLock l(&mu_);
    for (auto& [n, p] : free_) (void)cudaFreeHost(p);  // nothing to report to at teardown
    // Nodes may still hold these mapped; none writes into them once this
    // client's calls are over.
    for (auto& [n, e] : free_exchange_) (void)cudaFree(e.first);
    for (uint8_t* p : retired_) (void)cudaFree(p);
  }
  absl::StatusOr<Exchange> ExchangeBuffer(size_t bytes) override {
    {
      absl::MutexLock l(&mu_);
      auto it = free_exchange_.lower_bound(bytes);
      if (it != free_exchange_.end()) {
        Exchange e = MakeExchange(it->second.first, it->first, std::move(it->second.second));
        free_exchange_.erase(it);
        return e;
      }
    }
    // Powers of two from 16 MiB: few distinct buffers, each mapped once by
    // each node.
    size_t n = size_t{16} << 20;
    while (n < bytes) n *= 2;
    void* p = nullptr;
    KVRING_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, n), "an exchange buffer in GPU memory"));
    cudaIpcMemHandle_t h;
    if (cudaError_t e = cudaIpcGetMemHandle(&h, p); e != cudaSuccess) {
      (void)cudaFree(p);
      return CudaStatus(e, "exporting an exchange buffer");
    }
    return MakeExchange(static_cast<uint8_t*>(p), n, IpcHandleBytes(h));
  }
  absl::Status CopyAsync(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStreamPerThread), "an async copy");
  }
  absl::Status MergeRows(float* acc_out, float* acc_lse, uint32_t rows, const float* parts_out, const float* parts_lse,
                         const int32_t* contrib_begin, const int32_t* contrib, uint32_t q_heads, uint32_t head_dim,
                         bool init) override {
    return CudaStatus(
        cuda::MergeRows(cuda::OutputView{acc_out, acc_lse}, static_cast<int>(rows), parts_out, parts_lse, contrib_begin,
                        contrib, static_cast<int>(q_heads), static_cast<int>(head_dim), init, cudaStreamPerThread),
        "merging the shards' partials on the device");
  }
  absl::Status Wait() override {
    return CudaStatus(cudaStreamSynchronize(cudaStreamPerThread), "waiting for the device copies and merges");
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
  // Exchange buffers are not freed while the client lives: a node keeps each
  // mapped (freeing exported memory a process still maps is undefined), and
  // sizes are powers of two, so few exist. A dropped one (a node did not
  // answer and may still write) is set aside, never reused; past 8 such, the
  // oldest is freed.
  void ReturnExchange(uint8_t* p, size_t n, std::string handle, bool drop) override {
    absl::MutexLock l(&mu_);
    if (!drop) {
      free_exchange_.emplace(n, std::make_pair(p, std::move(handle)));
      return;
    }
    retired_.push_back(p);
    if (retired_.size() > 8) {
      (void)cudaFree(retired_.front());
      retired_.erase(retired_.begin());
    }
  }
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
  std::multimap<size_t, std::pair<uint8_t*, std::string>> free_exchange_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t*> retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void DeviceMemory::Staging::Release() {
  if (owner_ != nullptr) owner_->Return(p_, n_);
  owner_ = nullptr;
}

void DeviceMemory::Exchange::Release() {
  if (owner_ != nullptr) owner_->ReturnExchange(p_, n_, std::move(handle_), drop_);
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
