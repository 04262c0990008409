#include "kvring/transport/faulty_transport.h"

#include <vector>

namespace kvring {

void FaultyTransport::InjectOnSends(Fault fault, int count, absl::Duration delay) {
  absl::MutexLock l(&mu_);
  fault_ = fault;
  remaining_ = count;
  delay_ = delay;
}

namespace {
class DoneRequest final : public TransportRequest {
 public:
  explicit DoneRequest(absl::StatusOr<size_t> r) : r_(std::move(r)) {}
  absl::StatusOr<size_t> Wait(absl::Duration) override { return r_; }

 private:
  absl::StatusOr<size_t> r_;
};
// Keeps a corrupted copy alive until the inner send completes.
class CopyRequest final : public TransportRequest {
 public:
  CopyRequest(std::vector<uint8_t> copy, std::unique_ptr<TransportRequest> inner)
      : copy_(std::move(copy)), inner_(std::move(inner)) {}
  absl::StatusOr<size_t> Wait(absl::Duration t) override { return inner_->Wait(t); }

 private:
  std::vector<uint8_t> copy_;
  std::unique_ptr<TransportRequest> inner_;
};
}  // namespace

absl::StatusOr<std::unique_ptr<TransportRequest>> FaultyTransport::Isend(int peer, uint64_t tag,
                                                                         absl::Span<const uint8_t> data) {
  Fault f = Fault::kNone;
  absl::Duration delay;
  {
    absl::MutexLock l(&mu_);
    if (remaining_ > 0) {
      f = fault_;
      delay = delay_;
      --remaining_;
    }
  }
  if (f != Fault::kNone) ++injected_;
  switch (f) {
    case Fault::kNone:
      return inner_->Isend(peer, tag, data);
    case Fault::kFail:
      return absl::UnavailableError("injected fault: send failed");
    case Fault::kDelay:
      absl::SleepFor(delay);
      return inner_->Isend(peer, tag, data);
    case Fault::kDrop:
      return std::unique_ptr<TransportRequest>(new DoneRequest(data.size()));
    case Fault::kCorrupt: {
      std::vector<uint8_t> copy(data.begin(), data.end());
      if (!copy.empty()) copy[copy.size() / 2] ^= 0x5a;
      auto inner = inner_->Isend(peer, tag, copy);
      if (!inner.ok()) return inner.status();
      return std::unique_ptr<TransportRequest>(new CopyRequest(std::move(copy), std::move(*inner)));
    }
  }
  return absl::InternalError("unreachable");
}

}  // namespace kvring
