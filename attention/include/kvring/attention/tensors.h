// Plain views of the tensors attention reads and writes. Views do not own
// memory; the caller keeps it alive for the duration of a call.
//
// Conventions (all row-major, contiguous):
//   queries   [num_rows, q_heads, head_dim]   fp32 / fp16 / bf16
//   positions [num_rows] int64: absolute position of each query token
//   seq_ids   [num_rows] uint32: the sequence of the batch each row attends to
//   output    [num_rows, q_heads, head_dim]   fp32
//   lse       [num_rows, q_heads]             fp32, natural log; -inf when a
//             row saw no key (its output row is then all zeros)
// KV comes in blocks of the store's layout ([layer][K|V][kv_head][token][dim]),
// grouped by sequence in CSR form: sequence s owns blocks
// [seq_begin[s], seq_begin[s+1]).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kvring/layout/block_layout.h"
#include "kvring/layout/kv_encoding.h"

namespace kvring {

struct QueryTensor {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  uint32_t num_rows = 0;
  uint32_t q_heads = 0;
  uint32_t head_dim = 0;
  const int64_t* positions = nullptr;  // required when causal or windowed
  const uint32_t* seq_ids = nullptr;   // nullptr: every row attends to sequence 0
};

struct KvBlockRef {
  const uint8_t* data = nullptr;  // one block's payload
  int64_t start_pos = 0;          // absolute position of the block's token 0
  uint32_t num_tokens = 0;        // valid tokens, 1..layout.block_tokens
};

struct PagedKv {
  BlockLayout layout;
  KvEncoding encoding;
  absl::Span<const KvBlockRef> blocks;
  absl::Span<const uint32_t> seq_begin;  // num_sequences + 1 offsets into blocks
  uint32_t num_sequences() const { return seq_begin.empty() ? 0 : static_cast<uint32_t>(seq_begin.size() - 1); }
};

struct AttentionOptions {
  uint32_t layer = 0;
  // Softmax scale; 0 means 1/sqrt(head_dim).
  float softmax_scale = 0;
  // A query at position p sees keys at positions <= p.
  bool causal = true;
  // With window w > 0, a query at p sees keys at positions > p - w only.
  int64_t window = 0;
};

struct PartialOutput {
  float* out = nullptr;  // [num_rows, q_heads, head_dim]
  float* lse = nullptr;  // [num_rows, q_heads]
};

struct ConstPartial {
  const float* out = nullptr;
  const float* lse = nullptr;
};

// An owned (O, LSE) pair.
struct PartialResult {
  uint32_t num_rows = 0, q_heads = 0, head_dim = 0;
  std::vector<float> out, lse;

  PartialResult() = default;
  PartialResult(uint32_t rows, uint32_t heads, uint32_t dim)
      : num_rows(rows), q_heads(heads), head_dim(dim), out(size_t{rows} * heads * dim), lse(size_t{rows} * heads) {}
  PartialOutput view() { return {out.data(), lse.data()}; }
  ConstPartial cview() const { return {out.data(), lse.data()}; }
};

}  // namespace kvring
