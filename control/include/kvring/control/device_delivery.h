// DeviceDelivery: a GPU node's access to the GPU memory of a caller on the
// same host (CUDA IPC): Get payloads copied straight into it (kvring.proto
// DevicePlace), and an Attend's queries, appended K/V and output read and
// written there by the node's kernels (kvring.proto DeviceExchange).
//
// The caller exports each destination allocation as an IPC handle. The node
// maps it (kept: a mapping costs about a millisecond, and an engine's KV pool
// is one allocation reused by every call; at most `max_mapped` stay, least
// recently used closed first), checks every copy against the range it really
// mapped (the driver's, not the caller's word), and copies host -> device on
// the calling thread's own stream. A Batch's copies are queued as they are
// added and run while the caller goes on; Finish waits for all of them, so a
// reply sent after it means "the bytes are there". A Get only writes the
// caller's memory; an Attend reads the regions the caller named as its
// inputs (Region), never anything outside the allocation it mapped, and
// where the caller did not wait for its inputs, waits for the event it names
// (InputsReady; opened events are kept, at most max_events, LRU).
//
// Errors: a handle that does not open is FAILED_PRECONDITION (the caller
// falls back to payloads); a copy outside its allocation is INVALID_ARGUMENT
// (nothing is copied for it); a CUDA error is INTERNAL, and one that poisons
// the context also calls Options::on_fatal (the daemon then exits cleanly
// for its supervisor).
//
// A mapping kept here may hold the caller's allocation alive after the caller
// frees it, until it is closed (LRU or the node's exit): bounded by
// max_mapped allocations, and an engine's caching allocator rarely frees.
//
// In a build without CUDA, Create() returns UNIMPLEMENTED.
// Thread-safe: Begin and batches on different threads run concurrently; one
// Batch is used by one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvring {

struct DeviceDeliveryOptions {
  // The node's CUDA device (its --gpu). Default: 0.
  int device = 0;
  // Most caller allocations kept mapped at once. Default: 32.
  size_t max_mapped = 32;
  // Most caller events (CUDA IPC) kept open at once. Default: 256.
  size_t max_events = 256;
  // Called once with the error when a copy leaves the context unusable.
  std::function<void(const absl::Status&)> on_fatal;
};

class DeviceDelivery {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceDelivery>> Create(DeviceDeliveryOptions options);
  virtual ~DeviceDelivery() = default;

  class Batch {
   public:
    // Waits for the copies started (the sources may then go).
    virtual ~Batch() = default;
    // Starts copying `src` (host memory; pinned for an asynchronous copy)
    // to `offset` bytes into allocation `allocation` (an index into the
    // handles given to Begin).
    virtual absl::Status Add(uint32_t allocation, uint64_t offset, absl::Span<const uint8_t> src) = 0;
    // Waits until every added copy has landed.
    virtual absl::Status Finish() = 0;
    // The mapped address of `bytes` bytes at `offset` into allocation
    // `allocation`, for the node's own kernels and copies; valid while the
    // batch lives. INVALID_ARGUMENT outside the mapped range.
    virtual absl::StatusOr<uint8_t*> Region(uint32_t allocation, uint64_t offset, uint64_t bytes) = 0;
    // Copies device bytes (this process's or mapped) into host memory, now
    // (after the InputsReady event, if one was opened).
    virtual absl::Status Read(const uint8_t* device_src, absl::Span<uint8_t> dst) = 0;
    // Opens (or finds open) the caller's event (cudaIpcEventHandle_t bytes)
    // that completes once the inputs are written: a cudaEvent_t valid while
    // the batch lives. FAILED_PRECONDITION if it cannot be opened here.
    virtual absl::StatusOr<void*> InputsReady(const std::string& event_handle) = 0;
  };
  // Maps (or finds mapped) every handle (cudaIpcMemHandle_t bytes).
  virtual absl::StatusOr<std::unique_ptr<Batch>> Begin(absl::Span<const std::string> handles) = 0;
};

}  // namespace kvring
