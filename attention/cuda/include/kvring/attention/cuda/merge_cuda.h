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

// For each of `rows` rows of acc (q_heads heads of head_dim each): acc row r
// <- merge of its own partial (unless `init`) and the partial rows
// parts[contrib[contrib_begin[r]]], ..., parts[contrib[contrib_begin[r+1]-1]]
// (parts_out [*][q_heads][head_dim], parts_lse [*][q_heads]). With `init`,
// acc's old contents are ignored and a row with no contribution becomes
// O = 0, LSE = -inf; without it, such a row is left as it is.
// contrib_begin has rows + 1 entries; all four index arrays are device
// memory. The shards' partials of a pass-Q step, merged in one launch.
cudaError_t MergeRows(OutputView acc, int rows, const float* parts_out, const float* parts_lse,
                      const int32_t* contrib_begin, const int32_t* contrib, int q_heads, int head_dim, bool init,
                      cudaStream_t stream);

}  // namespace kvring::cuda
