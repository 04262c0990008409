// CUDA errors as absl::Status, one mapping for every CUDA module of kvring.
//
//   cudaSuccess               -> OK
//   cudaErrorMemoryAllocation -> RESOURCE_EXHAUSTED (device or pinned memory is full)
//   anything else             -> INTERNAL
// The message names the operation, the error's name and its description,
// e.g. "cudaMemcpyAsync of the queries: cudaErrorIllegalAddress (an illegal
// memory access was encountered)".
//
// CudaErrorIsSticky: errors after which the CUDA context is unusable (every
// later call fails the same way); a process meeting one must exit to
// recover (cudaGetLastError does not clear them). Header-only; pure.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvring {

inline absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

inline bool CudaErrorIsSticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

}  // namespace kvring
