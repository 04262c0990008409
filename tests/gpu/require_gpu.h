// Skipping a GPU test where no CUDA device is present (CI has none).
#pragma once

#include <cuda_runtime.h>

#include "gtest/gtest.h"

namespace kvring::gpu_testing {

inline bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace kvring::gpu_testing

#define KVRING_REQUIRE_GPU() \
  if (!::kvring::gpu_testing::HaveGpu()) GTEST_SKIP() << "no CUDA device"
