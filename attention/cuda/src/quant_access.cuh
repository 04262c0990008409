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

// The value of one code, before its scale.
template <KvCodec kCodec>
__device__ __forceinline__ float Code(uint8_t c) {
  if constexpr (kCodec == KvCodec::kInt8) {
    return static_cast<float>(static_cast<int8_t>(c));
  } else {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
    return __half2float(__half(h));
  }
}

// Index of the scale of (kv, token, dim) of kv head h in the page's scale
// region (`layer` is kv.layer): ScaleIndex in 32 bits.
template <ScaleMode kMode>
__device__ __forceinline__ int ScaleAt(const PagedKvView& kv, int which, int h, int token, int dim) {
  return ScaleIndexAs<int>(kv.kv_heads, kv.block_tokens, kv.head_dim, kMode, kv.layer, which, h, token, dim);
}

// Bytes of a page's codes: the scales start there.
__device__ __forceinline__ uint64_t CodeBytes(const PagedKvView& kv) {
  return 2ull * kv.layers * kv.kv_heads * kv.block_tokens * kv.head_dim;
}

}  // namespace kvring::cuda::internal
