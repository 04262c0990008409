// The Attend step's shared vocabulary: what one step on one layer looks like,
// in the same types from the engine's client to the kernels' launch.
//  - StepShape: the query side (rows, heads, head_dim, the queries' dtype)
//    and the attention options. The client derives it from its AttendStep,
//    the node's wire layer parses it into AttendBatch, the node core hands it
//    to a backend in StepPlan, and the backends size their buffers and build
//    the kernels' views from it. Its sizes are the one place a step's query,
//    output and LSE bytes are computed.
//  - CheckStepShape: the rules every step satisfies, checked where a step
//    enters (the client before it routes, the node when it parses a
//    request), with the same messages on both sides.
//  - BlockRange: a run of a sequence's block indices.
// The KV side is the sequence's BlockLayout and KvEncoding (kvring/layout).
//
// Plain values: no thread-safety concerns beyond those of any struct.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kvring/attention/tensors.h"
#include "kvring/layout/block_layout.h"

namespace kvring {

// Most query heads a step may carry.
inline constexpr uint32_t kMaxQHeads = 1024;

struct StepShape {
  AttentionOptions options;  // layer, softmax scale, causal, window
  uint32_t num_rows = 0;     // query rows of the whole step
  uint32_t q_heads = 0, head_dim = 0;
  DType q_dtype = DType::kBF16;

  // One query row's elements (all heads); one row of O has as many floats.
  constexpr size_t row_elems() const { return size_t{q_heads} * head_dim; }
  // One query row in q_dtype.
  constexpr size_t query_row_bytes() const { return row_elems() * DTypeSize(q_dtype); }
  // One row of a partial: O (fp32) and its LSE (one fp32 per head).
  constexpr size_t partial_row_bytes() const { return (row_elems() + q_heads) * sizeof(float); }
  // The whole step's queries, O and LSE.
  constexpr uint64_t query_bytes() const { return uint64_t{num_rows} * query_row_bytes(); }
  constexpr uint64_t out_floats() const { return uint64_t{num_rows} * row_elems(); }
  constexpr uint64_t lse_floats() const { return uint64_t{num_rows} * q_heads; }
};

// InvalidArgument naming the first rule `shape` breaks: q_heads in [1, 1024],
// head_dim a multiple of 8 in [8, 512], queries in f32/f16/bf16, a layer
// below kMaxLayers, window >= 0, a finite softmax_scale >= 0; and, with the
// sequences' `layout` (null: not known here), the layout's head_dim, q_heads
// a multiple of its kv_heads, and a layer it has. num_rows is not checked
// (its limit is the caller's).
absl::Status CheckStepShape(const StepShape& shape, const BlockLayout* layout);

// [begin, end) of a sequence's block indices.
struct BlockRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
};

}  // namespace kvring
