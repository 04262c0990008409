// LoopbackTransport: the ranks of a group live in one process (one thread
// each, typically). Isend copies the bytes into the receiver's mailbox (or
// straight into a posted receive), so a send completes at once; Irecv
// completes when the matching message is there. Real queues, real copies:
// the ring algorithms' tests and the daemon's in-process mode use it.
#pragma once

#include <memory>
#include <vector>

#include "kvring/transport/transport.h"

namespace kvring {

class LoopbackHub;

class LoopbackTransport final : public Transport {
 public:
  // Creates a group of `size` connected transports; element i is rank i.
  static std::vector<std::unique_ptr<Transport>> CreateGroup(int size);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "loopback"; }
  absl::StatusOr<std::unique_ptr<TransportRequest>> Isend(int peer, uint64_t tag,
                                                          absl::Span<const uint8_t> data) override;
  absl::StatusOr<std::unique_ptr<TransportRequest>> Irecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override;

 private:
  LoopbackTransport(std::shared_ptr<LoopbackHub> hub, int rank, int size)
      : hub_(std::move(hub)), rank_(rank), size_(size) {}
  std::shared_ptr<LoopbackHub> hub_;
  int rank_, size_;
};

}  // namespace kvring
