// Exact LSE merge of attention partials on the GPU.
#include <cstring>
#include <type_traits>

#include "cuda_common.cuh"
#include "kvring/attention/cuda/merge_cuda.h"

namespace kvring::cuda {
namespace internal {
namespace {

// One thread per output element (row-head, d): the parts' loads are
// independent and coalesced across d, so a merge of many splits of few rows
// (a batch-1 decode) is not one warp walking every part in turn.
__global__ void MergeKernel(const float* __restrict__ out_parts, const float* __restrict__ lse_parts, int num_parts,
                            int rows_heads, int head_dim, float* __restrict__ out, float* __restrict__ lse) {
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)rows_heads * head_dim) return;
  const int rh = (int)(idx / head_dim), d = (int)(idx % head_dim);
  float M = -INFINITY;
  for (int s = 0; s < num_parts; ++s) M = fmaxf(M, lse_parts[(size_t)s * rows_heads + rh]);
  if (M == -INFINITY) {
    out[idx] = 0.f;
    if (d == 0) lse[rh] = -INFINITY;
    return;
  }
  float L = 0.f, acc = 0.f;
#pragma unroll 4
  for (int s = 0; s < num_parts; ++s) {
    const float x = lse_parts[(size_t)s * rows_heads + rh];
    const float w = x == -INFINITY ? 0.f : __expf(x - M);
    L += w;
    acc += w * out_parts[((size_t)s * rows_heads + rh) * head_dim + d];
  }
  out[idx] = acc / L;
  if (d == 0) lse[rh] = M + __logf(L);
}

__global__ void MergeIntoKernel(float* __restrict__ acc_out, float* __restrict__ acc_lse,
                                const float* __restrict__ other_out, const float* __restrict__ other_lse,
                                int rows_heads, int head_dim) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= rows_heads) return;
  const float a = acc_lse[warp], b = other_lse[warp];
  const float M = fmaxf(a, b);
  if (M == -INFINITY) return;  // both empty: acc stays (0, -inf)
  const float wa = a == -INFINITY ? 0.f : __expf(a - M), wb = b == -INFINITY ? 0.f : __expf(b - M);
  const float inv = 1.f / (wa + wb);
  float* o = acc_out + (size_t)warp * head_dim;
  const float* p = other_out + (size_t)warp * head_dim;
  for (int d = lane; d < head_dim; d += 32) o[d] = (wa * o[d] + wb * p[d]) * inv;
  __syncwarp();
  if (lane == 0) acc_lse[warp] = M + __logf(wa + wb);
}

// Where MergeRowsKernel reads a row's contributions: device arrays, or the
// launch's own parameters (MergeRowsInline).
struct DeviceCsr {
  const int32_t* begin;
  const int32_t* contrib;
  __device__ int Begin(int r) const { return begin[r]; }
  __device__ int At(int i) const { return contrib[i]; }
};
struct InlineCsr {
  int32_t v[kInlineCsrEntries];  // begin[rows + 1], then the contributions
  int rows;
  __device__ int Begin(int r) const { return v[r]; }
  __device__ int At(int i) const { return v[rows + 1 + i]; }
};

struct NoCsr {  // no row has a contribution
  __device__ int Begin(int) const { return 0; }
  __device__ int At(int) const { return 0; }
};

template <typename T>
__device__ void Store(T* p, float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    *p = __float2bfloat16(x);
  } else {
    *p = __float2half(x);
  }
}

// One warp per (row, head): the row's contributions folded into acc (and,
// with Cast, O also written to cast in Cast).
template <typename Csr, typename Cast>
__global__ void MergeRowsKernel(float* __restrict__ acc_out, float* __restrict__ acc_lse, int rows,
                                const float* __restrict__ parts_out, const float* __restrict__ parts_lse,
                                const __grid_constant__ Csr csr, int q_heads, int head_dim, bool init,
                                Cast* __restrict__ cast) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= rows * q_heads) return;
  const int r = warp / q_heads, h = warp % q_heads;
  const int c0 = csr.Begin(r), c1 = csr.Begin(r + 1);
  float* o = acc_out + (size_t)warp * head_dim;
  Cast* oc = nullptr;
  if constexpr (!std::is_void_v<Cast>) oc = cast + (size_t)warp * head_dim;
  if (c0 == c1 && !init) {
    if constexpr (!std::is_void_v<Cast>) {
      for (int d = lane; d < head_dim; d += 32) Store(oc + d, o[d]);
    }
    return;
  }
  const float own = init ? -INFINITY : acc_lse[warp];
  float M = own;
  for (int c = c0; c < c1; ++c) M = fmaxf(M, parts_lse[(size_t)csr.At(c) * q_heads + h]);
  if (M == -INFINITY) {  // nothing seen: O = 0, LSE = -inf
    for (int d = lane; d < head_dim; d += 32) {
      o[d] = 0.f;
      if constexpr (!std::is_void_v<Cast>) Store(oc + d, 0.f);
    }
    if (lane == 0) acc_lse[warp] = -INFINITY;
    return;
  }
  const float w_own = own == -INFINITY ? 0.f : __expf(own - M);
  float L = w_own;
  for (int c = c0; c < c1; ++c) {
    const float x = parts_lse[(size_t)csr.At(c) * q_heads + h];
    L += x == -INFINITY ? 0.f : __expf(x - M);
  }
  const float inv = 1.f / L;
  for (int d = lane; d < head_dim; d += 32) {
    float acc = w_own > 0.f ? w_own * o[d] : 0.f;
    for (int c = c0; c < c1; ++c) {
      const int p = csr.At(c);
      const float x = parts_lse[(size_t)p * q_heads + h];
      if (x != -INFINITY) acc += __expf(x - M) * parts_out[((size_t)p * q_heads + h) * head_dim + d];
    }
    o[d] = acc * inv;
    if constexpr (!std::is_void_v<Cast>) Store(oc + d, acc * inv);
  }
  __syncwarp();
  if (lane == 0) acc_lse[warp] = M + __logf(L);
}

template <typename Csr>
cudaError_t LaunchMergeRows(OutputView acc, int rows, const float* parts_out, const float* parts_lse, const Csr& csr,
                            int q_heads, int head_dim, bool init, CastOutput cast, cudaStream_t stream) {
  const int threads = 256, warps_per_block = threads / 32;
  const long long warps = (long long)rows * q_heads;
  const unsigned blocks = (unsigned)((warps + warps_per_block - 1) / warps_per_block);
  switch (cast.dtype) {
    case CastOutput::kNone:
      MergeRowsKernel<Csr, void><<<blocks, threads, 0, stream>>>(acc.out, acc.lse, rows, parts_out, parts_lse, csr,
                                                                 q_heads, head_dim, init, nullptr);
      break;
    case CastOutput::kF16:
      MergeRowsKernel<Csr, __half><<<blocks, threads, 0, stream>>>(
          acc.out, acc.lse, rows, parts_out, parts_lse, csr, q_heads, head_dim, init, static_cast<__half*>(cast.out));
      break;
    case CastOutput::kBf16:
      MergeRowsKernel<Csr, __nv_bfloat16><<<blocks, threads, 0, stream>>>(acc.out, acc.lse, rows, parts_out, parts_lse,
                                                                          csr, q_heads, head_dim, init,
                                                                          static_cast<__nv_bfloat16*>(cast.out));
      break;
  }
  return cudaGetLastError();
}

bool BadCast(const CastOutput& c) {
  return (c.dtype != CastOutput::kNone && c.out == nullptr) ||
         (c.dtype != CastOutput::kNone && c.dtype != CastOutput::kF16 && c.dtype != CastOutput::kBf16);
}

}  // namespace
}  // namespace internal

cudaError_t MergeRows(OutputView acc, int rows, const float* parts_out, const float* parts_lse,
                      const int32_t* contrib_begin, const int32_t* contrib, int q_heads, int head_dim, bool init,
                      cudaStream_t stream, CastOutput cast) {
  if (acc.out == nullptr || acc.lse == nullptr || contrib_begin == nullptr || rows < 0 || q_heads <= 0 ||
      head_dim <= 0 || internal::BadCast(cast)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  return internal::LaunchMergeRows(acc, rows, parts_out, parts_lse, internal::DeviceCsr{contrib_begin, contrib},
                                   q_heads, head_dim, init, cast, stream);
}

cudaError_t MergeRowsInline(OutputView acc, int rows, const float* parts_out, const float* parts_lse,
                            const int32_t* csr, int csr_entries, int q_heads, int head_dim, bool init,
                            cudaStream_t stream, CastOutput cast) {
  const bool none = csr == nullptr && csr_entries == 0;
  if (acc.out == nullptr || acc.lse == nullptr || rows < 0 || q_heads <= 0 || head_dim <= 0 ||
      (!none && (csr == nullptr || csr_entries < rows + 1 || csr_entries > kInlineCsrEntries)) ||
      internal::BadCast(cast)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (none) {
    return internal::LaunchMergeRows(acc, rows, parts_out, parts_lse, internal::NoCsr{}, q_heads, head_dim, init, cast,
                                     stream);
  }
  internal::InlineCsr c;
  std::memcpy(c.v, csr, sizeof(int32_t) * (size_t)csr_entries);
  c.rows = rows;
  return internal::LaunchMergeRows(acc, rows, parts_out, parts_lse, c, q_heads, head_dim, init, cast, stream);
}

cudaError_t MergePartials(const float* out_parts, const float* lse_parts, int num_parts, int rows_heads, int head_dim,
                          OutputView out, cudaStream_t stream) {
  if (out_parts == nullptr || lse_parts == nullptr || out.out == nullptr || out.lse == nullptr || num_parts < 1 ||
      head_dim <= 0) {
    return cudaErrorInvalidValue;
  }
  if (rows_heads == 0) return cudaSuccess;
  const int threads = 256;
  const size_t total = (size_t)rows_heads * head_dim;
  internal::MergeKernel<<<(unsigned)((total + threads - 1) / threads), threads, 0, stream>>>(
      out_parts, lse_parts, num_parts, rows_heads, head_dim, out.out, out.lse);
  return cudaGetLastError();
}

cudaError_t MergeInto(OutputView acc, const float* other_out, const float* other_lse, int rows_heads, int head_dim,
                      cudaStream_t stream) {
  if (acc.out == nullptr || acc.lse == nullptr || other_out == nullptr || other_lse == nullptr)
    return cudaErrorInvalidValue;
  if (rows_heads == 0) return cudaSuccess;
  const int threads = 256, warps_per_block = threads / 32;
  internal::MergeIntoKernel<<<(rows_heads + warps_per_block - 1) / warps_per_block, threads, 0, stream>>>(
      acc.out, acc.lse, other_out, other_lse, rows_heads, head_dim);
  return cudaGetLastError();
}

}  // namespace kvring::cuda
