// Paged decode attention over quantized pages (int8 or fp8-e4m3 codes with
// fp32 scales, cache/layout kv_encoding.h), on the CUDA cores.
//
// The codes are read straight from the page pool and dequantized in
// registers; there is never a full-precision copy of the KV in memory.
// Grid and splits are those of the bf16 kernel (splits x (kv_heads x row
// groups) x sequences, 4 warps, up to 16 (row, q head) vectors of one GQA
// group per CTA). Work is split by 32-token chunks, one per warp in turn:
//   scores: lane = token. Each lane reads its token's K row (D codes, 16
//           bytes at a time, coalesced across the warp since tokens are
//           contiguous in a page) and dots it with the vectors' queries from
//           shared memory (broadcast reads); K scales per head, token or
//           channel are applied per code.
//   softmax: per vector, one warp max per chunk; sums stay per lane.
//   P V:    lane = D/32 dims. For each token of the chunk the weight (times
//           the token's V scale) is broadcast by shuffle and the lane adds
//           its dims of the V row (again coalesced).
// Warps and splits merge exactly by LSE, as in the bf16 kernel.
#include <cuda_fp8.h>

#include <cfloat>

#include "cuda_common.cuh"

namespace kvring::cuda {
namespace internal {
namespace {

constexpr int kWarps = 4, kThreads = 128, kRows = 8;  // 8 vectors a CTA keeps registers low

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
// region (kv_encoding.h ScaleIndex; `layer` is kv.layer).
template <int kMode>
__device__ __forceinline__ int ScaleAt(const PagedKvView& kv, int which, int h, int token, int dim) {
  const int L = kv.layer, H = kv.kv_heads, T = kv.block_tokens, D = kv.head_dim;
  if constexpr (kMode == 0) return (L * 2 + which) * H + h;
  if constexpr (kMode == 1) return ((L * 2 + which) * H + h) * T + token;
  const int base = L * H * (D + T);
  return which == 0 ? base + h * D + dim : base + H * D + h * T + token;
}

template <typename T>
__device__ __forceinline__ float ToF(T x);
template <>
__device__ __forceinline__ float ToF<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float ToF<__half>(__half x) { return __half2float(x); }

template <int D, int kCodec, int kMode, typename T>
__global__ void __launch_bounds__(kThreads, 4) QDecodeKernel(AttnParams p, QueryView q, PagedKvView kv, int num_splits,
                                                          int row_groups, float* part_out, float* part_lse, float* out,
                                                          float* lse) {
  constexpr int kDpl = D / 32;  // V dims per lane
  __shared__ __align__(16) float sq[kRows][D];
  __shared__ __align__(16) float so[kWarps][kRows][D];
  __shared__ int s_qpos[kRows];
  __shared__ float s_m[kWarps][kRows], s_l[kWarps][kRows], s_fac[kWarps][kRows];

  DecodeWork w;
  if (!DecodeWorkOf(q, kv, num_splits, row_groups, kRows, &w)) return;
  const int h = w.h, G = w.G, rb = w.rb, v0 = w.v0, nv = w.nv, pb = w.pb;
  const int tok_lo = w.tok_lo, tok_hi = w.tok_hi, bt = kv.block_tokens;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float scale = (p.softmax_scale > 0 ? p.softmax_scale : rsqrtf((float)D)) * kLog2e;

  for (int i = tid; i < kRows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float x = 0.f;
    if (r < nv) {
      const int v = v0 + r;
      x = ToF<T>(static_cast<const T*>(q.q)[((size_t)(rb + v / G) * q.q_heads + h * G + v % G) * D + d]);
    }
    sq[r][d] = x;
  }
  if (tid < kRows) s_qpos[tid] = tid < nv ? q.positions[rb + (v0 + tid) / G] : INT32_MIN;
  __syncthreads();

  const char* pool = static_cast<const char*>(kv.pool);
  const uint64_t elems = 2ull * kv.layers * kv.kv_heads * bt * D;  // codes of a page, bytes
  const uint64_t koff = PlaneOffset(kv, 0, h), voff = PlaneOffset(kv, 1, h);
  float m[kRows], l[kRows], acc[kRows][kDpl];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int j = 0; j < kDpl; ++j) acc[r][j] = 0.f;
  }
  for (int c0 = tok_lo + warp * 32; c0 < tok_hi; c0 += kWarps * 32) {
    // --- scores: this lane's token
    const int i = c0 + lane;
    const bool valid = i < tok_hi;
    const int pg = valid ? i / bt : 0, off = valid ? i - pg * bt : 0;
    const char* page = pool + (uint64_t)kv.page_ids[pb + (valid ? pg : 0)] * kv.page_stride;
    const float* scales = reinterpret_cast<const float*>(page + elems);
    const int kpos = valid ? kv.page_pos[pb + pg] + off : INT32_MAX;
    float sc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) sc[r] = 0.f;
    if (valid) {
      // All of the row's loads first (D/16 independent 16-byte loads in
      // flight), then the arithmetic.
      const uint8_t* krow = reinterpret_cast<const uint8_t*>(page) + koff + (uint64_t)off * D;
      uint4 kr[D / 16];
#pragma unroll
      for (int j = 0; j < D / 16; ++j) kr[j] = LoadNc(krow + j * 16);
      const float ks_tok = kMode == 2 ? 1.f : scales[ScaleAt<kMode>(kv, 0, h, off, 0)];
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        const int d0 = j * 16;
        const uint8_t* cb = reinterpret_cast<const uint8_t*>(&kr[j]);
        float k[16];
#pragma unroll
        for (int e = 0; e < 16; ++e) {
          const float ks = kMode == 2 ? scales[ScaleAt<kMode>(kv, 0, h, off, d0 + e)] : ks_tok;
          k[e] = Code<kCodec>(cb[e]) * ks;
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < nv) {
            float a = 0.f;
#pragma unroll
            for (int e = 0; e < 16; e += 4) {
              const float4 qq = *reinterpret_cast<const float4*>(&sq[r][d0 + e]);
              a += qq.x * k[e] + qq.y * k[e + 1] + qq.z * k[e + 2] + qq.w * k[e + 3];
            }
            sc[r] += a;
          }
        }
      }
    }
    // --- online softmax per vector (max over the warp; sums per lane)
    float pw[kRows], corr[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= nv) {
        pw[r] = 0.f;
        corr[r] = 1.f;
        continue;
      }
      const int qp = s_qpos[r];
      bool vis = valid;
      if (p.causal) vis = vis && kpos <= qp;
      if (p.window > 0) vis = vis && kpos > qp - p.window;
      const float x = vis ? sc[r] * scale : -INFINITY;
      float mx = x;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float nm = fmaxf(m[r], mx);
      corr[r] = nm == -INFINITY ? 1.f : exp2f(m[r] - nm);
      pw[r] = vis ? exp2f(x - nm) : 0.f;
      l[r] = l[r] * corr[r] + pw[r];
      m[r] = nm;
    }
    // --- P V: this lane's dims, every token of the chunk
    const float vs_own = valid ? scales[ScaleAt<kMode>(kv, 1, h, off, 0)] : 0.f;
    const uint64_t vbase = (uint64_t)(page - pool) + voff + (uint64_t)off * D;  // this lane's token's V row
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int j = 0; j < kDpl; ++j) acc[r][j] *= corr[r];
    }
    const int nt = min(32, tok_hi - c0);
    // Every token's V codes of this lane's dims first (32 independent loads
    // in flight), then the weighted sums.
    uint32_t vraw[32];
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      const uint64_t vb = __shfl_sync(0xffffffffu, vbase, t);
      const uint8_t* vrow = reinterpret_cast<const uint8_t*>(pool) + vb + lane * kDpl;
      if constexpr (kDpl == 4) {
        vraw[t] = t < nt ? __ldg(reinterpret_cast<const unsigned int*>(vrow)) : 0u;
      } else {
        vraw[t] = t < nt ? __ldg(reinterpret_cast<const unsigned short*>(vrow)) : 0u;
      }
    }
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      const float vs = __shfl_sync(0xffffffffu, vs_own, t);
      float vv[kDpl];
#pragma unroll
      for (int j = 0; j < kDpl; ++j) vv[j] = Code<kCodec>(static_cast<uint8_t>(vraw[t] >> (8 * j)));
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float w = __shfl_sync(0xffffffffu, pw[r], t) * vs;  // 0 past nt and for r >= nv
        if (r < nv) {
#pragma unroll
          for (int j = 0; j < kDpl; ++j) acc[r][j] += w * vv[j];
        }
      }
    }
  }
  // Warp totals, then the warps' exact merge through shared memory.
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l[r] += __shfl_xor_sync(0xffffffffu, l[r], o);
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s_m[warp][r] = m[r];
      s_l[warp][r] = l[r];
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int j = 0; j < kDpl; ++j) so[warp][r][lane * kDpl + j] = acc[r][j];
  }
  __syncthreads();
  StoreDecodeRows<kWarps, D, D>(w, q, kRows, num_splits, &s_m[0][0], &s_l[0][0], &so[0][0][0], &s_fac[0][0], part_out,
                                part_lse, out, lse);
}

template <int D, int kCodec, int kMode, typename T>
cudaError_t Launch(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                   float* po, float* pl, cudaStream_t stream) {
  const int G = q.q_heads / kv.kv_heads;
  const int row_groups = (q.max_rows_per_seq * G + kRows - 1) / kRows;
  dim3 grid(splits, kv.kv_heads * row_groups, kv.num_seqs);
  QDecodeKernel<D, kCodec, kMode, T><<<grid, kThreads, 0, stream>>>(p, q, kv, splits, row_groups, po, pl, out.out,
                                                                    out.lse);
  return cudaGetLastError();
}

template <int D, typename T>
cudaError_t ByEncoding(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                       float* po, float* pl, cudaStream_t s) {
  const int c = kv.codec, m = kv.scales;
  if (c == 1 && m == 0) return Launch<D, 1, 0, T>(p, q, kv, out, splits, po, pl, s);
  if (c == 1 && m == 1) return Launch<D, 1, 1, T>(p, q, kv, out, splits, po, pl, s);
  if (c == 1 && m == 2) return Launch<D, 1, 2, T>(p, q, kv, out, splits, po, pl, s);
  if (c == 2 && m == 0) return Launch<D, 2, 0, T>(p, q, kv, out, splits, po, pl, s);
  if (c == 2 && m == 1) return Launch<D, 2, 1, T>(p, q, kv, out, splits, po, pl, s);
  if (c == 2 && m == 2) return Launch<D, 2, 2, T>(p, q, kv, out, splits, po, pl, s);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t QuantizedDecode(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                            float* po, float* pl, cudaStream_t stream) {
  const int D = kv.head_dim;
  if (kv.dtype == KvType::kBF16) {
    return D == 128 ? ByEncoding<128, __nv_bfloat16>(p, q, kv, out, splits, po, pl, stream)
                    : ByEncoding<64, __nv_bfloat16>(p, q, kv, out, splits, po, pl, stream);
  }
  return D == 128 ? ByEncoding<128, __half>(p, q, kv, out, splits, po, pl, stream)
                  : ByEncoding<64, __half>(p, q, kv, out, splits, po, pl, stream);
}

}  // namespace internal
}  // namespace kvring::cuda
