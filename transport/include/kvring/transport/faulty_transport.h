// FaultyTransport: wraps a real Transport and injects faults on demand —
// fail, delay, drop or corrupt the next N sends — for tests of the paths
// that must survive them. Thread-safe.
#pragma once

#include <atomic>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "kvring/transport/transport.h"

namespace kvring {

class FaultyTransport final : public Transport {
 public:
  enum class Fault { kNone, kFail, kDelay, kDrop, kCorrupt };
  explicit FaultyTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}

  // The next `count` Isend calls get `fault` (kDelay waits `delay` first).
  void InjectOnSends(Fault fault, int count, absl::Duration delay = absl::ZeroDuration());
  int faults_injected() const { return injected_.load(); }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view name() const override { return "faulty"; }
  BufferKind buffer_kind() const override { return inner_->buffer_kind(); }
  absl::StatusOr<std::unique_ptr<TransportRequest>> Isend(int peer, uint64_t tag,
                                                          absl::Span<const uint8_t> data) override;
  absl::StatusOr<std::unique_ptr<TransportRequest>> Irecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override {
    return inner_->Irecv(peer, tag, buffer);
  }

 private:
  std::unique_ptr<Transport> inner_;
  absl::Mutex mu_;
  Fault fault_ ABSL_GUARDED_BY(mu_) = Fault::kNone;
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration delay_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> injected_{0};
};

}  // namespace kvring
