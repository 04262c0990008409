// Waiting for a CUDA event with a timeout, for the GPU transports' requests
// (internal to transport/cuda).
#pragma once

#include <cuda_runtime.h>

#include <functional>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvring::transport_cuda {

// Polls `ev` (sleeping 20 us between polls) until it completes (OK), fails
// (the CUDA error as a Status), `failed` returns an error (that error), or
// `timeout` passes (DEADLINE_EXCEEDED).
absl::Status WaitEvent(cudaEvent_t ev, absl::Duration timeout, const std::function<absl::Status()>& failed = nullptr);

}  // namespace kvring::transport_cuda
