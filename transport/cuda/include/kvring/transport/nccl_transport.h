// NcclTransport: the Transport interface between GPU ranks over NCCL
// (one process per GPU). Buffers are device memory (buffer_kind() kDevice).
//
// NCCL matches point-to-point messages by order, not by tag: between two
// ranks, the k-th send of one side meets the k-th receive posted by the
// other, so both sides must post in the same order (the ring algorithms do);
// tags are ignored. Sizes must match exactly. Posted operations start at
// Flush() as one NCCL group on the transport's stream (so a step's send and
// receive cannot deadlock); Wait() flushes first if needed and then polls
// the group's CUDA event, giving DEADLINE_EXCEEDED after the timeout and
// the NCCL error when the communicator failed.
// Thread safety: one thread at a time per transport (NCCL communicators are
// not thread-safe).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <vector>

#include "kvring/transport/transport.h"

namespace kvring {

class NcclTransport final : public Transport {
 public:
  // A new NCCL unique id (rank 0 makes it and shares the bytes).
  static absl::StatusOr<std::string> NewUniqueId();
  // Joins the communicator as `rank` of `size` on CUDA device `device`.
  static absl::StatusOr<std::unique_ptr<NcclTransport>> Create(int rank, int size, const std::string& unique_id,
                                                               int device);
  ~NcclTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "nccl"; }
  BufferKind buffer_kind() const override { return BufferKind::kDevice; }
  absl::StatusOr<std::unique_ptr<TransportRequest>> Isend(int peer, uint64_t tag,
                                                          absl::Span<const uint8_t> data) override;
  absl::StatusOr<std::unique_ptr<TransportRequest>> Irecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override;
  absl::Status Flush() override;
  cudaStream_t stream() const { return stream_; }

 private:
  struct Group;
  struct Op {
    bool send;
    int peer;
    void* ptr;
    size_t bytes;
    std::shared_ptr<Group>* slot;
  };
  NcclTransport() = default;
  friend class NcclRequest;
  int rank_ = 0, size_ = 1, device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<std::pair<Op, std::shared_ptr<std::shared_ptr<Group>>>> pending_;
};

}  // namespace kvring
