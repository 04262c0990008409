// Paged decode attention over quantized pages (int8 or fp8-e4m3 codes with
// fp32 scales, cache/layout kv_encoding.h). Two kernels: on sm_90 with pages
// of a multiple of 16 tokens, a pipelined one on the tensor cores (below,
// "Pipelined variant"; 0.36-0.41 of copy in bytes of codes on the H200);
// otherwise this one, on the CUDA cores (0.06-0.11):
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
#include "tma_cuda.h"

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
__device__ __forceinline__ float ToF<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float ToF<__half>(__half x) {
  return __half2float(x);
}

template <int D, int kCodec, int kMode, typename T>
__global__ void __launch_bounds__(kThreads, 4)
    QDecodeKernel(AttnParams p, QueryView q, PagedKvView kv, int num_splits, int row_groups, float* part_out,
                  float* part_lse, float* out, float* lse) {
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

// ---- Pipelined variant (sm_90, pages of a multiple of 16 tokens): the bf16
// decode kernel's structure (paged_decode_cuda.cu) over codes. A producer
// warp streams 16-token stages through a 12-deep mbarrier ring: K and V
// codes ([16][D] each) by TMA boxes of a 5-d code map, the scales the stage
// needs by 1-d bulk copies of 16-byte-aligned runs of the page's scale words
// (a 2-d UINT32 tensor map of the scale words stopped the kernel with an
// illegal instruction on the H200, compute-sanitizer: at that map's first
// load). Each of four consumer warps takes a stage, converts its
// codes to 16-bit values in a private swizzled buffer (K times its
// per-channel scales in mode 2; rows past the end zeroed), releases the
// stage, and runs the tensor-core math of the bf16 kernel on the buffer: S =
// Q K^T times the per-token or per-page K scales, the online softmax, P
// times the V scales, O += P V.
constexpr int kPRows = 16;  // (row, q head) vectors a CTA: the 16 rows of an m16n8k16 tile
constexpr int kQPStage = 16, kQPConsumers = 4, kQPThreads = (kQPConsumers + 1) * 32, kQPStages = 12;

template <int D, int kMode>
struct QPipeCfg {
  static constexpr int kCodeBytes = kQPStage * D;  // K (or V) codes of a stage
  // A stage's scales, by 1-d bulk copies of 16-byte-aligned runs of the
  // page's scale words: K's at word 0 (per channel: D words; per token: the
  // stage's 16; per head: the aligned 4 that hold it), V's at word kVWord
  // (per token: 16; per head: 4).
  static constexpr int kKWords = kMode == 2 ? D : kMode == 1 ? 16 : 4, kVWords = kMode == 0 ? 4 : 16;
  static constexpr int kVWord = (kKWords + 31) / 32 * 32;
  static constexpr int kScaleBytes = 4 * (kVWord + 32);
  static constexpr int kStageBytes = 2 * kCodeBytes + kScaleBytes;
  static constexpr int kRing = (kQPStages * kStageBytes + 1023) / 1024 * 1024;
  static constexpr int kPrivBytes = 2 * kQPStage * D * 2;  // a consumer's 16-bit K and V: [D/64][16][128 B] each
  static constexpr int kPrivOff = kRing;
  static constexpr int kQOff = kPrivOff + kQPConsumers * kPrivBytes;
  static constexpr int kBarOff = kQOff + kPRows * D * 2;
  static constexpr int kBytes = kBarOff + 2 * kQPStages * 8;
  static constexpr int kDynamic = kBytes + 1024;
  static constexpr uint32_t kTxBytes = 2 * kCodeBytes + (kKWords + kVWords) * 4;
  static_assert(kQPConsumers * kPRows * D * 4 <= kQPConsumers * kPrivBytes, "merge buffer reuses the private buffers");
  static_assert(kQPStages % kQPConsumers == 0, "each stage belongs to one consumer warp");
};

// Eight codes (8 bytes) to eight 16-bit values, each times sc[i] (or 1).
template <int kCodec, typename T, bool kScaled>
__device__ __forceinline__ uint4 Dequant8(uint2 raw, const float* sc) {
  float f[8];
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    if constexpr (kCodec == 1) {
      f[i] = static_cast<float>(static_cast<int8_t>(b[i]));
      f[i + 1] = static_cast<float>(static_cast<int8_t>(b[i + 1]));
    } else {
      const __half2_raw hr =
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(b[i] | (b[i + 1] << 8)), __NV_E4M3);
      const float2 v = __half22float2(__half2(hr));
      f[i] = v.x;
      f[i + 1] = v.y;
    }
    if constexpr (kScaled) {
      f[i] *= sc[i];
      f[i + 1] *= sc[i + 1];
    }
  }
  return make_uint4(Pack<T>(f[0], f[1]), Pack<T>(f[2], f[3]), Pack<T>(f[4], f[5]), Pack<T>(f[6], f[7]));
}

template <int D, typename T, int kCodec, int kMode>
__global__ void __launch_bounds__(kQPThreads, 2)
    QDecodePipelinedKernel(AttnParams p, QueryView q, PagedKvView kv, int num_splits, int row_groups, float* part_out,
                           float* part_lse, float* out, float* lse, const __grid_constant__ CUtensorMap code_map) {
  using C = QPipeCfg<D, kMode>;
  constexpr int kChunks = D / 8, kKSteps = D / 16, kDTiles = D / 8;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (SmemBase1024(smem_raw) - SmemAddr(smem_raw));
  uint8_t* sq = smem + C::kQOff;
  const uint32_t full0 = SmemAddr(smem + C::kBarOff), empty0 = full0 + 8 * kQPStages;
  __shared__ int s_qpos[kPRows];
  __shared__ int s_qmin, s_qmax;
  __shared__ float s_m[kQPConsumers][kPRows], s_l[kQPConsumers][kPRows], s_fac[kQPConsumers][kPRows];

  if (threadIdx.x == 0) {
    TmaPrefetchMap(&code_map);
    for (int i = 0; i < kQPStages; ++i) {
      MbarInit(full0 + 8 * i, 1);   // the producer lane's expect-tx arrival
      MbarInit(empty0 + 8 * i, 1);  // the consumer warp that took the stage
    }
  }
  DecodeWork w;
  if (!DecodeWorkOf(q, kv, num_splits, row_groups, kPRows, &w)) return;
  const int h = w.h, pb = w.pb, npages = w.npages;
  const int tok_lo = w.tok_lo, tok_hi = w.tok_hi, bt = kv.block_tokens;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
  const float scale = (p.softmax_scale > 0 ? p.softmax_scale : rsqrtf((float)D)) * kLog2e;
  const int ntiles = tok_hi > tok_lo ? (tok_hi - tok_lo + kQPStage - 1) / kQPStage : 0;

  LoadDecodeQueries<D, T>(q, w, sq, s_qpos, &s_qmin, &s_qmax, kQPThreads);
  __syncthreads();

  float o[kDTiles][4];
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  const int L = kv.layer, H = kv.kv_heads;
  // Per-head scales: their word within the aligned run of 4 that is copied
  // (a page's scales start at a multiple of 4 words).
  const int k_sub = ((L * 2) * H + h) & 3, v_sub = ((L * 2 + 1) * H + h) & 3;
  if (warp == kQPConsumers) {
    // ---- producer: the page ids from a window of 64 in registers, as in
    // the bf16 kernel (what bounds this kernel is the consumers' conversion
    // of the codes, not the stream).
    const int E = (int)(((uint64_t)2 * kv.layers * H * bt * D) / 4);  // first scale word of a page
    const int kplane = (L * 2) * H + h, vplane = kplane + H;
    // The codes are read once: their lines leave L2 first.
    const uint64_t evict_first = L2EvictFirstPolicy();
    PageWindow win;
    win.Load(kv, pb, npages, tok_lo / bt);
    for (int t = 0; t < ntiles; ++t) {
      const int st = t % kQPStages;
      const int i0 = tok_lo + t * kQPStage, pg = i0 / bt, off = i0 - pg * bt;
      const int page = win.Page(pg);
      win.Advance(kv, pb, npages, (i0 + kQPStage) / bt);
      if (t >= kQPStages) MbarWait(empty0 + 8 * st, ((t / kQPStages) - 1) & 1);
      if (lane == 0) {
        const uint32_t kc = SmemAddr(smem + st * C::kStageBytes), vc = kc + C::kCodeBytes, sc = vc + C::kCodeBytes;
        const uint32_t bar = full0 + 8 * st;
        MbarArriveExpectTx(bar, C::kTxBytes);
        TmaLoad5dHint(kc, &code_map, 0, off, kplane, 0, page, bar, evict_first);
        TmaLoad5dHint(vc, &code_map, 0, off, vplane, 0, page, bar, evict_first);
        int kidx, vidx;  // word indices of the stage's first K and V scale in the page
        if constexpr (kMode == 0) {
          kidx = E + (L * 2) * H + h;
          vidx = E + (L * 2 + 1) * H + h;
        } else if constexpr (kMode == 1) {
          kidx = E + ((L * 2) * H + h) * bt + off;
          vidx = E + ((L * 2 + 1) * H + h) * bt + off;
        } else {
          const int base = E + L * H * (D + bt);
          kidx = base + h * D;
          vidx = base + H * D + h * bt + off;
        }
        // (Per head: the aligned run of 4 words holding the scale; the
        // consumers read word kidx % 4, vidx % 4 of it.)
        const char* pg_base = static_cast<const char*>(kv.pool) + (uint64_t)page * kv.page_stride;
        if constexpr (kMode == 0) {
          kidx &= ~3;
          vidx &= ~3;
        }
        BulkLoad(sc, pg_base + 4 * (uint64_t)kidx, 4 * C::kKWords, bar);
        BulkLoad(sc + 4 * C::kVWord, pg_base + 4 * (uint64_t)vidx, 4 * C::kVWords, bar);
      }
      __syncwarp();
    }
  } else {
    // ---- consumers
    uint32_t qa[kKSteps][4];
    LoadDecodeQFragments<D>(sq, qa);
    const int qpos0 = s_qpos[g], qpos1 = s_qpos[g + 8], qmin = s_qmin, qmax = s_qmax;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    uint8_t* kt = smem + C::kPrivOff + warp * C::kPrivBytes;
    uint8_t* vt = kt + C::kPrivBytes / 2;
    const bool cta_pos_mask =
        DecodeMaskMayHide(p, tok_lo, tok_hi, DecodeStreamEnds(p, kv, pb, tok_lo, tok_hi), qmin, qmax);
    for (int t = warp; t < ntiles; t += kQPConsumers) {
      const int st = t % kQPStages;
      MbarWait(full0 + 8 * st, (t / kQPStages) & 1);
      const uint8_t* kc = smem + st * C::kStageBytes;
      const uint8_t* vc = kc + C::kCodeBytes;
      const float* scl = reinterpret_cast<const float*>(vc + C::kCodeBytes);
      const int tile_first = tok_lo + t * kQPStage;
      const int valid_rows = min(kQPStage, tok_hi - tile_first);
      // Codes to 16-bit values in this warp's buffers (rows past the end: 0).
#pragma unroll
      for (int i = 0; i < kQPStage * kChunks / 32; ++i) {
        const int c = lane + 32 * i, r = c / kChunks, ch = c % kChunks;
        uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
        if (r < valid_rows) {
          const uint2 kr = *reinterpret_cast<const uint2*>(kc + r * D + ch * 8);
          const uint2 vr = *reinterpret_cast<const uint2*>(vc + r * D + ch * 8);
          kv4 = Dequant8<kCodec, T, kMode == 2>(kr, scl + ch * 8);  // (per channel: dims 8 ch ..)
          vv4 = Dequant8<kCodec, T, false>(vr, nullptr);
        }
        *reinterpret_cast<uint4*>(kt + Sw128(kQPStage, r, ch)) = kv4;
        *reinterpret_cast<uint4*>(vt + Sw128(kQPStage, r, ch)) = vv4;
      }
      // This lane's tokens' scales: S columns (K per token / page) and P (V).
      float ks[4], vs[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = (e >> 1) * 8 + tig * 2 + (e & 1);
        ks[e] = kMode == 1 ? scl[tok] : kMode == 0 ? scl[k_sub] : 1.f;
        // (0 past the end: P is 0 there, but 0 x a junk slot's NaN scale is not)
        vs[e] = tok < valid_rows ? (kMode == 0 ? scl[C::kVWord + v_sub] : scl[C::kVWord + tok]) : 0.f;
      }
      __syncwarp();
      if (lane == 0) MbarArrive(empty0 + 8 * st);  // the codes are in registers / the private buffers
      float sc[2][4];
      DecodeScores<D, T, kMode != 2>(qa, kt, p, kv, pb, tile_first, tok_hi, qpos0, qpos1, qmin, qmax, cta_pos_mask,
                                     scale, ks, sc);
      DecodeSoftmaxPV<D, T, true>(sc, vs, m0, m1, l0, l1, o, vt);  // (P times the V scales of its tokens)
      __syncwarp();  // (the buffers are rewritten by the next stage's conversion)
    }
    l0 = QuadSum(l0);
    l1 = QuadSum(l1);
  }
  __syncthreads();  // every stage consumed: the private buffers are free for the consumers' (m, l, O)
  float* so = reinterpret_cast<float*>(smem + C::kPrivOff);  // kQPConsumers x kPRows x D
  if (warp < kQPConsumers) {
    if (tig == 0) {
      s_m[warp][g] = m0;
      s_m[warp][g + 8] = m1;
      s_l[warp][g] = l0;
      s_l[warp][g + 8] = l1;
    }
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      float* r0p = so + ((size_t)warp * kPRows + g) * D + j * 8 + tig * 2;
      float* r1p = so + ((size_t)warp * kPRows + g + 8) * D + j * 8 + tig * 2;
      r0p[0] = o[j][0];
      r0p[1] = o[j][1];
      r1p[0] = o[j][2];
      r1p[1] = o[j][3];
    }
  }
  __syncthreads();
  StoreDecodeRows<kQPConsumers, D, D>(w, q, kPRows, num_splits, &s_m[0][0], &s_l[0][0], so, &s_fac[0][0], part_out,
                                      part_lse, out, lse);
}

template <int D, int kCodec, int kMode, typename T>
cudaError_t LaunchPipelined(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                            float* po, float* pl, const CUtensorMap& codes, cudaStream_t stream) {
  const int G = q.q_heads / kv.kv_heads;
  const int row_groups = (q.max_rows_per_seq * G + kPRows - 1) / kPRows;
  const int smem = QPipeCfg<D, kMode>::kDynamic;
  cudaError_t e = cudaFuncSetAttribute(QDecodePipelinedKernel<D, T, kCodec, kMode>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  dim3 grid(splits, kv.kv_heads * row_groups, kv.num_seqs);
  QDecodePipelinedKernel<D, T, kCodec, kMode>
      <<<grid, kQPThreads, smem, stream>>>(p, q, kv, splits, row_groups, po, pl, out.out, out.lse, codes);
  return cudaGetLastError();
}

template <int D, int kCodec, int kMode, typename T>
cudaError_t Launch(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                   float* po, float* pl, cudaStream_t stream) {
  const int G = q.q_heads / kv.kv_heads;
  const int row_groups = (q.max_rows_per_seq * G + kRows - 1) / kRows;
  dim3 grid(splits, kv.kv_heads * row_groups, kv.num_seqs);
  QDecodeKernel<D, kCodec, kMode, T>
      <<<grid, kThreads, 0, stream>>>(p, q, kv, splits, row_groups, po, pl, out.out, out.lse);
  return cudaGetLastError();
}

template <int D, typename T>
cudaError_t ByEncoding(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                       float* po, float* pl, cudaStream_t s) {
  const int c = kv.codec, m = kv.scales;
  alignas(64) CUtensorMap codes{};
  if (MakeQuantCodeMap(kv, kQPStage, &codes)) {  // sm_90, pages of a multiple of 16 tokens
    if (c == 1 && m == 0) return LaunchPipelined<D, 1, 0, T>(p, q, kv, out, splits, po, pl, codes, s);
    if (c == 1 && m == 1) return LaunchPipelined<D, 1, 1, T>(p, q, kv, out, splits, po, pl, codes, s);
    if (c == 1 && m == 2) return LaunchPipelined<D, 1, 2, T>(p, q, kv, out, splits, po, pl, codes, s);
    if (c == 2 && m == 0) return LaunchPipelined<D, 2, 0, T>(p, q, kv, out, splits, po, pl, codes, s);
    if (c == 2 && m == 1) return LaunchPipelined<D, 2, 1, T>(p, q, kv, out, splits, po, pl, codes, s);
    if (c == 2 && m == 2) return LaunchPipelined<D, 2, 2, T>(p, q, kv, out, splits, po, pl, codes, s);
    return cudaErrorInvalidValue;
  }
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
