// Reading quantized pages (internal): a code's value and where its scale
// sits in the page (cache/layout kv_encoding.h: ScaleIndex). A quantized
// page holds the block's 1-byte codes in the block layout, then its fp32
// scales; every kernel that reads one goes through these.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kvring/attention/cuda/attention_views_cuda.h"

namespace kvring::cuda::internal {

// The value of one code (kCodec: 1 int8, 2 fp8-e4m3), before its scale.
template <int kCodec>
__device__ __forceinline__ float Code(uint8_t c) {
  if constexpr (kCodec == 1) {
    return static_cast<float>(static_cast<int8_t>(c));
  } else {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
    return __half2float(__half(h));
  }
}

// Index of the scale of (kv, token, dim) of kv head h in the page's scale
// region (`layer` is kv.layer). kMode: 0 per head, 1 per token, 2 K per
// channel and V per token.
template <int kMode>
__device__ __forceinline__ int ScaleAt(const PagedKvView& kv, int which, int h, int token, int dim) {
  const int L = kv.layer, H = kv.kv_heads, T = kv.block_tokens, D = kv.head_dim;
  if constexpr (kMode == 0) return (L * 2 + which) * H + h;
  if constexpr (kMode == 1) return ((L * 2 + which) * H + h) * T + token;
  const int base = L * H * (D + T);
  return which == 0 ? base + h * D + dim : base + H * D + h * T + token;
}

// Bytes of a page's codes: the scales start there.
__device__ __forceinline__ uint64_t CodeBytes(const PagedKvView& kv) {
  return 2ull * kv.layers * kv.kv_heads * kv.block_tokens * kv.head_dim;
}

}  // namespace kvring::cuda::internal
