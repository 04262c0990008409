#include "kvring/transport/nccl_transport.h"

#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvring/common/cuda_status.h"

namespace kvring {
namespace {

absl::Status NcclError(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}
absl::Status CudaError(cudaError_t e, const char* what) { return CudaStatus(e, what); }

// Polls `ev` until it completes or `timeout` passes.
absl::Status WaitEvent(cudaEvent_t ev, absl::Duration timeout, ncclComm_t comm) {
  const auto end = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaError(e, "waiting for a transfer");
    if (comm != nullptr) {
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm, &async);
      if (async != ncclSuccess && async != ncclInProgress) return NcclError(async, "NCCL communicator");
    }
    if (std::chrono::steady_clock::now() > end) return absl::DeadlineExceededError("GPU transfer timed out");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
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

// ------------------------------------------------------------ device loopback

class DeviceLoopbackHub {
 public:
  struct Event {
    cudaEvent_t ev = nullptr;
    ~Event() {
      if (ev) cudaEventDestroy(ev);
    }
  };
  struct Completion {
    std::shared_ptr<Event> ev;
    bool set = false;
    absl::Status status;
  };
  struct Pending {
    void* ptr;
    size_t bytes;
    std::shared_ptr<Completion> done;
  };
  using Key = std::tuple<int, int, uint64_t>;
  absl::Mutex mu;
  std::map<Key, std::deque<Pending>> sends ABSL_GUARDED_BY(mu), recvs ABSL_GUARDED_BY(mu);
};

namespace {
class LoopbackDevRequest final : public TransportRequest {
 public:
  LoopbackDevRequest(std::shared_ptr<DeviceLoopbackHub> hub, std::shared_ptr<DeviceLoopbackHub::Completion> c, size_t n)
      : hub_(std::move(hub)), c_(std::move(c)), n_(n) {}
  absl::StatusOr<size_t> Wait(absl::Duration timeout) override {
    const auto end = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
    cudaEvent_t ev = nullptr;
    for (;;) {
      {
        absl::MutexLock l(&hub_->mu);
        if (c_->set) {
          if (!c_->status.ok()) return c_->status;
          ev = c_->ev->ev;
          break;
        }
      }
      if (std::chrono::steady_clock::now() > end)
        return absl::DeadlineExceededError("device loopback: no matching message");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(end - std::chrono::steady_clock::now());
    if (absl::Status s = WaitEvent(ev, absl::Nanoseconds(std::max<int64_t>(0, left.count())), nullptr); !s.ok())
      return s;
    return n_;
  }

 private:
  std::shared_ptr<DeviceLoopbackHub> hub_;
  std::shared_ptr<DeviceLoopbackHub::Completion> c_;
  size_t n_;
};
}  // namespace

std::vector<std::unique_ptr<Transport>> DeviceLoopbackTransport::CreateGroup(int size, int device) {
  auto hub = std::make_shared<DeviceLoopbackHub>();
  std::vector<std::unique_ptr<Transport>> out;
  for (int r = 0; r < size; ++r) out.emplace_back(new DeviceLoopbackTransport(hub, r, size, device));
  return out;
}

DeviceLoopbackTransport::DeviceLoopbackTransport(std::shared_ptr<DeviceLoopbackHub> hub, int rank, int size, int device)
    : hub_(std::move(hub)), rank_(rank), size_(size), device_(device) {
  cudaSetDevice(device);
  cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
}

DeviceLoopbackTransport::~DeviceLoopbackTransport() {
  if (stream_) cudaStreamDestroy(stream_);
}

absl::StatusOr<std::unique_ptr<TransportRequest>> DeviceLoopbackTransport::Isend(int peer, uint64_t tag,
                                                                                 absl::Span<const uint8_t> data) {
  if (absl::Status s = CheckPeer(peer); !s.ok()) return s;
  auto done = std::make_shared<DeviceLoopbackHub::Completion>();
  absl::MutexLock l(&hub_->mu);
  auto& rq = hub_->recvs[{rank_, peer, tag}];
  if (!rq.empty()) {  // the receiver's stream does the copy; but the receiver is waiting: copy on ours
    DeviceLoopbackHub::Pending r = rq.front();
    rq.pop_front();
    cudaSetDevice(device_);
    absl::Status st =
        data.size() > r.bytes
            ? absl::OutOfRangeError("device loopback: message larger than the receive buffer")
            : CudaError(cudaMemcpyAsync(r.ptr, data.data(), data.size(), cudaMemcpyDeviceToDevice, stream_), "copy");
    auto ev = std::make_shared<DeviceLoopbackHub::Event>();
    cudaEventCreateWithFlags(&ev->ev, cudaEventDisableTiming);
    cudaEventRecord(ev->ev, stream_);
    for (auto* c : {r.done.get(), done.get()}) {
      c->ev = ev;
      c->status = st;
      c->set = true;
    }
    return std::unique_ptr<TransportRequest>(new LoopbackDevRequest(hub_, done, data.size()));
  }
  hub_->sends[{rank_, peer, tag}].push_back({const_cast<uint8_t*>(data.data()), data.size(), done});
  return std::unique_ptr<TransportRequest>(new LoopbackDevRequest(hub_, done, data.size()));
}

absl::StatusOr<std::unique_ptr<TransportRequest>> DeviceLoopbackTransport::Irecv(int peer, uint64_t tag,
                                                                                 absl::Span<uint8_t> buffer) {
  if (absl::Status s = CheckPeer(peer); !s.ok()) return s;
  auto done = std::make_shared<DeviceLoopbackHub::Completion>();
  absl::MutexLock l(&hub_->mu);
  auto& sq = hub_->sends[{peer, rank_, tag}];
  if (!sq.empty()) {
    DeviceLoopbackHub::Pending snd = sq.front();
    sq.pop_front();
    cudaSetDevice(device_);
    absl::Status st =
        snd.bytes > buffer.size()
            ? absl::OutOfRangeError("device loopback: message larger than the receive buffer")
            : CudaError(cudaMemcpyAsync(buffer.data(), snd.ptr, snd.bytes, cudaMemcpyDeviceToDevice, stream_), "copy");
    auto ev = std::make_shared<DeviceLoopbackHub::Event>();
    cudaEventCreateWithFlags(&ev->ev, cudaEventDisableTiming);
    cudaEventRecord(ev->ev, stream_);
    for (auto* c : {snd.done.get(), done.get()}) {
      c->ev = ev;
      c->status = st;
      c->set = true;
    }
    return std::unique_ptr<TransportRequest>(new LoopbackDevRequest(hub_, done, snd.bytes));
  }
  hub_->recvs[{peer, rank_, tag}].push_back({buffer.data(), buffer.size(), done});
  return std::unique_ptr<TransportRequest>(new LoopbackDevRequest(hub_, done, buffer.size()));
}

}  // namespace kvring
