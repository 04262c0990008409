// DeviceLoopbackTransport: ranks of one process sharing one GPU (threads),
// device buffers. A receive meets the oldest matching send (same peer and
// tag) and copies device to device on the receiver's stream; both requests
// complete when that copy does. Used to test the GPU rings with several
// ranks where NCCL refuses two ranks on one device.
// Thread safety: each rank's transport is used by its own thread; the ranks
// of a group share a hub (mutex-guarded).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string_view>
#include <vector>

#include "kvring/transport/transport.h"

namespace kvring {

class DeviceLoopbackHub;
class DeviceLoopbackTransport final : public Transport {
 public:
  static std::vector<std::unique_ptr<Transport>> CreateGroup(int size, int device);
  ~DeviceLoopbackTransport() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "device-loopback"; }
  BufferKind buffer_kind() const override { return BufferKind::kDevice; }
  absl::StatusOr<std::unique_ptr<TransportRequest>> Isend(int peer, uint64_t tag,
                                                          absl::Span<const uint8_t> data) override;
  absl::StatusOr<std::unique_ptr<TransportRequest>> Irecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override;

 private:
  DeviceLoopbackTransport(std::shared_ptr<DeviceLoopbackHub> hub, int rank, int size, int device);
  std::shared_ptr<DeviceLoopbackHub> hub_;
  int rank_, size_, device_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace kvring
