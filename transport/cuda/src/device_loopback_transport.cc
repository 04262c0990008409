#include "kvring/transport/device_loopback_transport.h"

#include <chrono>
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
absl::Status CudaError(cudaError_t e, const char* what) { return CudaStatus(e, what); }
}  // namespace

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
    if (absl::Status s = transport_cuda::WaitEvent(ev, absl::Nanoseconds(std::max<int64_t>(0, left.count()))); !s.ok())
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
