#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvring/attention/cuda/copy_runs_cuda.h"
#include "kvring/attention/cuda/merge_cuda.h"
#include "kvring/client/device_memory.h"
#include "kvring/common/cuda_ipc.h"
#include "kvring/common/cuda_status.h"
#include "kvring/common/status_macros.h"
#include "kvring/common/stream_words.h"

namespace kvring {
namespace {

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

class CudaDeviceMemory final : public DeviceMemory {
 public:
  ~CudaDeviceMemory() override {
    {
      absl::MutexLock w(&word_mu_);  // (SetWord takes word_mu_ before mu_)
      if (word_stream_ != nullptr) (void)cudaStreamDestroy(word_stream_);
    }
    absl::MutexLock l(&mu_);
    (void)cudaDeviceSynchronize();                       // queued work may still use the buffers below
    for (auto& [n, e] : free_) (void)cudaFreeHost(e.p);  // nothing to report to at teardown
    // Nodes may still hold these mapped; none writes into them once this
    // client's calls are over.
    for (auto& [n, e] : free_exchange_) (void)cudaFree(e.p);
    for (uint8_t* p : retired_) (void)cudaFree(p);
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
    for (auto& [e, h] : ipc_events_) (void)cudaEventDestroy(e);
    for (auto& [h, e] : node_events_) (void)cudaEventDestroy(e);
  }
  absl::StatusOr<Exchange> ExchangeBuffer(size_t bytes, void* stream) override {
    {
      absl::MutexLock l(&mu_);
      auto it = free_exchange_.lower_bound(bytes);
      if (it != free_exchange_.end()) {
        ExchangeEntry x = std::move(it->second);
        const size_t n = it->first;
        free_exchange_.erase(it);
        if (x.after != nullptr) {
          // The last user's stream may still be using it: this one waits.
          cudaError_t e = cudaStreamWaitEvent(S(stream), x.after, 0);
          free_events_.push_back(x.after);
          if (e != cudaSuccess) {
            free_exchange_.emplace(n, ExchangeEntry{x.p, std::move(x.handle), nullptr});
            return CudaStatus(e, "ordering an exchange buffer after its last use");
          }
        }
        return MakeExchange(x.p, n, std::move(x.handle));
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
  absl::Status CopyAsync(void* dst, const void* src, size_t bytes, void* stream) override {
    if (bytes == 0) return absl::OkStatus();
    return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, S(stream)), "an async copy");
  }
  absl::Status CopyDevice(absl::Span<const DeviceCopy> copies, void* stream) override {
    if (copies.empty()) return absl::OkStatus();
    if (copies.size() == 1) return CopyAsync(copies[0].dst, copies[0].src, copies[0].bytes, stream);
    std::vector<cuda::CopyRun> runs;
    runs.reserve(copies.size());
    for (const DeviceCopy& c : copies) runs.push_back(cuda::CopyRun{c.dst, c.src, c.bytes});
    return CudaStatus(cuda::CopyRuns(runs.data(), static_cast<int>(runs.size()), S(stream)),
                      "gathering a step's rows on the device");
  }
  absl::Status MergeRows(float* acc_out, float* acc_lse, uint32_t rows, const float* parts_out, const float* parts_lse,
                         absl::Span<const int32_t> csr, int32_t* csr_scratch, uint32_t q_heads, uint32_t head_dim,
                         bool init, void* cast, DType cast_dtype, void* stream) override {
    if (!csr.empty() && csr.size() < size_t{rows} + 1) {
      return absl::InvalidArgumentError(absl::StrCat("a merge of ", rows, " rows with ", csr.size(), " index entries"));
    }
    cuda::CastOutput c;
    if (cast != nullptr) {
      if (cast_dtype != DType::kBF16 && cast_dtype != DType::kF16) {
        return absl::InvalidArgumentError("a merge casts its output to bf16 or f16 only");
      }
      c = cuda::CastOutput{cast, cast_dtype == DType::kBF16 ? cuda::CastOutput::kBf16 : cuda::CastOutput::kF16};
    }
    const cuda::OutputView acc{acc_out, acc_lse};
    const auto r = static_cast<int>(rows);
    const auto h = static_cast<int>(q_heads), d = static_cast<int>(head_dim);
    if (csr.size() <= static_cast<size_t>(cuda::kInlineCsrEntries)) {  // (empty: no contributions)
      return CudaStatus(cuda::MergeRowsInline(acc, r, parts_out, parts_lse, csr.empty() ? nullptr : csr.data(),
                                              static_cast<int>(csr.size()), h, d, init, S(stream), c),
                        "merging the shards' partials on the device");
    }
    const size_t n = csr.size() * sizeof(int32_t);
    KVRING_ASSIGN_OR_RETURN(Staging stage, Pinned(n));
    stage.UseOn(stream);  // (not handed out again before the copy out of it is done)
    std::memcpy(stage.data(), csr.data(), n);
    KVRING_RETURN_IF_ERROR(CopyAsync(csr_scratch, stage.data(), n, stream));
    return CudaStatus(
        cuda::MergeRows(acc, r, parts_out, parts_lse, csr_scratch, csr_scratch + rows + 1, h, d, init, S(stream), c),
        "merging the shards' partials on the device");
  }
  absl::Status Wait(void* stream) override {
    return CudaStatus(cudaStreamSynchronize(S(stream)), "waiting for the device copies and merges");
  }
  absl::StatusOr<std::string> RecordInputsEvent(void* stream) override {
    absl::MutexLock l(&mu_);
    if (ipc_events_supported_ < 0) {
      int dev = 0, v = 0;
      ipc_events_supported_ = cudaGetDevice(&dev) == cudaSuccess &&
                                      cudaDeviceGetAttribute(&v, cudaDevAttrIpcEventSupport, dev) == cudaSuccess && v
                                  ? 1
                                  : 0;
      (void)cudaGetLastError();
    }
    if (ipc_events_supported_ == 0) return absl::UnimplementedError("this device has no CUDA IPC events");
    // A ring of events: one is recorded again kIpcEvents calls later, long
    // after the node that waited on it answered.
    if (ipc_events_.size() < kIpcEvents) {
      cudaEvent_t e = nullptr;
      KVRING_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess),
                                        "an interprocess event"));
      cudaIpcEventHandle_t h;
      if (cudaError_t err = cudaIpcGetEventHandle(&h, e); err != cudaSuccess) {
        (void)cudaEventDestroy(e);
        ipc_events_supported_ = 0;
        return absl::UnimplementedError(
            absl::StrCat("cannot export an event (cudaIpcGetEventHandle: ", cudaGetErrorName(err), ")"));
      }
      ipc_events_.emplace_back(e, std::string(reinterpret_cast<const char*>(&h), sizeof(h)));
    }
    const auto& [e, handle] = ipc_events_[next_ipc_event_++ % ipc_events_.size()];
    KVRING_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(e, S(stream)), "recording the inputs' event"));
    return handle;
  }
  absl::Status WaitWord(const void* word, uint32_t value, void* stream) override {
    return StreamWordWait(S(stream), word, value);
  }
  bool WaitsOnWords() const override { return StreamWordsAvailable(); }
  absl::Status SetWord(void* word, uint32_t value, const std::string& after_ipc_event) override {
    absl::MutexLock l(&word_mu_);
    cudaPointerAttributes a{};
    if (cudaError_t e = cudaPointerGetAttributes(&a, word); e != cudaSuccess || a.type != cudaMemoryTypeDevice) {
      (void)cudaGetLastError();
      return absl::InvalidArgumentError("the word to set is not device memory");
    }
    KVRING_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(a.device), "the word's device"));
    if (word_stream_ == nullptr) {
      KVRING_RETURN_IF_ERROR(
          CudaStatus(cudaStreamCreateWithFlags(&word_stream_, cudaStreamNonBlocking), "a stream for words"));
    }
    if (!after_ipc_event.empty()) KVRING_RETURN_IF_ERROR(WaitNodeEvent(after_ipc_event, word_stream_));
    KVRING_RETURN_IF_ERROR(StreamWordWrite(word_stream_, word, value));
    return CudaStatus(cudaStreamSynchronize(word_stream_), "setting a word");
  }
  absl::Status WaitNodeEvent(const std::string& ipc_event, void* stream) override {
    cudaEvent_t e = nullptr;
    {
      absl::MutexLock l(&mu_);
      auto it = node_events_.find(ipc_event);
      if (it != node_events_.end()) {
        e = it->second;
      } else {
        if (ipc_event.size() != sizeof(cudaIpcEventHandle_t)) {
          return absl::FailedPreconditionError(absl::StrCat("a node's event handle has ", ipc_event.size(),
                                                            " bytes, not ", sizeof(cudaIpcEventHandle_t)));
        }
        if (node_events_.size() >= kMaxNodeEvents) {
          // (a pending wait keeps its event alive past cudaEventDestroy)
          for (auto& [h, ev] : node_events_) (void)cudaEventDestroy(ev);
          node_events_.clear();
        }
        cudaIpcEventHandle_t h;
        std::memcpy(&h, ipc_event.data(), sizeof(h));
        if (cudaError_t err = cudaIpcOpenEventHandle(&e, h); err != cudaSuccess) {
          (void)cudaGetLastError();
          return absl::FailedPreconditionError(
              absl::StrCat("cannot open a node's event (cudaIpcOpenEventHandle: ", cudaGetErrorName(err), ")"));
        }
        node_events_.emplace(ipc_event, e);
      }
    }
    return CudaStatus(cudaStreamWaitEvent(S(stream), e, 0), "waiting for a node's work on the device");
  }
  absl::StatusOr<Staging> Pinned(size_t bytes) override {
    const size_t n = std::max<size_t>(size_t{1} << 20, (bytes + (1 << 20) - 1) >> 20 << 20);
    {
      absl::MutexLock l(&mu_);
      for (auto it = free_.lower_bound(n); it != free_.end() && it->first <= 4 * n; ++it) {
        if (it->second.after != nullptr) {
          // Queued work may still read it: taken only once that is done.
          if (cudaEventQuery(it->second.after) != cudaSuccess) {
            (void)cudaGetLastError();
            continue;
          }
          free_events_.push_back(it->second.after);
        }
        Staging s = Make(it->second.p, it->first);
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
  void ReturnExchange(uint8_t* p, size_t n, std::string handle, bool drop, void* after, bool after_set) override {
    absl::MutexLock l(&mu_);
    if (!drop) {
      free_exchange_.emplace(n, ExchangeEntry{p, std::move(handle), after_set ? RecordLocked(after) : nullptr});
      return;
    }
    retired_.push_back(p);
    if (retired_.size() > 8) {
      (void)cudaFree(retired_.front());
      retired_.erase(retired_.begin());
    }
  }
  void Return(uint8_t* p, size_t n, void* after, bool after_set) override {
    absl::MutexLock l(&mu_);
    free_.emplace(n, StagingEntry{p, after_set ? RecordLocked(after) : nullptr});
    while (free_.size() > 16) {  // keep a bounded pool
      StagingEntry& e = free_.begin()->second;
      if (e.after != nullptr) {
        (void)cudaEventSynchronize(e.after);  // (its copy lands before the buffer goes)
        free_events_.push_back(e.after);
      }
      (void)cudaFreeHost(e.p);
      free_.erase(free_.begin());
    }
  }

 private:
  static constexpr size_t kIpcEvents = 64;
  static constexpr size_t kMaxNodeEvents = 256;  // nodes' events kept open (each node has a few per lane)
  struct StagingEntry {
    uint8_t* p;
    cudaEvent_t after;  // null: free now
  };
  struct ExchangeEntry {
    uint8_t* p;
    std::string handle;
    cudaEvent_t after;  // null: free now
  };
  // An event recorded on `stream` now (null if that fails: then the stream
  // is waited for, so the buffer is free).
  cudaEvent_t RecordLocked(void* stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    cudaEvent_t e = nullptr;
    if (!free_events_.empty()) {
      e = free_events_.back();
      free_events_.pop_back();
    } else if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      (void)cudaStreamSynchronize(S(stream));
      return nullptr;
    }
    if (cudaEventRecord(e, S(stream)) != cudaSuccess) {
      (void)cudaGetLastError();
      free_events_.push_back(e);
      (void)cudaStreamSynchronize(S(stream));
      return nullptr;
    }
    return e;
  }

  absl::Mutex mu_;
  absl::Mutex word_mu_;  // SetWord's stream, one call at a time
  cudaStream_t word_stream_ ABSL_GUARDED_BY(word_mu_) = nullptr;
  std::multimap<size_t, StagingEntry> free_ ABSL_GUARDED_BY(mu_);
  std::multimap<size_t, ExchangeEntry> free_exchange_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t*> retired_ ABSL_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> free_events_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<cudaEvent_t, std::string>> ipc_events_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, cudaEvent_t> node_events_ ABSL_GUARDED_BY(mu_);
  size_t next_ipc_event_ ABSL_GUARDED_BY(mu_) = 0;
  int ipc_events_supported_ ABSL_GUARDED_BY(mu_) = -1;
};

}  // namespace

void DeviceMemory::Staging::Release() {
  if (owner_ != nullptr) owner_->Return(p_, n_, after_, after_set_);
  owner_ = nullptr;
}

void DeviceMemory::Exchange::Release() {
  if (owner_ != nullptr) owner_->ReturnExchange(p_, n_, std::move(handle_), drop_, after_, after_set_);
  owner_ = nullptr;
}

void* DeviceMemory::ThreadStream() { return static_cast<void*>(cudaStreamPerThread); }

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
