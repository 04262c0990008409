// CUDA partial attention over the HBM page pool (Hopper, sm_90).
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
// Queries are grouped by sequence (CSR). Only these header types cross into device code; the header needs nothing but
// the CUDA runtime.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kvring::cuda {

enum class KvType : int32_t { kBF16 = 0, kF16 = 1 };

struct PagedKvView {
  const void* pool = nullptr;  // base address of the page pool
  uint64_t page_stride = 0;    // bytes between consecutive pages
  int32_t block_tokens = 16, layers = 1, kv_heads = 8, head_dim = 128;
  KvType dtype = KvType::kBF16;  // of the queries, and of plain pages
  // Quantized pages (kv_encoding.h): codec 1 int8, 2 fp8-e4m3 (0: plain
  // pages of `dtype`); scales 0 per head, 1 per token, 2 K per channel and
  // V per token. A quantized page holds 1-byte codes in the block layout,
  // then the fp32 scales. Decode only (PagedPrefill refuses them).
  int32_t codec = 0, scales = 0;
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

// ---- decode: few query rows per sequence, KV split across CTAs (flash-decoding)
// Rows per sequence: 1..64 (any); q_heads % kv_heads == 0; head_dim 64 or 128.
// With num_splits > 1 the splits' partials go to `workspace` and the last
// CTA of each (sequence, kv head) to finish merges them into `out` (quantized
// pages: a second kernel merges). The workspace (DecodeWorkspaceBytes; none
// for one split) starts with the merge's counters, bytes
// [0, DecodeCounterBytes(q)), which must be zero when a call starts; every
// call leaves its own counters at zero but writes partials after them. So:
// zero the workspace once before its first use (cudaMemset), and before a
// call whose DecodeCounterBytes is larger than the previous call's on the
// same workspace, zero the counter bytes again (earlier partials may lie
// there). One call at a time per workspace. num_splits: 1..kMaxDecodeSplits; with more than one
// split the workspace, and on plain pages `out.out`, must be 16-byte aligned
// (the merge's bulk copies and float4 stores).
// The kernel is launched with programmatic dependent launch (it overlaps its
// launch with the previous kernel's tail, and the next kernel's with its own;
// with kv.tables_stable also its table reads and an L2 prefetch of each
// split's first KV).
// Plain (bf16/fp16) pages: a producer warp streams 16-token stages through a
// deep mbarrier ring (TMA boxes for pages of a multiple of 16 tokens on
// sm_90, cp.async gathers otherwise), four consumer warps take them in turn.
// Quantized pages have a kernel of their own (paged_decode_quant_cuda.cu).
inline constexpr int kMaxDecodeSplits = 1024;  // the fused merge keeps (splits + 1) x 16 weights in shared memory
int DefaultDecodeSplits(const QueryView& q, const PagedKvView& kv, int max_pages_per_seq, int sm_count);
size_t DecodeWorkspaceBytes(const QueryView& q, int num_splits, int head_dim);
size_t DecodeCounterBytes(const QueryView& q);
cudaError_t PagedDecode(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int num_splits,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream);

// ---- prefill: many query rows per sequence, on the tensor cores (bf16/fp16
// operands, fp32 accumulate), causal by absolute position; head_dim 64 or 128.
// Two kernels: kWgmma (Hopper warpgroup MMA fed by TMA, sm_90 only, pages of a
// multiple of 16 tokens, a 16-byte-aligned query array: a persistent kernel,
// one CTA an SM, whose producer warp streams Q and KV tiles through a 5-stage
// mbarrier ring to two consumer warpgroups of 64 rows) and kMmaSync (mma.sync
// m16n8k16, any sm_80+ device, any page size). kAuto takes kWgmma where it
// can serve the view; kWgmma where it cannot returns cudaErrorNotSupported.
enum class PrefillKernel : int32_t { kAuto = 0, kMmaSync = 1, kWgmma = 2 };
cudaError_t PagedPrefill(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                         cudaStream_t stream, PrefillKernel kernel = PrefillKernel::kAuto);

// ---- merge: out = exact merge of `num_parts` stacked partials
// (out_parts [num_parts][rows_heads][head_dim], lse_parts [num_parts][rows_heads]).
cudaError_t MergePartials(const float* out_parts, const float* lse_parts, int num_parts, int rows_heads, int head_dim,
                          OutputView out, cudaStream_t stream);
// acc <- merge(acc, other), in place.
cudaError_t MergeInto(OutputView acc, const float* other_out, const float* other_lse, int rows_heads, int head_dim,
                      cudaStream_t stream);

// Validates a view pair on the host (pointers non-null, shapes in range);
// returns a static message, or nullptr when fine.
const char* CheckViews(const QueryView& q, const PagedKvView& kv);

}  // namespace kvring::cuda

namespace kvring::cuda {
// Copies the `layer` slice ([K|V][kv_head][token][head_dim]) of each listed
// page into `dst`, one slice after another: the packed form a KV chunk takes
// on the wire, itself a page pool of one-layer pages (stride = slice bytes).
cudaError_t PackLayerPages(const PagedKvView& kv, const int32_t* page_ids, int num_pages, void* dst,
                           cudaStream_t stream);
// Bytes of one packed slice.
inline uint64_t LayerSliceBytes(const PagedKvView& kv) {
  return 2ull * kv.kv_heads * kv.block_tokens * kv.head_dim * 2;
}
// Fills dst[i] = i for i < n (page ids of a packed buffer).
cudaError_t Iota(int32_t* dst, int n, cudaStream_t stream);
}  // namespace kvring::cuda
