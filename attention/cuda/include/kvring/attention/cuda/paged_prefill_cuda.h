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

}  // namespace kvring::cuda
