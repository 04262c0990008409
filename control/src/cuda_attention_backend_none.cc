// cuda_attention_backend.h in a build without CUDA.
#include "kvring/control/cuda_attention_backend.h"

namespace kvring {

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaAttentionBackend(const CudaBackendOptions&, BlockStore*,
                                                                           ThreadPool*) {
  return absl::UnimplementedError(
      "this kvringd was built without CUDA (configure with -DKVRING_CUDA=ON on a machine with nvcc)");
}

absl::Status CudaRegisterHostMemory(void*, size_t) { return absl::UnimplementedError("built without CUDA"); }
void CudaUnregisterHostMemory(void*) {}

}  // namespace kvring
