// A kernel that writes through a null pointer: poisons the CUDA context
// (gpu_node_test's death test, in a child process of its own).
#include <cuda_runtime.h>

namespace {
__global__ void WriteThroughNull(int* p) { p[threadIdx.x] = 1; }
}  // namespace

extern "C" cudaError_t KvringTestLaunchFault() {
  WriteThroughNull<<<1, 32>>>(nullptr);
  return cudaGetLastError();
}
