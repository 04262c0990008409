#include <cuda_runtime.h>

#include <cstring>
#include <list>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvring/common/cuda_ipc.h"
#include "kvring/common/cuda_status.h"
#include "kvring/common/status_macros.h"
#include "kvring/control/device_delivery.h"
#include "kvring/protocol/wire.h"

namespace kvring {
static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes);
namespace {

// One caller allocation mapped into this process; closed when the last user
// lets go of it.
struct Mapping {
  int device = 0;
  uint8_t* base = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (base == nullptr) return;
    (void)cudaSetDevice(device);
    (void)cudaIpcCloseMemHandle(base);  // the caller's memory is the caller's: nothing to report here
  }
};

// A caller's event opened in this process; destroyed when the last user
// lets go of it.
struct OpenEvent {
  int device = 0;
  cudaEvent_t event = nullptr;
  ~OpenEvent() {
    if (event == nullptr) return;
    (void)cudaSetDevice(device);
    (void)cudaEventDestroy(event);
  }
};

class CudaDeviceDelivery final : public DeviceDelivery {
 public:
  explicit CudaDeviceDelivery(DeviceDeliveryOptions o) : o_(std::move(o)) {}

  absl::StatusOr<std::unique_ptr<Batch>> Begin(absl::Span<const std::string> handles) override;

  // Maps `handle`, or finds it mapped.
  absl::StatusOr<std::shared_ptr<Mapping>> Map(const std::string& handle) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    if (auto it = mapped_.find(handle); it != mapped_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.second);
      return it->second.first;
    }
    KVRING_ASSIGN_OR_RETURN(cudaIpcMemHandle_t h, IpcHandleFromBytes(handle));
    void* p = nullptr;
    if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::FailedPreconditionError(
          absl::StrCat("cannot map the caller's GPU memory (cudaIpcOpenMemHandle: ", cudaGetErrorName(e), ")"));
    }
    auto m = std::make_shared<Mapping>();
    m->device = o_.device;
    m->base = static_cast<uint8_t*>(p);
    absl::StatusOr<DeviceAllocationRange> r = AllocationOf(p);
    if (!r.ok()) {  // m closes the mapping
      return absl::FailedPreconditionError(
          absl::StrCat("cannot size the caller's mapped memory: ", r.status().message()));
    }
    if (r->base != reinterpret_cast<uintptr_t>(p)) {
      return absl::FailedPreconditionError("the caller's handle maps memory that does not start at its allocation");
    }
    m->bytes = r->bytes;
    lru_.push_front(handle);
    mapped_.emplace(handle, std::make_pair(m, lru_.begin()));
    while (mapped_.size() > std::max<size_t>(1, o_.max_mapped)) {
      mapped_.erase(lru_.back());  // users still holding it keep it open until they finish
      lru_.pop_back();
    }
    return m;
  }

  // Opens the caller's event `handle`, or finds it open.
  absl::StatusOr<std::shared_ptr<OpenEvent>> OpenInputsEvent(const std::string& handle) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    if (auto it = events_.find(handle); it != events_.end()) {
      event_lru_.splice(event_lru_.begin(), event_lru_, it->second.second);
      return it->second.first;
    }
    if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat("an event handle of ", handle.size(), " bytes"));
    }
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    auto ev = std::make_shared<OpenEvent>();
    ev->device = o_.device;
    if (cudaError_t e = cudaIpcOpenEventHandle(&ev->event, h); e != cudaSuccess) {
      (void)cudaGetLastError();
      ev->event = nullptr;
      return absl::FailedPreconditionError(
          absl::StrCat("cannot open the caller's CUDA IPC event (cudaIpcOpenEventHandle: ", cudaGetErrorName(e), ")"));
    }
    event_lru_.push_front(handle);
    events_.emplace(handle, std::make_pair(ev, event_lru_.begin()));
    while (events_.size() > std::max<size_t>(1, o_.max_events)) {
      events_.erase(event_lru_.back());  // users still holding it keep it until they finish
      event_lru_.pop_back();
    }
    return ev;
  }

  absl::Status Check(cudaError_t e, absl::string_view what) {
    if (e == cudaSuccess) return absl::OkStatus();
    absl::Status s = CudaStatus(e, what);
    if (CudaErrorIsSticky(e) && o_.on_fatal) o_.on_fatal(s);
    return s;
  }

 private:
  DeviceDeliveryOptions o_;
  absl::Mutex mu_;
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::pair<std::shared_ptr<Mapping>, std::list<std::string>::iterator>> mapped_
      ABSL_GUARDED_BY(mu_);
  std::list<std::string> event_lru_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::pair<std::shared_ptr<OpenEvent>, std::list<std::string>::iterator>> events_
      ABSL_GUARDED_BY(mu_);
};

class CudaBatch final : public DeviceDelivery::Batch {
 public:
  CudaBatch(CudaDeviceDelivery* owner, std::vector<std::shared_ptr<Mapping>> maps)
      : owner_(owner), maps_(std::move(maps)) {}
  ~CudaBatch() override {
    if (pending_) (void)Finish();  // the sources may go once this returns
  }
  absl::Status Add(uint32_t allocation, uint64_t offset, absl::Span<const uint8_t> src) override {
    KVRING_ASSIGN_OR_RETURN(uint8_t * dst, Region(allocation, offset, src.size()));
    pending_ = true;
    return owner_->Check(cudaMemcpyAsync(dst, src.data(), src.size(), cudaMemcpyHostToDevice, cudaStreamPerThread),
                         "cudaMemcpyAsync into the caller's GPU memory");
  }
  absl::StatusOr<uint8_t*> Region(uint32_t allocation, uint64_t offset, uint64_t bytes) override {
    if (allocation >= maps_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("device place names allocation ", allocation, " of ", maps_.size()));
    }
    const Mapping& m = *maps_[allocation];
    if (offset > m.bytes || bytes > m.bytes - offset) {
      return absl::InvalidArgumentError(absl::StrCat("a region of ", bytes, " bytes at offset ", offset,
                                                     " does not fit the caller's allocation of ", m.bytes, " bytes"));
    }
    return m.base + offset;
  }
  absl::Status Read(const uint8_t* device_src, absl::Span<uint8_t> dst) override {
    if (inputs_ != nullptr) {
      KVRING_RETURN_IF_ERROR(owner_->Check(cudaEventSynchronize(inputs_->event), "waiting for the caller's inputs"));
    }
    return owner_->Check(cudaMemcpy(dst.data(), device_src, dst.size(), cudaMemcpyDeviceToHost),
                         "reading the caller's GPU memory");
  }
  absl::StatusOr<void*> InputsReady(const std::string& event_handle) override {
    KVRING_ASSIGN_OR_RETURN(inputs_, owner_->OpenInputsEvent(event_handle));
    return static_cast<void*>(inputs_->event);
  }
  absl::Status Finish() override {
    pending_ = false;
    return owner_->Check(cudaStreamSynchronize(cudaStreamPerThread), "waiting for the copies into the caller's memory");
  }

 private:
  CudaDeviceDelivery* owner_;
  std::vector<std::shared_ptr<Mapping>> maps_;
  std::shared_ptr<OpenEvent> inputs_;
  bool pending_ = false;
};

absl::StatusOr<std::unique_ptr<DeviceDelivery::Batch>> CudaDeviceDelivery::Begin(
    absl::Span<const std::string> handles) {
  KVRING_RETURN_IF_ERROR(Check(cudaSetDevice(o_.device), "cudaSetDevice"));
  std::vector<std::shared_ptr<Mapping>> maps;
  maps.reserve(handles.size());
  for (const std::string& h : handles) {
    KVRING_ASSIGN_OR_RETURN(std::shared_ptr<Mapping> m, Map(h));
    maps.push_back(std::move(m));
  }
  return std::unique_ptr<Batch>(new CudaBatch(this, std::move(maps)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceDelivery>> DeviceDelivery::Create(DeviceDeliveryOptions options) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || options.device < 0 || options.device >= n) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device ", options.device, " for delivery"));
  }
  return std::unique_ptr<DeviceDelivery>(new CudaDeviceDelivery(std::move(options)));
}

}  // namespace kvring
