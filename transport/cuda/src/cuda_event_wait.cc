#include "cuda_event_wait.h"

#include <chrono>
#include <thread>

#include "kvring/common/cuda_status.h"

namespace kvring::transport_cuda {

absl::Status WaitEvent(cudaEvent_t ev, absl::Duration timeout, const std::function<absl::Status()>& failed) {
  const auto end = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaStatus(e, "waiting for a transfer");
    if (failed) {
      if (absl::Status s = failed(); !s.ok()) return s;
    }
    if (std::chrono::steady_clock::now() > end) return absl::DeadlineExceededError("GPU transfer timed out");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace kvring::transport_cuda
