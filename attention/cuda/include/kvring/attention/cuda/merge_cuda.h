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

// Where a merge also writes its O in the engine's dtype (the model's
// attention output), beside the fp32 accumulator: dtype kNone (nothing),
// kF16 or kBf16 into `out` ([rows][q_heads][head_dim], device memory).
struct CastOutput {
  enum DType : int { kNone = 0, kF16 = 1, kBf16 = 2 };
  void* out = nullptr;
  DType dtype = kNone;
};

// For each of `rows` rows of acc (q_heads heads of head_dim each): acc row r
// <- merge of its own partial (unless `init`) and the partial rows
// parts[contrib[contrib_begin[r]]], ..., parts[contrib[contrib_begin[r+1]-1]]
// (parts_out [*][q_heads][head_dim], parts_lse [*][q_heads]). With `init`,
// acc's old contents are ignored and a row with no contribution becomes
// O = 0, LSE = -inf; without it, such a row is left as it is. With `cast`,
// every row's O (merged or left) is also written in cast's dtype.
// contrib_begin has rows + 1 entries; all four index arrays are device
// memory. The shards' partials of a pass-Q step, merged in one launch.
cudaError_t MergeRows(OutputView acc, int rows, const float* parts_out, const float* parts_lse,
                      const int32_t* contrib_begin, const int32_t* contrib, int q_heads, int head_dim, bool init,
                      cudaStream_t stream, CastOutput cast = {});

// The most index entries (rows + 1 + contributions) MergeRowsInline takes.
inline constexpr int kInlineCsrEntries = 960;

// MergeRows with its indexes in host memory, `csr` = contrib_begin
// (rows + 1 entries) then contrib, csr_entries in all (at most
// kInlineCsrEntries): they travel in the launch's parameters, so no copy
// to the device precedes the merge. csr null and csr_entries 0: no row has
// a contribution, any number of rows (with init: O = 0, LSE = -inf; without
// it, with cast: acc's O cast as it is).
cudaError_t MergeRowsInline(OutputView acc, int rows, const float* parts_out, const float* parts_lse,
                            const int32_t* csr, int csr_entries, int q_heads, int head_dim, bool init,
                            cudaStream_t stream, CastOutput cast = {});

}  // namespace kvring::cuda
