#include "kvring/transport/nccl_transport.h"

#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cuda_event_wait.h"
#include "kvring/common/cuda_status.h"

namespace kvring {
namespace {

absl::Status NcclError(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}
absl::Status CudaError(cudaError_t e, const char* what) { return CudaStatus(e, what); }

// Polls `ev` until it completes, the communicator fails, or `timeout` passes.
absl::Status WaitEvent(cudaEvent_t ev, absl::Duration timeout, ncclComm_t comm) {
  return transport_cuda::WaitEvent(ev, timeout, [comm]() -> absl::Status {
    if (comm == nullptr) return absl::OkStatus();
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) return NcclError(async, "NCCL communicator");
    return absl::OkStatus();
  });
}

}  // namespace

// A flushed NCCL group: its completion event.
struct NcclTransport::Group {
  cudaEvent_t done = nullptr;
  ~Group() {
    if (done) cudaEventDestroy(done);
  }
};

class NcclRequest final : public TransportRequest {
 public:
  NcclRequest(NcclTransport* t, std::shared_ptr<std::shared_ptr<NcclTransport::Group>> slot, size_t bytes)
      : t_(t), slot_(std::move(slot)), bytes_(bytes) {}
  absl::StatusOr<size_t> Wait(absl::Duration timeout) override {
    if (*slot_ == nullptr) {
      if (absl::Status s = t_->Flush(); !s.ok()) return s;
    }
    if (absl::Status s = WaitEvent((*slot_)->done, timeout, t_->comm_); !s.ok()) return s;
    return bytes_;
  }

 private:
  NcclTransport* t_;
  std::shared_ptr<std::shared_ptr<NcclTransport::Group>> slot_;
  size_t bytes_;
};

absl::StatusOr<std::string> NcclTransport::NewUniqueId() {
  ncclUniqueId id;
  if (absl::Status s = NcclError(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

absl::StatusOr<std::unique_ptr<NcclTransport>> NcclTransport::Create(int rank, int size, const std::string& unique_id,
                                                                     int device) {
  if (unique_id.size() != sizeof(ncclUniqueId)) return absl::InvalidArgumentError("bad NCCL unique id");
  if (rank < 0 || rank >= size) return absl::InvalidArgumentError("rank out of range");
  std::unique_ptr<NcclTransport> t(new NcclTransport());
  t->rank_ = rank;
  t->size_ = size;
  t->device_ = device;
  if (absl::Status s = CudaError(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  if (absl::Status s = CudaError(cudaStreamCreateWithFlags(&t->stream_, cudaStreamNonBlocking), "stream"); !s.ok())
    return s;
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  if (absl::Status s = NcclError(ncclCommInitRank(&t->comm_, size, id, rank), "ncclCommInitRank"); !s.ok()) return s;
  return t;
}

NcclTransport::~NcclTransport() {
  if (comm_ != nullptr) ncclCommDestroy(comm_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<std::unique_ptr<TransportRequest>> NcclTransport::Isend(int peer, uint64_t,
                                                                       absl::Span<const uint8_t> d) {
  if (peer < 0 || peer >= size_) return absl::InvalidArgumentError("peer out of range");
  auto slot = std::make_shared<std::shared_ptr<Group>>();
  pending_.push_back({Op{true, peer, const_cast<uint8_t*>(d.data()), d.size(), nullptr}, slot});
  return std::unique_ptr<TransportRequest>(new NcclRequest(this, slot, d.size()));
}

absl::StatusOr<std::unique_ptr<TransportRequest>> NcclTransport::Irecv(int peer, uint64_t, absl::Span<uint8_t> b) {
  if (peer < 0 || peer >= size_) return absl::InvalidArgumentError("peer out of range");
  auto slot = std::make_shared<std::shared_ptr<Group>>();
  pending_.push_back({Op{false, peer, b.data(), b.size(), nullptr}, slot});
  return std::unique_ptr<TransportRequest>(new NcclRequest(this, slot, b.size()));
}

absl::Status NcclTransport::Flush() {
  if (pending_.empty()) return absl::OkStatus();
  cudaSetDevice(device_);
  auto group = std::make_shared<Group>();
  if (absl::Status s = CudaError(cudaEventCreateWithFlags(&group->done, cudaEventDisableTiming), "event"); !s.ok())
    return s;
  ncclGroupStart();
  for (auto& [op, slot] : pending_) {
    const ncclResult_t r = op.send ? ncclSend(op.ptr, op.bytes, ncclUint8, op.peer, comm_, stream_)
                                   : ncclRecv(op.ptr, op.bytes, ncclUint8, op.peer, comm_, stream_);
    if (r != ncclSuccess) {
      ncclGroupEnd();
      pending_.clear();
      return NcclError(r, op.send ? "ncclSend" : "ncclRecv");
    }
  }
  if (absl::Status s = NcclError(ncclGroupEnd(), "ncclGroupEnd"); !s.ok()) return s;
  if (absl::Status s = CudaError(cudaEventRecord(group->done, stream_), "event record"); !s.ok()) return s;
  for (auto& [op, slot] : pending_) *slot = group;
  pending_.clear();
  return absl::OkStatus();
}

}  // namespace kvring
