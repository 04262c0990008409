// Paged decode attention on the GPU (attention_views_cuda.h has the views
// and the output contract).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvring/attention/cuda/attention_views_cuda.h"

namespace kvring::cuda {

// Decode: few query rows per sequence, KV split across CTAs (flash-decoding)
// Rows per sequence: 1..64 (any); q_heads % kv_heads == 0; head_dim 64, 128
// or 256 (quantized pages at 256: the CUDA-core kernel).
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
// Quantized pages have three kernels (paged_decode_quant_cuda.cu,
// docs/QUANTIZED-DECODE.md): on sm_90 with pages of a multiple of 16 tokens
// and head_dim <= 128, kSmallGroups (tokens as the MMAs' rows; up to 8 (row,
// q head) vectors a kv head and sequence, which a decode step of most GQA
// models has) and kSixteenRows (16 vectors a CTA); otherwise a CUDA-core
// kernel. kAuto picks kSmallGroups where it serves, else kSixteenRows, else
// the CUDA-core one; an explicit choice that cannot serve the view returns
// cudaErrorNotSupported. Plain pages ignore the choice.
enum class QuantDecodeKernel : int32_t { kAuto = 0, kSixteenRows = 1, kSmallGroups = 2 };
inline constexpr int kMaxDecodeSplits = 1024;  // the fused merge keeps (splits + 1) x 16 weights in shared memory
int DefaultDecodeSplits(const QueryView& q, const PagedKvView& kv, int max_pages_per_seq, int sm_count);
size_t DecodeWorkspaceBytes(const QueryView& q, int num_splits, int head_dim);
size_t DecodeCounterBytes(const QueryView& q);
cudaError_t PagedDecode(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int num_splits,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream,
                        QuantDecodeKernel kernel = QuantDecodeKernel::kAuto);

}  // namespace kvring::cuda
