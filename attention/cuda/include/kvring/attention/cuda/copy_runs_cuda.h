// Many device-to-device copies in one kernel launch: a pass-Q step's rows
// gathered from the engine's tensors into the exchange buffer (queries, K
// and V of every node's job), which as cudaMemcpyAsync calls cost one API
// call each on the engine's thread.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvring::cuda {

struct CopyRun {
  void* dst = nullptr;
  const void* src = nullptr;
  uint64_t bytes = 0;
};

// Runs a launch carries in its parameters; more take more launches.
inline constexpr int kCopyRunsPerLaunch = 48;

// Copies runs[0, n) (device memory of this context, or memory mapped into
// it; runs must not overlap each other's destinations), in order on
// `stream` after its earlier work: one launch per kCopyRunsPerLaunch runs.
// `runs` is host memory, read before the call returns. Runs whose pointers
// and size are 16-byte aligned copy 16 bytes a thread, others 1.
cudaError_t CopyRuns(const CopyRun* runs, int n, cudaStream_t stream);

}  // namespace kvring::cuda
