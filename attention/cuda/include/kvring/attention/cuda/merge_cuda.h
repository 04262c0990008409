// The exact merge of partial attention outputs (O, LSE) on the GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvring/attention/cuda/attention_views_cuda.h"

namespace kvring::cuda {

// out = exact merge of `num_parts` stacked partials
// (out_parts [num_parts][rows_heads][head_dim], lse_parts [num_parts][rows_heads]).
cudaError_t MergePartials(const float* out_parts, const float* lse_parts, int num_parts, int rows_heads, int head_dim,
                          OutputView out, cudaStream_t stream);
// acc <- merge(acc, other), in place.
cudaError_t MergeInto(OutputView acc, const float* other_out, const float* other_lse, int rows_heads, int head_dim,
                      cudaStream_t stream);

}  // namespace kvring::cuda
