// Host-side dispatch from a view's run-time values to the kernels' template
// arguments (internal): the head dim and 16-bit type (WithHeadDim), the
// quantized encoding's codec and scale mode (WithEncoding). Every launcher
// goes through these, so a value the kernels are not built for is refused
// in one place (cudaErrorInvalidValue), never launched as another.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kvring/attention/cuda/attention_views_cuda.h"

namespace kvring::cuda::internal {

// Calls launch.template operator()<D, T>() with kv's head dim as D and its
// 16-bit type (kv.dtype) as T; cudaErrorInvalidValue for a head dim outside
// KernelsTakeHeadDim (the cases below are exactly its dims).
template <typename F>
cudaError_t WithHeadDim(const PagedKvView& kv, F&& launch) {
  auto by_type = [&]<int D>() -> cudaError_t {
    return kv.dtype == KvType::kBF16 ? launch.template operator()<D, __nv_bfloat16>()
                                     : launch.template operator()<D, __half>();
  };
  switch (kv.head_dim) {
    case 64:
      return by_type.template operator()<64>();
    case 128:
      return by_type.template operator()<128>();
    case 256:
      return by_type.template operator()<256>();
    default:
      return cudaErrorInvalidValue;
  }
}

// Calls launch.template operator()<kCodec, kMode>() with `e`'s codec and
// scale mode as template arguments; cudaErrorInvalidValue for plain pages or
// values outside the enums.
template <typename F>
cudaError_t WithEncoding(KvEncoding e, F&& launch) {
  auto by_mode = [&]<KvCodec kCodec>() -> cudaError_t {
    switch (e.scales) {
      case ScaleMode::kPerHead:
        return launch.template operator()<kCodec, ScaleMode::kPerHead>();
      case ScaleMode::kPerToken:
        return launch.template operator()<kCodec, ScaleMode::kPerToken>();
      case ScaleMode::kKChannelVToken:
        return launch.template operator()<kCodec, ScaleMode::kKChannelVToken>();
    }
    return cudaErrorInvalidValue;
  };
  switch (e.codec) {
    case KvCodec::kInt8:
      return by_mode.template operator()<KvCodec::kInt8>();
    case KvCodec::kFp8E4M3:
      return by_mode.template operator()<KvCodec::kFp8E4M3>();
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace kvring::cuda::internal
