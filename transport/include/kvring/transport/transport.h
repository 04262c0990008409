// Transport: tagged point-to-point messages between the ranks of a group.
//
// One interface, several fabrics: LoopbackTransport (in-process, host
// memory; loopback_transport.h), FaultyTransport (a wrapper that injects
// faults, for tests), NcclTransport (GPU memory between GPU ranks over NCCL)
// and DeviceLoopbackTransport (GPU memory between ranks of one process). The
// ring algorithms (attention/ring/, kvring/attention/ring/ring.h) run unchanged on any of them. (There is
// no UCX Transport: across nodes, the daemons' UCX plane is request/reply,
// ucx_rpc.h, and pass-Q needs no ring between nodes.)
//
// Contract:
//  - Messages from one sender to one receiver with the same tag arrive in the
//    order they were sent. Different (peer, tag) pairs are independent.
//  - Isend: `data` must stay valid and unchanged until the request completes.
//  - Irecv: the matching message must fit `buffer` (OUT_OF_RANGE otherwise);
//    Wait() returns the received size.
//  - Wait(timeout) returns DEADLINE_EXCEEDED when the operation has not
//    completed in time; the request may then be waited on again. A request
//    destroyed before completion cancels the operation when the fabric can
//    (loopback, UCX) and otherwise waits for it to finish.
//  - UNAVAILABLE when the peer is gone.
//  - Memory: the buffer kinds a transport accepts are stated by memory_kind()
//    (host memory for loopback/UCX, device memory for NCCL).
// Thread safety: a Transport may be used from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvring {

class TransportRequest {
 public:
  virtual ~TransportRequest() = default;
  // Bytes sent or received.
  virtual absl::StatusOr<size_t> Wait(absl::Duration timeout) = 0;
};

enum class BufferKind { kHost, kDevice };

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view name() const = 0;
  virtual BufferKind buffer_kind() const { return BufferKind::kHost; }

  virtual absl::StatusOr<std::unique_ptr<TransportRequest>> Isend(int peer, uint64_t tag,
                                                                  absl::Span<const uint8_t> data) = 0;
  virtual absl::StatusOr<std::unique_ptr<TransportRequest>> Irecv(int peer, uint64_t tag,
                                                                  absl::Span<uint8_t> buffer) = 0;

  // Starts the operations posted so far. Fabrics that batch operations
  // (NCCL runs a posted send/receive set as one group) start them here;
  // others start each at post time and ignore this. Callers post a step's
  // receives and sends, then Flush(), then compute, then Wait().
  virtual absl::Status Flush() { return absl::OkStatus(); }

  // Blocking conveniences over Isend/Irecv.
  absl::Status Send(int peer, uint64_t tag, absl::Span<const uint8_t> data, absl::Duration timeout);
  absl::StatusOr<size_t> Recv(int peer, uint64_t tag, absl::Span<uint8_t> buffer, absl::Duration timeout);

 protected:
  absl::Status CheckPeer(int peer) const;
};

}  // namespace kvring
