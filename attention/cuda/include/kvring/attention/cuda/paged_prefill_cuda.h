// Paged prefill attention on the GPU (attention_views_cuda.h has the views
// and the output contract).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvring/attention/cuda/attention_views_cuda.h"

namespace kvring::cuda {

// Prefill: many query rows per sequence, on the tensor cores (bf16/fp16
// operands, fp32 accumulate), causal by absolute position; head_dim 64, 128
// or 256 (256: kMmaSync only, with 64-row tiles; kWgmma refuses it).
// Two kernels: kWgmma (Hopper warpgroup MMA fed by TMA, sm_90 only, pages of a
// multiple of 16 tokens, a 16-byte-aligned query array: a persistent kernel,
// one CTA an SM, whose producer warp streams Q and KV tiles through a 5-stage
// mbarrier ring to two consumer warpgroups of 64 rows) and kMmaSync (mma.sync
// m16n8k16, any sm_80+ device, any page size). kAuto takes kWgmma where it
// can serve the view; kWgmma where it cannot returns cudaErrorNotSupported.
// Quantized pages (kv.encoding quantized) run kMmaSync with the tile's codes
// dequantized in shared memory (kWgmma: cudaErrorNotSupported).
enum class PrefillKernel : int32_t { kAuto = 0, kMmaSync = 1, kWgmma = 2 };
cudaError_t PagedPrefill(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                         cudaStream_t stream, PrefillKernel kernel = PrefillKernel::kAuto);

// Prefill over quantized pages through the 16-bit kernels: the codes of
// kv.layer of every listed page (listed_pages: the view's page list,
// seq_page_begin[num_seqs] entries) are dequantized into `workspace`
// (code x scale rounded to the queries' dtype, as the quantized kernel
// rounds them) and PagedPrefill runs over that plain copy with `kernel`
// (kAuto: wgmma on sm_90): one pass over the codes, then the bf16 kernel's
// speed. Same results as PagedPrefill over the codes, within the kernels'
// rounding. The workspace: DequantizedPrefillWorkspaceBytes (a one-layer
// 16-bit page a listed page, and their ids), 256-byte aligned (as cudaMalloc
// gives), not used by another call until this one completes on `stream`.
// Plain pages: PagedPrefill (no workspace needed).
size_t DequantizedPrefillWorkspaceBytes(const PagedKvView& kv, int listed_pages);
cudaError_t PagedPrefillDequantized(const AttnParams& p, const QueryView& q, const PagedKvView& kv, int listed_pages,
                                    void* workspace, size_t workspace_bytes, OutputView out, cudaStream_t stream,
                                    PrefillKernel kernel = PrefillKernel::kAuto);

}  // namespace kvring::cuda
