// Paged decode attention over quantized pages (int8 or fp8-e4m3 codes with
// fp32 scales, cache/layout kv_encoding.h). Three kernels (QuantDecodeKernel):
// on sm_90 with pages of a multiple of 16 tokens and head_dim 64 or 128, two
// pipelined ones on the tensor cores (below: "Pipelined variant", 16 vectors
// a CTA, and QDecodeSwapKernel, up to 8, the MMAs' rows being tokens);
// otherwise (head_dim 256 too) this one, on the CUDA cores (0.06-0.11 of copy
// in bytes of codes):
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
#include <type_traits>

#include "cuda_common.cuh"
#include "quant_access.cuh"
#include "tma_cuda.h"

namespace kvring::cuda {
namespace internal {
namespace {

constexpr int kWarps = 4, kThreads = 128, kRows = 8;  // 8 vectors a CTA keeps registers low

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

// (Four CTAs an SM cap a thread at 128 registers: at head_dim 256 a lane's
// K row and V accumulators alone take 128, so two.)
template <int D, KvCodec kCodec, ScaleMode kMode, typename T>
__global__ void __launch_bounds__(kThreads, D > 128 ? 2 : 4)
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
  const uint64_t elems = CodeBytes(kv);  // the scales follow the codes
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
      const float ks_tok = kMode == ScaleMode::kKChannelVToken ? 1.f : scales[ScaleAt<kMode>(kv, 0, h, off, 0)];
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        const int d0 = j * 16;
        const uint8_t* cb = reinterpret_cast<const uint8_t*>(&kr[j]);
        float k[16];
#pragma unroll
        for (int e = 0; e < 16; ++e) {
          const float ks = kMode == ScaleMode::kKChannelVToken ? scales[ScaleAt<kMode>(kv, 0, h, off, d0 + e)] : ks_tok;
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
    // (A lane's kDpl codes of a row in one load: 2, 4 or 8 bytes.)
    using VCodes =
        std::conditional_t<kDpl == 8, unsigned long long, std::conditional_t<kDpl == 4, unsigned int, unsigned short>>;
    static_assert(kDpl == 2 || kDpl == 4 || kDpl == 8, "head_dim 64, 128 or 256");
    VCodes vraw[32];
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      const uint64_t vb = __shfl_sync(0xffffffffu, vbase, t);
      const uint8_t* vrow = reinterpret_cast<const uint8_t*>(pool) + vb + lane * kDpl;
      vraw[t] = t < nt ? __ldg(reinterpret_cast<const VCodes*>(vrow)) : VCodes{0};
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

// ---- Pipelined variant (sm_90, pages of a multiple of 16 tokens). A
// producer warp streams 16-token stages through a 20-deep mbarrier ring: K
// and V codes ([16][D] each, 128-byte swizzled for D = 128, 64-byte for
// D = 64) by TMA boxes of a 5-d code map, the scales the stage needs by 1-d
// bulk copies of 16-byte-aligned runs of the page's scale words (a 2-d
// UINT32 tensor map of the scale words stopped the kernel with an illegal
// instruction on the H200, compute-sanitizer: at that map's first load).
// Four consumer warps take the stages in turn and feed the codes from the
// stage straight into fp16 m16n8k16 fragments: no 16-bit copy of K or V is
// written anywhere (docs/QUANTIZED-DECODE.md).
//   Conversion, exact: int8 by the exponent trick (0x6400 | (c ^ 0x80) is
//     1024 + c + 128 in fp16: one byte permute and one fp16x2 subtract per
//     two codes, on the integer and FMA pipes); fp8-e4m3 by the hardware's
//     e4m3x2 -> f16x2 convert (one per two codes). The kernel before this
//     one converted through fp32 and bf16 (1.5-2 conversion instructions a
//     code, at 16 a clock per SM), which held it to ~0.4 of copy.
//   S = Q K^T: the head dims of a dot product may be taken in any order, so
//     lane (g, tig) reads one contiguous run of its tokens' rows: dims
//     [tig D/4, (tig + 1) D/4) of tokens g and g + 8, k-step s taking bytes
//     4s .. 4s + 3 of it (k index 2 tig + {0, 1} is dim tig D/4 + 4s + {0, 1},
//     2 tig + 8 + {0, 1} is + {2, 3}); the Q fragments are permuted alike.
//   O += P V: O's columns may be permuted too: lane (g, tig) feeds dims
//     [g D/8, (g + 1) D/8) of tokens 2 tig + {0, 1} and 8 + 2 tig + {0, 1},
//     and column n of dim tile j is dim n D/8 + j.
//   Range: the MMAs run on fp16, so Q is scaled by the power of two that
//     keeps it within 2^14 (usually 1), and P's factors (the V scales) and
//     the per-channel K scales are divided by the largest of the warp's
//     first stage; the score scale and O take the factors back in fp32.
constexpr int kPRows = 16;  // (row, q head) vectors a CTA: the 16 rows of an m16n8k16 tile
constexpr int kQPStage = 16, kQPConsumers = 4, kQPThreads = (kQPConsumers + 1) * 32, kQPStages = 20;

// The shared memory of a pipelined CTA with a ring of kStages stages.
template <int D, ScaleMode kMode, int kStages = kQPStages>
struct QPipeCfg {
  static_assert(D == 64 || D == 128, "the swizzled code tiles are for head_dim 64 or 128");
  static constexpr int kCodeBytes = kQPStage * D;  // K (or V) codes of a stage
  // A stage's scales, by 1-d bulk copies of 16-byte-aligned runs of the
  // page's scale words: K's at word 0 (per channel: D words; per token: the
  // stage's 16; per head: the aligned 4 that hold it), V's at word kVWord
  // (per token: 16; per head: 4).
  static constexpr int kKWords = kMode == ScaleMode::kKChannelVToken ? D
                                 : kMode == ScaleMode::kPerToken     ? 16
                                                                     : 4,
                       kVWords = kMode == ScaleMode::kPerHead ? 4 : 16;
  static constexpr int kVWord = (kKWords + 31) / 32 * 32;
  static constexpr int kScaleBytes = 4 * (kVWord + 32);
  // The stages' codes (each stage at a multiple of 1024 bytes, the
  // swizzle's period), then their scales.
  static constexpr int kStageBytes = 2 * kCodeBytes;
  static constexpr int kScaleOff = kStages * kStageBytes;
  static constexpr int kRing = kScaleOff + kStages * kScaleBytes;
  static constexpr int kQOff = kRing;
  static constexpr int kBarOff = kQOff + kPRows * D * 2;
  static constexpr int kBytes = kBarOff + 2 * kStages * 8;
  static constexpr int kDynamic = kBytes + 1024;
  static constexpr uint32_t kTxBytes = 2 * kCodeBytes + (kKWords + kVWords) * 4;
  static_assert(kQPConsumers * kPRows * D * 4 <= kRing, "the warps' merge buffer reuses the ring");
  static_assert(kStages % kQPConsumers == 0,
                "each stage belongs to one consumer warp (its barriers' waits are in order)");
  static constexpr int kRingStages = kStages;
};

// Byte offset of byte `b` (of a 16-byte-aligned piece) of row r in a stage's
// [16][D] code tile as the code map's swizzle lays it: 16-byte chunk c of a
// 128-byte row at c ^ (r % 8) (D = 128), of a 64-byte row at c ^ (r / 2 % 4)
// (D = 64).
template <int D>
__device__ __forceinline__ uint32_t CodeAt(int r, int b) {
  if constexpr (D == 128) return (uint32_t)(r * 128 + ((((b >> 4) ^ r) & 7) << 4) + (b & 15));
  return (uint32_t)(r * 64 + ((((b >> 4) ^ (r >> 1)) & 3) << 4) + (b & 15));
}

__device__ __forceinline__ uint32_t HSub2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t HMul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Four codes (bytes 0..3 of w) as two fp16 pairs, (b0, b1) and (b2, b3),
// lower byte in the lower half; exact.
template <KvCodec kCodec>
__device__ __forceinline__ void CodesToHalf2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (kCodec == KvCodec::kInt8) {
    const uint32_t x = w ^ 0x80808080u;  // c + 128, as unsigned bytes
    constexpr uint32_t kMagic = 0x64646464u, k1152 = 0x64806480u;
    lo = HSub2(__byte_perm(x, kMagic, 0x4140), k1152);  // (1024 + c + 128) - 1152
    hi = HSub2(__byte_perm(x, kMagic, 0x4342), k1152);
  } else {
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    lo = (uint32_t)a.x | ((uint32_t)a.y << 16);
    hi = (uint32_t)b.x | ((uint32_t)b.y << 16);
  }
}

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// A consumer warp's Q fragments over the permuted head dims (k-step s,
// registers 0 / 1: rows g / g + 8, dims tig D/4 + 4s + {0, 1}; 2 / 3: the
// same rows, + {2, 3}) in fp16, times the power of two *q_mul that keeps
// them within 2^14 (the same for every warp: each reads all 16 x D values).
template <int D, typename T>
__device__ __forceinline__ void LoadPermutedQ(const uint8_t* sq, uint32_t (&qa)[D / 16][4], float* q_mul) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  float f[D / 16][2][4];
  float mx = 0.f;
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r, d = tig * (D / 4) + 4 * s;
      const T* at = reinterpret_cast<const T*>(sq + Swz<D>(row, d >> 3)) + (d & 7);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[s][r][i] = ToF<T>(at[i]);
        mx = fmaxf(mx, fabsf(f[s][r][i]));
      }
    }
  }
  mx = WarpMax(mx);
  const float m = mx > 16384.f ? exp2f(-ceilf(log2f(mx / 16384.f))) : 1.f;
  *q_mul = m;
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      qa[s][r] = Pack<__half>(f[s][r][0] * m, f[s][r][1] * m);
      qa[s][2 + r] = Pack<__half>(f[s][r][2] * m, f[s][r][3] * m);
    }
  }
}

// A consumer lane (g, tig)'s codes of a stage (K and V code tiles at kc, vc;
// valid_rows of its 16 tokens real) into registers: kw[r] holds dims
// [tig D/4, (tig + 1) D/4) of token g + 8 r's K row, 4 codes a word;
// vw[i] dims [g D/8, (g + 1) D/8) of token (i / 2) 8 + 2 tig + i % 2's V row
// (zeros past valid_rows: never a junk NaN code times P = 0).
template <int D>
__device__ __forceinline__ void LoadStageCodes(const uint8_t* kc, const uint8_t* vc, int valid_rows,
                                               uint32_t (&kw)[2][D / 16], uint32_t (&vw)[4][D / 32]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int c = 0; c < D / 64; ++c) {
      const uint4 v = *reinterpret_cast<const uint4*>(kc + CodeAt<D>(g + 8 * r, tig * (D / 4) + 16 * c));
      kw[r][4 * c] = v.x;
      kw[r][4 * c + 1] = v.y;
      kw[r][4 * c + 2] = v.z;
      kw[r][4 * c + 3] = v.w;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = (i >> 1) * 8 + 2 * tig + (i & 1);
    const bool ok = tok < valid_rows;
    if constexpr (D == 128) {
      const uint4 v = ok ? *reinterpret_cast<const uint4*>(vc + CodeAt<D>(tok, g * 16)) : make_uint4(0, 0, 0, 0);
      vw[i][0] = v.x;
      vw[i][1] = v.y;
      vw[i][2] = v.z;
      vw[i][3] = v.w;
    } else {
      const uint2 v = ok ? *reinterpret_cast<const uint2*>(vc + CodeAt<D>(tok, g * 8)) : make_uint2(0, 0);
      vw[i][0] = v.x;
      vw[i][1] = v.y;
    }
  }
}

// Stage t of a consumer warp, once landed (waits on its full barrier): its
// ring slot, code tiles and scales, its first token and how many of its 16
// tokens are real.
template <class C>
struct QStage {
  int slot, tile_first, valid_rows;
  const uint8_t *kc, *vc;
  const float* scl;
  __device__ __forceinline__ QStage(uint8_t* smem, uint32_t full0, int t, int tok_lo, int tok_hi) {
    slot = t % C::kRingStages;
    MbarWait(full0 + 8 * slot, (t / C::kRingStages) & 1);
    kc = smem + slot * C::kStageBytes;
    vc = kc + C::kCodeBytes;
    scl = reinterpret_cast<const float*>(smem + C::kScaleOff + slot * C::kScaleBytes);
    tile_first = tok_lo + t * kQPStage;
    valid_rows = min(kQPStage, tok_hi - tile_first);
  }
};

// The K and V scales of token `tok` of a stage (scales at scl; k_sub,
// v_sub: the per-head scales' words in their aligned runs): K's per token or
// head (1 per channel: those are per dim), V's per token or head, 0 past the
// stage's valid_rows (P is 0 there, but 0 x a junk slot's NaN scale is not).
template <class C, ScaleMode kMode>
__device__ __forceinline__ void TokenScales(const float* scl, int tok, int valid_rows, int k_sub, int v_sub, float* ks,
                                            float* vs) {
  *ks = kMode == ScaleMode::kPerToken ? scl[tok] : kMode == ScaleMode::kPerHead ? scl[k_sub] : 1.f;
  *vs = tok < valid_rows ? (kMode == ScaleMode::kPerHead ? scl[C::kVWord + v_sub] : scl[C::kVWord + tok]) : 0.f;
}

// Barriers of a pipelined CTA's ring (thread 0): full (the producer's
// expect-tx arrival) and empty (the consumer warp that took the stage).
template <class C>
__device__ __forceinline__ void QInitRing(uint32_t full0, uint32_t empty0) {
  for (int i = 0; i < C::kRingStages; ++i) {
    MbarInit(full0 + 8 * i, 1);
    MbarInit(empty0 + 8 * i, 1);
  }
}

// The producer warp of a pipelined CTA (every lane calls it): streams the
// CTA's ntiles 16-token stages of K and V codes (TMA boxes of code_map) and
// their scales (bulk copies) through the ring of config C at smem, stage t
// into slot t % stages once its consumer has released the slot's previous
// stage (empty0), completing on full0's barriers. The page ids come from a
// window of 64 in registers, as in the bf16 kernel.
template <class C, int D, ScaleMode kMode>
__device__ __forceinline__ void QProduceStages(const PagedKvView& kv, const DecodeWork& w, uint8_t* smem,
                                               uint32_t full0, uint32_t empty0, const CUtensorMap* code_map,
                                               int ntiles) {
  const int h = w.h, pb = w.pb, npages = w.npages, tok_lo = w.tok_lo, bt = kv.block_tokens;
  const int L = kv.layer, H = kv.kv_heads, lane = threadIdx.x & 31;
  const int E = (int)(((uint64_t)2 * kv.layers * H * bt * D) / 4);  // first scale word of a page
  const int kplane = (L * 2) * H + h, vplane = kplane + H;
  // The codes are read once: their lines leave L2 first.
  const uint64_t evict_first = L2EvictFirstPolicy();
  PageWindow win;
  win.Load(kv, pb, npages, tok_lo / bt);
  for (int t = 0; t < ntiles; ++t) {
    const int st = t % C::kRingStages;
    const int i0 = tok_lo + t * kQPStage, pg = i0 / bt, off = i0 - pg * bt;
    const int page = win.Page(pg);
    win.Advance(kv, pb, npages, (i0 + kQPStage) / bt);
    if (t >= C::kRingStages) MbarWait(empty0 + 8 * st, ((t / C::kRingStages) - 1) & 1);
    if (lane == 0) {
      const uint32_t kc = SmemAddr(smem + st * C::kStageBytes), vc = kc + C::kCodeBytes;
      const uint32_t sc = SmemAddr(smem + C::kScaleOff + st * C::kScaleBytes);
      const uint32_t bar = full0 + 8 * st;
      MbarArriveExpectTx(bar, C::kTxBytes);
      TmaLoad5dHint(kc, code_map, 0, off, kplane, 0, page, bar, evict_first);
      TmaLoad5dHint(vc, code_map, 0, off, vplane, 0, page, bar, evict_first);
      int kidx, vidx;  // word indices of the stage's first K and V scale in the page
      if constexpr (kMode == ScaleMode::kPerHead) {
        kidx = E + (L * 2) * H + h;
        vidx = E + (L * 2 + 1) * H + h;
      } else if constexpr (kMode == ScaleMode::kPerToken) {
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
      if constexpr (kMode == ScaleMode::kPerHead) {
        kidx &= ~3;
        vidx &= ~3;
      }
      BulkLoad(sc, pg_base + 4 * (uint64_t)kidx, 4 * C::kKWords, bar);
      BulkLoad(sc + 4 * C::kVWord, pg_base + 4 * (uint64_t)vidx, 4 * C::kVWords, bar);
    }
    __syncwarp();
  }
}

template <int D, typename T, KvCodec kCodec, ScaleMode kMode>
__global__ void __launch_bounds__(kQPThreads, 2)
    QDecodePipelinedKernel(AttnParams p, QueryView q, PagedKvView kv, int num_splits, int row_groups, float* part_out,
                           float* part_lse, float* out, float* lse, const __grid_constant__ CUtensorMap code_map) {
  using C = QPipeCfg<D, kMode>;
  constexpr int kKSteps = D / 16, kDTiles = D / 8;
  constexpr int kKWordsLane = D / 16, kVWordsLane = D / 32;  // a lane's words of a K / V row
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (SmemBase1024(smem_raw) - SmemAddr(smem_raw));
  uint8_t* sq = smem + C::kQOff;
  const uint32_t full0 = SmemAddr(smem + C::kBarOff), empty0 = full0 + 8 * C::kRingStages;
  __shared__ int s_qpos[kPRows];
  __shared__ int s_qmin, s_qmax;
  __shared__ float s_m[kQPConsumers][kPRows], s_l[kQPConsumers][kPRows], s_fac[kQPConsumers][kPRows];

  if (threadIdx.x == 0) {
    TmaPrefetchMap(&code_map);
    QInitRing<C>(full0, empty0);
  }
  DecodeWork w;
  if (!DecodeWorkOf(q, kv, num_splits, row_groups, kPRows, &w)) return;
  const int h = w.h, pb = w.pb;
  const int tok_lo = w.tok_lo, tok_hi = w.tok_hi, bt = kv.block_tokens;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
  const float scale = (p.softmax_scale > 0 ? p.softmax_scale : rsqrtf((float)D)) * kLog2e;
  const int ntiles = tok_hi > tok_lo ? (tok_hi - tok_lo + kQPStage - 1) / kQPStage : 0;

  LoadDecodeQueries<D, T>(q, w, sq, s_qpos, &s_qmin, &s_qmax, kQPThreads);
  __syncthreads();

  float o[kDTiles][4];
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  float vref = 1.f;  // O's factor back (the V scales' reference)
  const int L = kv.layer, H = kv.kv_heads;
  // Per-head scales: their word within the aligned run of 4 that is copied
  // (a page's scales start at a multiple of 4 words).
  const int k_sub = ((L * 2) * H + h) & 3, v_sub = ((L * 2 + 1) * H + h) & 3;
  if (warp == kQPConsumers) {
    QProduceStages<C, D, kMode>(kv, w, smem, full0, empty0, &code_map, ntiles);
  } else {
    // ---- consumers
    uint32_t qa[kKSteps][4];
    float q_mul;
    LoadPermutedQ<D, T>(sq, qa, &q_mul);
    float sscale = scale / q_mul, inv_vref = 1.f, inv_kref = 1.f;
    const int qpos0 = s_qpos[g], qpos1 = s_qpos[g + 8], qmin = s_qmin, qmax = s_qmax;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    const bool cta_pos_mask =
        DecodeMaskMayHide(p, tok_lo, tok_hi, DecodeStreamEnds(p, kv, pb, tok_lo, tok_hi), qmin, qmax);
    for (int t = warp; t < ntiles; t += kQPConsumers) {
      const QStage<C> sg(smem, full0, t, tok_lo, tok_hi);
      const int st = sg.slot, tile_first = sg.tile_first, valid_rows = sg.valid_rows;
      const uint8_t *kc = sg.kc, *vc = sg.vc;
      const float* scl = sg.scl;
      // The lane's codes and scales into registers, then the stage goes back.
      uint32_t kw[2][kKWordsLane], vw[4][kVWordsLane];
      LoadStageCodes<D>(kc, vc, valid_rows, kw, vw);
      // This lane's tokens' scales: S columns (K per token / page) and P (V).
      float ks[4], vs[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        TokenScales<C, kMode>(scl, (e >> 1) * 8 + tig * 2 + (e & 1), valid_rows, k_sub, v_sub, &ks[e], &vs[e]);
      }
      float kch[kMode == ScaleMode::kKChannelVToken ? D / 4 : 1];  // per channel: the lane's dims' K scales
      if constexpr (kMode == ScaleMode::kKChannelVToken) {
#pragma unroll
        for (int i = 0; i < D / 4; ++i) kch[i] = scl[tig * (D / 4) + i];
      }
      __syncwarp();
      if (lane == 0) MbarArrive(empty0 + 8 * st);
      if (t == warp) {
        // The warp's first stage sets the references (uniform in the warp).
        const float vmax = WarpMax(fmaxf(fmaxf(vs[0], vs[1]), fmaxf(vs[2], vs[3])));
        vref = vmax > 0.f && vmax < INFINITY ? vmax : 1.f;
        inv_vref = 1.f / vref;
        if constexpr (kMode == ScaleMode::kKChannelVToken) {
          float kmax = 0.f;
#pragma unroll
          for (int i = 0; i < D / 4; ++i) kmax = fmaxf(kmax, fabsf(kch[i]));
          kmax = WarpMax(kmax);
          const float kref = kmax > 0.f && kmax < INFINITY ? kmax : 1.f;
          inv_kref = 1.f / kref;
          sscale *= kref;
        }
      }
      // S = Q K^T over the permuted dims.
      float sc[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) {
        uint32_t kf0 = 0, kf1 = 0;
        if constexpr (kMode == ScaleMode::kKChannelVToken) {
          kf0 = Pack<__half>(kch[4 * s] * inv_kref, kch[4 * s + 1] * inv_kref);
          kf1 = Pack<__half>(kch[4 * s + 2] * inv_kref, kch[4 * s + 3] * inv_kref);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          uint32_t b0, b1;
          CodesToHalf2<kCodec>(kw[r][s], b0, b1);
          if constexpr (kMode == ScaleMode::kKChannelVToken) {
            b0 = HMul2(b0, kf0);
            b1 = HMul2(b1, kf1);
          }
          Mma<__half>(sc[r], qa[s], b0, b1);
        }
      }
      DecodeMaskScores<kMode != ScaleMode::kKChannelVToken>(p, kv, pb, tile_first, tok_hi, qpos0, qpos1, qmin, qmax,
                                                            cta_pos_mask, sscale, ks, sc);
      float ps[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) ps[e] = vs[e] * inv_vref;
      uint32_t pa[4];
      DecodeSoftmax<D, __half, true>(sc, ps, m0, m1, l0, l1, o, pa);
      // O += P V: per word of the lane's V run, tokens (2 tig, 2 tig + 1)
      // interleaved byte by byte, and (8 + those).
#pragma unroll
      for (int wd = 0; wd < kVWordsLane; ++wd) {
        uint32_t b0[4], b1[4];
        CodesToHalf2<kCodec>(__byte_perm(vw[0][wd], vw[1][wd], 0x5140), b0[0], b0[1]);
        CodesToHalf2<kCodec>(__byte_perm(vw[0][wd], vw[1][wd], 0x7362), b0[2], b0[3]);
        CodesToHalf2<kCodec>(__byte_perm(vw[2][wd], vw[3][wd], 0x5140), b1[0], b1[1]);
        CodesToHalf2<kCodec>(__byte_perm(vw[2][wd], vw[3][wd], 0x7362), b1[2], b1[3]);
#pragma unroll
        for (int i = 0; i < 4; ++i) Mma<__half>(o[4 * wd + i], pa, b0[i], b1[i]);
      }
    }
    l0 = QuadSum(l0);
    l1 = QuadSum(l1);
  }
  __syncthreads();  // every stage consumed: the ring is free for the consumers' (m, l, O)
  // (m, l, O) of the consumers: kQPConsumers x kPRows x D floats.
  float* so = reinterpret_cast<float*>(smem);
  if (warp < kQPConsumers) {
    if (tig == 0) {
      s_m[warp][g] = m0;
      s_m[warp][g + 8] = m1;
      s_l[warp][g] = l0;
      s_l[warp][g + 8] = l1;
    }
    // Column n of dim tile j is dim n D/8 + j.
    float* r0p = so + ((size_t)warp * kPRows + g) * D;
    float* r1p = so + ((size_t)warp * kPRows + g + 8) * D;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      const int d0 = (2 * tig) * (D / 8) + j, d1 = d0 + D / 8;
      r0p[d0] = o[j][0] * vref;
      r0p[d1] = o[j][1] * vref;
      r1p[d0] = o[j][2] * vref;
      r1p[d1] = o[j][3] * vref;
    }
  }
  __syncthreads();
  StoreDecodeRows<kQPConsumers, D, D>(w, q, kPRows, num_splits, &s_m[0][0], &s_l[0][0], so, &s_fac[0][0], part_out,
                                      part_lse, out, lse);
}

// ---- The pipelined kernel for small GQA groups (up to 8 (row, q head)
// vectors a kv head and sequence: a decode step of Llama-3-8B heads has 4):
// the same producer, ring and stage format, but the MMAs swap their operands
// so that the 16 rows of an m16n8k16 tile are the stage's 16 tokens and its
// 8 columns the vectors (the 16-row kernel above fills 4 of its 16 rows with
// queries at G = 4 and computes on zeros for the rest):
//   S^T = K Q^T: A is the lane's K codes as they are loaded (tokens g, g + 8;
//     the permuted dims of the 16-row kernel), B the Q fragments of vector g
//     (D/16 x 2 registers, against D/16 x 4 there).
//   P^T: S^T's accumulator (tokens g, g + 8 x vectors 2 tig, 2 tig + 1) in
//     fp16 is two 8 x 8 matrices in the A/C fragment layout; movmatrix.trans
//     turns each into the B fragment of P V (tokens 2 tig, 2 tig + 1 x
//     vector g) in registers.
//   O^T += V^T P^T: A is V's codes as loaded (the interleaved token pairs of
//     the 16-row kernel's B operand), rows of m-tile mt being dims
//     g D/8 + 2 mt + {0, 1}.
// Half the MMAs and half the accumulator registers of the 16-row kernel
// (O: D/16 x 4 floats a lane), which with a 12-stage ring leaves room for 3
// CTAs an SM instead of 2: the 16-row kernel is latency-bound at 10 warps an
// SM (docs/QUANTIZED-DECODE.md).
constexpr int kSRows = kSmallGroupVectors, kSStages = 12;

__device__ __forceinline__ uint32_t MovTrans(uint32_t x) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(x));
  return d;
}

// A consumer lane (g, tig)'s Q fragments for S^T = K Q^T (B operands, vector
// g; k-step s, register 0: dims tig D/4 + 4 s + {0, 1}, 1: + {2, 3}) in fp16,
// times the power of two *q_mul that keeps them within 2^14.
template <int D, typename T>
__device__ __forceinline__ void LoadPermutedQT(const uint8_t* sq, uint32_t (&qb)[D / 16][2], float* q_mul) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  float f[D / 16][4];
  float mx = 0.f;
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    const int d = tig * (D / 4) + 4 * s;
    const T* at = reinterpret_cast<const T*>(sq + Swz<D>(g, d >> 3)) + (d & 7);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[s][i] = ToF<T>(at[i]);
      mx = fmaxf(mx, fabsf(f[s][i]));
    }
  }
  mx = WarpMax(mx);
  const float m = mx > 16384.f ? exp2f(-ceilf(log2f(mx / 16384.f))) : 1.f;
  *q_mul = m;
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    qb[s][0] = Pack<__half>(f[s][0] * m, f[s][1] * m);
    qb[s][1] = Pack<__half>(f[s][2] * m, f[s][3] * m);
  }
}

// The maximum of x over the 8 lanes of a column of an m16n8 fragment (the
// lanes of one tig).
__device__ __forceinline__ float ColMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float ColSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

template <int D, typename T, KvCodec kCodec, ScaleMode kMode>
__global__ void __launch_bounds__(kQPThreads, kSmallGroupCtasPerSm)
    QDecodeSwapKernel(AttnParams p, QueryView q, PagedKvView kv, int num_splits, int row_groups, float* part_out,
                      float* part_lse, float* out, float* lse, const __grid_constant__ CUtensorMap code_map) {
  using C = QPipeCfg<D, kMode, kSStages>;
  constexpr int kKSteps = D / 16, kMTiles = D / 16;
  constexpr int kKWordsLane = D / 16, kVWordsLane = D / 32;  // a lane's words of a K / V row
  constexpr bool kChannel = kMode == ScaleMode::kKChannelVToken;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (SmemBase1024(smem_raw) - SmemAddr(smem_raw));
  uint8_t* sq = smem + C::kQOff;
  const uint32_t full0 = SmemAddr(smem + C::kBarOff), empty0 = full0 + 8 * C::kRingStages;
  __shared__ int s_qpos[kPRows];  // (LoadDecodeQueries fills 16; vectors 8 .. 15 are never this CTA's)
  __shared__ int s_qmin, s_qmax;
  __shared__ float s_m[kQPConsumers][kSRows], s_l[kQPConsumers][kSRows], s_fac[kQPConsumers][kSRows];

  if (threadIdx.x == 0) {
    TmaPrefetchMap(&code_map);
    QInitRing<C>(full0, empty0);
  }
  DecodeWork w;
  if (!DecodeWorkOf(q, kv, num_splits, row_groups, kSRows, &w)) return;
  const int h = w.h, pb = w.pb, tok_lo = w.tok_lo, tok_hi = w.tok_hi;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
  const float scale = (p.softmax_scale > 0 ? p.softmax_scale : rsqrtf((float)D)) * kLog2e;
  const int ntiles = tok_hi > tok_lo ? (tok_hi - tok_lo + kQPStage - 1) / kQPStage : 0;

  LoadDecodeQueries<D, T>(q, w, sq, s_qpos, &s_qmin, &s_qmax, kQPThreads);
  __syncthreads();

  float o[kMTiles][4];  // O^T: m-tile mt rows g / g + 8 = dims g D/8 + 2 mt + 0 / 1, columns vectors 2 tig + {0, 1}
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // vectors 2 tig, 2 tig + 1 (l: this lane's tokens)
  float vref = 1.f;                                          // O's factor back (the V scales' reference)
  const int L = kv.layer, H = kv.kv_heads;
  const int k_sub = ((L * 2) * H + h) & 3, v_sub = ((L * 2 + 1) * H + h) & 3;
  if (warp == kQPConsumers) {
    QProduceStages<C, D, kMode>(kv, w, smem, full0, empty0, &code_map, ntiles);
  } else {
    uint32_t qb[kKSteps][2];
    float q_mul;
    LoadPermutedQT<D, T>(sq, qb, &q_mul);
    float sscale = scale / q_mul, inv_vref = 1.f, inv_kref = 1.f;
    const int qpos0 = s_qpos[2 * tig], qpos1 = s_qpos[2 * tig + 1], qmin = s_qmin, qmax = s_qmax;
#pragma unroll
    for (int j = 0; j < kMTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    const bool cta_pos_mask =
        DecodeMaskMayHide(p, tok_lo, tok_hi, DecodeStreamEnds(p, kv, pb, tok_lo, tok_hi), qmin, qmax);
    for (int t = warp; t < ntiles; t += kQPConsumers) {
      const QStage<C> sg(smem, full0, t, tok_lo, tok_hi);
      const int st = sg.slot, tile_first = sg.tile_first, valid_rows = sg.valid_rows;
      const uint8_t *kc = sg.kc, *vc = sg.vc;
      const float* scl = sg.scl;
      uint32_t kw[2][kKWordsLane], vw[4][kVWordsLane];
      LoadStageCodes<D>(kc, vc, valid_rows, kw, vw);
      // The scales of this lane's tokens g and g + 8 (rows of S^T and P^T).
      float ks[2], vs[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) TokenScales<C, kMode>(scl, g + 8 * r, valid_rows, k_sub, v_sub, &ks[r], &vs[r]);
      // Per channel: the K scales fold into Q (S = sum over d of q_d ks_d k_d):
      // this stage's Q fragments, over the lane's dims.
      uint32_t qs[kChannel ? kKSteps : 1][2];
      if constexpr (kChannel) {
        if (t == warp) {  // the warp's first stage sets K's reference (uniform in the warp)
          float kmax = 0.f;
#pragma unroll
          for (int i = 0; i < D / 4; ++i) kmax = fmaxf(kmax, fabsf(scl[tig * (D / 4) + i]));
          kmax = WarpMax(kmax);
          const float kref = kmax > 0.f && kmax < INFINITY ? kmax : 1.f;
          inv_kref = 1.f / kref;
          sscale *= kref;
        }
#pragma unroll
        for (int s = 0; s < kKSteps; ++s) {
          const float4 c = *reinterpret_cast<const float4*>(scl + tig * (D / 4) + 4 * s);
          qs[s][0] = HMul2(qb[s][0], Pack<__half>(c.x * inv_kref, c.y * inv_kref));
          qs[s][1] = HMul2(qb[s][1], Pack<__half>(c.z * inv_kref, c.w * inv_kref));
        }
      }
      __syncwarp();
      if (lane == 0) MbarArrive(empty0 + 8 * st);
      if (t == warp) {  // the warp's first stage sets V's reference (uniform in the warp)
        const float vmax = WarpMax(fmaxf(vs[0], vs[1]));
        vref = vmax > 0.f && vmax < INFINITY ? vmax : 1.f;
        inv_vref = 1.f / vref;
      }
      // S^T = K Q^T, the k-steps in two independent chains.
      float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) {
        uint32_t a[4];
        CodesToHalf2<kCodec>(kw[0][s], a[0], a[2]);
        CodesToHalf2<kCodec>(kw[1][s], a[1], a[3]);
        if constexpr (kChannel) {
          Mma<__half>(sc[s & 1], a, qs[s][0], qs[s][1]);
        } else {
          Mma<__half>(sc[s & 1], a, qb[s][0], qb[s][1]);
        }
      }
      // Scale and mask: element e is token g + 8 (e / 2), vector 2 tig + e % 2.
      float x[4];
      {
        const int tile_last = min(tile_first + kQPStage, tok_hi) - 1;
        const bool pos_mask = cta_pos_mask && ((p.causal && TokenPos(kv, pb, tile_last) > qmin) ||
                                               (p.window > 0 && TokenPos(kv, pb, tile_first) <= qmax - p.window));
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = tile_first + g + 8 * r;
          const bool in = g + 8 * r < valid_rows;
          const int kp = in && pos_mask ? TokenPos(kv, pb, i) : 0;
          const float f = kMode == ScaleMode::kKChannelVToken ? sscale : sscale * ks[r];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int qp = c == 0 ? qpos0 : qpos1;
            bool vis = in && qp != INT32_MIN;
            if (vis && pos_mask) {
              if (p.causal) vis = kp <= qp;
              if (p.window > 0) vis = vis && kp > qp - p.window;
            }
            x[2 * r + c] = vis ? (sc[0][2 * r + c] + sc[1][2 * r + c]) * f : -INFINITY;
          }
        }
      }
      // Online softmax per vector (a column: the 8 lanes of this tig).
      const float mx0 = ColMax(fmaxf(x[0], x[2])), mx1 = ColMax(fmaxf(x[1], x[3]));
      const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);
      const float c0 = nm0 == -INFINITY ? 1.f : exp2f(m0 - nm0);
      const float c1 = nm1 == -INFINITY ? 1.f : exp2f(m1 - nm1);
      const float b0f = nm0 == -INFINITY ? 0.f : nm0, b1f = nm1 == -INFINITY ? 0.f : nm1;
      x[0] = exp2f(x[0] - b0f);
      x[2] = exp2f(x[2] - b0f);
      x[1] = exp2f(x[1] - b1f);
      x[3] = exp2f(x[3] - b1f);
      l0 = l0 * c0 + x[0] + x[2];
      l1 = l1 * c1 + x[1] + x[3];
      m0 = nm0;
      m1 = nm1;
      if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
        for (int j = 0; j < kMTiles; ++j) {
          o[j][0] *= c0;
          o[j][1] *= c1;
          o[j][2] *= c0;
          o[j][3] *= c1;
        }
      }
      // P^T times the tokens' V scales, as P V's B fragments.
      const float p0 = vs[0] * inv_vref, p1 = vs[1] * inv_vref;
      const uint32_t pb0 = MovTrans(Pack<__half>(x[0] * p0, x[1] * p0));
      const uint32_t pb1 = MovTrans(Pack<__half>(x[2] * p1, x[3] * p1));
      // O^T += V^T P^T: per word of the lane's V run, tokens (2 tig, 2 tig + 1)
      // interleaved byte by byte, and (8 + those): dims 4 wd + {0, 1} are
      // m-tile 2 wd, + {2, 3} m-tile 2 wd + 1.
#pragma unroll
      for (int wd = 0; wd < kVWordsLane; ++wd) {
        uint32_t a0[4], a1[4];  // [e]: dim 4 wd + e of tokens (2 tig, 2 tig + 1) / (8 + 2 tig, 9 + 2 tig)
        CodesToHalf2<kCodec>(__byte_perm(vw[0][wd], vw[1][wd], 0x5140), a0[0], a0[1]);
        CodesToHalf2<kCodec>(__byte_perm(vw[0][wd], vw[1][wd], 0x7362), a0[2], a0[3]);
        CodesToHalf2<kCodec>(__byte_perm(vw[2][wd], vw[3][wd], 0x5140), a1[0], a1[1]);
        CodesToHalf2<kCodec>(__byte_perm(vw[2][wd], vw[3][wd], 0x7362), a1[2], a1[3]);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t a[4] = {a0[2 * hh], a0[2 * hh + 1], a1[2 * hh], a1[2 * hh + 1]};
          Mma<__half>(o[2 * wd + hh], a, pb0, pb1);
        }
      }
    }
    l0 = ColSum(l0);
    l1 = ColSum(l1);
  }
  __syncthreads();                             // every stage consumed: the ring is free for the consumers' (m, l, O)
  float* so = reinterpret_cast<float*>(smem);  // [kQPConsumers][kSRows][D]
  if (warp < kQPConsumers) {
    if (g == 0) {
      s_m[warp][2 * tig] = m0;
      s_m[warp][2 * tig + 1] = m1;
      s_l[warp][2 * tig] = l0;
      s_l[warp][2 * tig + 1] = l1;
    }
    float* v0p = so + ((size_t)warp * kSRows + 2 * tig) * D;
    float* v1p = v0p + D;
#pragma unroll
    for (int j = 0; j < kMTiles; ++j) {
      const int d = g * (D / 8) + 2 * j;
      v0p[d] = o[j][0] * vref;
      v1p[d] = o[j][1] * vref;
      v0p[d + 1] = o[j][2] * vref;
      v1p[d + 1] = o[j][3] * vref;
    }
  }
  __syncthreads();
  StoreDecodeRows<kQPConsumers, D, D>(w, q, kSRows, num_splits, &s_m[0][0], &s_l[0][0], so, &s_fac[0][0], part_out,
                                      part_lse, out, lse);
}

template <int D, KvCodec kCodec, ScaleMode kMode, typename T>
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

template <int D, KvCodec kCodec, ScaleMode kMode, typename T>
cudaError_t LaunchSwap(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                       float* po, float* pl, const CUtensorMap& codes, cudaStream_t stream) {
  const int G = q.q_heads / kv.kv_heads;
  const int row_groups = (q.max_rows_per_seq * G + kSRows - 1) / kSRows;
  const int smem = QPipeCfg<D, kMode, kSStages>::kDynamic;
  cudaError_t e =
      cudaFuncSetAttribute(QDecodeSwapKernel<D, T, kCodec, kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  dim3 grid(splits, kv.kv_heads * row_groups, kv.num_seqs);
  QDecodeSwapKernel<D, T, kCodec, kMode>
      <<<grid, kQPThreads, smem, stream>>>(p, q, kv, splits, row_groups, po, pl, out.out, out.lse, codes);
  return cudaGetLastError();
}

template <int D, KvCodec kCodec, ScaleMode kMode, typename T>
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
                       float* po, float* pl, cudaStream_t s, QuantDecodeKernel kernel) {
  if constexpr (D <= 128) {  // (the pipelined kernels' code tiles are one 128-byte swizzled row a token at most)
    alignas(64) CUtensorMap codes{};
    if (MakeQuantCodeMap(kv, kQPStage, &codes)) {  // sm_90, pages of a multiple of 16 tokens
      const bool fits = QuantizedDecodeVectorsPerCta(q, kv) == kSRows;
      if (kernel == QuantDecodeKernel::kSmallGroups && !fits) return cudaErrorNotSupported;
      const bool small = kernel == QuantDecodeKernel::kSmallGroups || (kernel == QuantDecodeKernel::kAuto && fits);
      return WithEncoding(kv.encoding, [&]<KvCodec kCodec, ScaleMode kMode>() {
        return small ? LaunchSwap<D, kCodec, kMode, T>(p, q, kv, out, splits, po, pl, codes, s)
                     : LaunchPipelined<D, kCodec, kMode, T>(p, q, kv, out, splits, po, pl, codes, s);
      });
    }
  }
  if (kernel != QuantDecodeKernel::kAuto) return cudaErrorNotSupported;
  return WithEncoding(kv.encoding, [&]<KvCodec kCodec, ScaleMode kMode>() {
    return Launch<D, kCodec, kMode, T>(p, q, kv, out, splits, po, pl, s);
  });
}

}  // namespace

cudaError_t QuantizedDecode(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                            float* po, float* pl, cudaStream_t stream, QuantDecodeKernel kernel) {
  return WithHeadDim(
      kv, [&]<int D, typename T>() { return ByEncoding<D, T>(p, q, kv, out, splits, po, pl, stream, kernel); });
}

}  // namespace internal
}  // namespace kvring::cuda
