// The views every CUDA attention launcher takes (Hopper, sm_90).
//
// Plain views and launchers (CUTLASS/FlashInfer style): no allocation, every
// launcher takes a stream and returns cudaError_t; work is asynchronous on
// that stream and complete when the stream is. Outputs are the exact-merge
// pair of kvring: O fp32 [rows, q_heads, head_dim] and LSE fp32 [rows,
// q_heads] in the natural log (-inf and O = 0 for a row that sees no key),
// the same contract as the CPU PartialAttention (attention/partial_attention.h).
//
// KV pages use the block layout [layer][K|V][kv_head][token][head_dim] in
// bf16 or fp16, or int8/fp8 codes with per-block scales (decode). A sequence is a list of pages, all full but the last;
// each page carries the absolute position of its token 0, so a shard may hold any subset of a sequence's blocks.
// Queries are grouped by sequence (CSR). Only these header types cross into device code; the header needs the CUDA
// runtime and the header-only block layout (cache/layout: the encoding's types, the same on the host and the device).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvring/layout/kv_encoding.h"

namespace kvring::cuda {

enum class KvType : int32_t { kBF16 = 0, kF16 = 1 };

// The head dims the kernels are built for (CheckViews refuses the others).
constexpr bool KernelsTakeHeadDim(int d) { return d == 64 || d == 128 || d == 256; }

struct PagedKvView {
  const void* pool = nullptr;  // base address of the page pool
  uint64_t page_stride = 0;    // bytes between consecutive pages
  int32_t block_tokens = 16, layers = 1, kv_heads = 8, head_dim = 128;
  KvType dtype = KvType::kBF16;  // of the queries, and of plain pages
  // Quantized pages (kvring/layout/kv_encoding.h): 1-byte codes in the
  // block layout, then the fp32 scales; plain pages (KvCodec::kPlain) hold
  // `dtype`. Decode and prefill (PagedPrefill: the mma.sync kernel, kWgmma
  // refuses them).
  KvEncoding encoding;
  int32_t layer = 0;                        // the layer to attend over
  const int32_t* page_ids = nullptr;        // [listed pages] pool page of each listed block
  const int32_t* page_pos = nullptr;        // [listed pages] absolute position of each block's token 0
  const int32_t* seq_page_begin = nullptr;  // [num_seqs + 1] CSR into page_ids
  const int32_t* seq_tokens = nullptr;      // [num_seqs] valid tokens of each sequence's listed pages
  int32_t num_seqs = 0;
  // The caller's promise that the tables (page_ids, page_pos, seq_page_begin,
  // seq_tokens, and the query view's seq_row_begin) are not written by any
  // kernel that may still run when this launch starts: they were written
  // before the stream's previous kernel began (e.g. copied from the host,
  // or by a kernel the stream has since synchronized with through a copy or
  // an event). The plain-page decode kernel then reads them, and prefetches
  // the first KV of each split into L2, while the previous kernel drains
  // (programmatic dependent launch); it still reads queries and KV only
  // after that kernel completed. False: nothing is read before the wait.
  // (Ignored by prefill and by quantized pages.)
  bool tables_stable = false;
};

struct QueryView {
  const void* q = nullptr;                 // [num_rows, q_heads, head_dim], dtype of the KV
  const int32_t* positions = nullptr;      // [num_rows] absolute positions
  const int32_t* seq_row_begin = nullptr;  // [num_seqs + 1] rows grouped by sequence
  int32_t num_rows = 0, q_heads = 0;
  int32_t max_rows_per_seq = 1;  // bound used for launch shapes
};

struct OutputView {
  float* out = nullptr;  // [num_rows, q_heads, head_dim]
  float* lse = nullptr;  // [num_rows, q_heads], natural log
};

struct AttnParams {
  float softmax_scale = 0;  // 0: 1/sqrt(head_dim)
  bool causal = true;
  int32_t window = 0;  // > 0: keys at positions > p - window only
};

// Validates a view pair on the host (pointers non-null, shapes in range);
// returns a static message, or nullptr when fine.
const char* CheckViews(const QueryView& q, const PagedKvView& kv);

}  // namespace kvring::cuda
