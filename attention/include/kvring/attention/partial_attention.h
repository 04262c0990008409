// PartialAttention: exact attention of queries over the KV blocks a shard
// holds, returning (O, LSE) so partials from many shards merge exactly
// (merge.h).
//
// Supports GQA/MQA (q_heads a multiple of kv_heads; q head h reads kv head
// h / (q_heads / kv_heads)), causal masking by absolute position, an optional
// sliding window, batches of sequences (seq_ids), fp32/fp16/bf16 queries and
// KV, and quantized KV (int8/fp8 codes with per-block scales, dequantized
// tile by tile inside the kernel). Accumulates in fp32 with an online
// softmax. Rows that see no key get O = 0 and LSE = -inf.
//
// Thread safety: reentrant; `pool` (optional) spreads the work over its
// threads. On error nothing is written.
#pragma once

#include "absl/status/status.h"
#include "kvring/attention/tensors.h"
#include "kvring/common/thread_pool.h"

namespace kvring {

// Checks shapes, dtypes, layer index, sequence ids and block references.
absl::Status ValidateAttention(const AttentionOptions& options, const QueryTensor& q, const PagedKv& kv);

absl::Status PartialAttention(const AttentionOptions& options, const QueryTensor& q, const PagedKv& kv,
                              PartialOutput out, ThreadPool* pool = nullptr);

// Floating-point operations PartialAttention performs (4 * head_dim per
// query head and visible key), for throughput reports.
double AttentionFlops(const AttentionOptions& options, const QueryTensor& q, const PagedKv& kv);

}  // namespace kvring
