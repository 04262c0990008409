// Device helpers shared by the attention kernels (internal).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kvring/attention/cuda/paged_attention_cuda.h"

namespace kvring::cuda::internal {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T>
struct Vec8;  // 8 elements = 16 bytes
template <>
struct Vec8<__nv_bfloat16> {
  static __device__ __forceinline__ void ToFloat(const uint4& r, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __bfloat1622float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
};
template <>
struct Vec8<__half> {
  static __device__ __forceinline__ void ToFloat(const uint4& r, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __half22float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
};

__device__ __forceinline__ uint4 LoadNc(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Element offset of the (layer, kv, head) plane inside a page.
__device__ __forceinline__ uint64_t PlaneOffset(const PagedKvView& kv, int which, int head) {
  return (((uint64_t)kv.layer * 2 + which) * kv.kv_heads + head) * (uint64_t)kv.block_tokens * kv.head_dim;
}

}  // namespace kvring::cuda::internal
