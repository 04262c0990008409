// CUDA IPC helpers shared by the client (which exports its destinations) and
// the node (which maps them): the allocation a device pointer lies in, and a
// memory handle as bytes for the wire.
//
// AllocationOf: the base and size of the cudaMalloc allocation holding `p`
// (the driver's cuMemGetAddressRange, reached through the runtime's entry
// point so that nothing links libcuda directly: binaries still start on a
// host without a driver). Works for IPC-mapped pointers too, which is how a
// node learns the true size of what a handle mapped. Makes the allocation's
// device current on the calling thread.
//
// Header-only; thread-safe (the entry point is looked up once).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/statusor.h"
#include "kvring/common/cuda_status.h"
#include "kvring/common/status_macros.h"

namespace kvring {

struct DeviceAllocationRange {
  uintptr_t base = 0;
  size_t bytes = 0;
};

inline absl::StatusOr<DeviceAllocationRange> AllocationOf(const void* p) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<Fn>(nullptr);
    }
    return reinterpret_cast<Fn>(f);
  }();
  if (fn == nullptr) return absl::UnimplementedError("the CUDA driver has no cuMemGetAddressRange");
  // A driver call needs a context current on this thread, and a thread the
  // runtime has not used yet has none: make the owner's primary context
  // current (cudaSetDevice does) first.
  cudaPointerAttributes a;
  if (cudaError_t e = cudaPointerGetAttributes(&a, p); e != cudaSuccess || a.type != cudaMemoryTypeDevice) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError("not device memory of this process");
  }
  KVRING_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(a.device), "cudaSetDevice for the allocation's device"));
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (CUresult r = fn(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)); r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrCat("not in a device allocation (cuMemGetAddressRange: error ", static_cast<int>(r), ")"));
  }
  return DeviceAllocationRange{static_cast<uintptr_t>(base), bytes};
}

inline std::string IpcHandleBytes(const cudaIpcMemHandle_t& h) {
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

inline absl::StatusOr<cudaIpcMemHandle_t> IpcHandleFromBytes(const std::string& b) {
  cudaIpcMemHandle_t h;
  if (b.size() != sizeof(h)) {
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC handle has ", sizeof(h), " bytes, not ", b.size()));
  }
  std::memcpy(&h, b.data(), sizeof(h));
  return h;
}

}  // namespace kvring
