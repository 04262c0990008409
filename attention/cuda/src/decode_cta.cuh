// The work split and split merge of a decode CTA (internal; used by
// paged_decode_cuda.cu and paged_decode_quant_cuda.cu).
#pragma once

#include "device_ptx.cuh"
#include "kvring/attention/cuda/paged_decode_cuda.h"
#include "page_access.cuh"

namespace kvring::cuda::internal {

// The work of one decode CTA of grid (splits, kv_heads x row groups,
// sequences): kv head h of sequence s, the "vectors" v0 .. v0+nv-1 of its
// GQA group (vector v: query row rb + v / G, q head h * G + v % G) and the
// stream tokens [tok_lo, tok_hi) of split sp.
struct DecodeWork {
  int sp, h, s, G, rb, v0, nv, pb, npages, ntok, tok_lo, tok_hi;
};
// False when this CTA's row group is past the sequence's rows (no work).
__device__ __forceinline__ bool DecodeWorkOf(const QueryView& q, const PagedKvView& kv, int num_splits, int row_groups,
                                             int rows_per_cta, DecodeWork* w) {
  w->sp = blockIdx.x;
  w->h = blockIdx.y / row_groups;
  w->s = blockIdx.z;
  w->G = q.q_heads / kv.kv_heads;
  w->rb = q.seq_row_begin[w->s];
  w->v0 = (blockIdx.y % row_groups) * rows_per_cta;
  const int nvec = (q.seq_row_begin[w->s + 1] - w->rb) * w->G;
  if (w->v0 >= nvec) return false;
  w->nv = min(rows_per_cta, nvec - w->v0);
  const int bt = kv.block_tokens;
  w->pb = kv.seq_page_begin[w->s];
  w->npages = kv.seq_page_begin[w->s + 1] - w->pb;
  w->ntok = kv.seq_tokens[w->s];
  const int pps = (w->npages + num_splits - 1) / num_splits;
  w->tok_lo = w->sp * pps * bt;
  w->tok_hi = min(w->ntok, min(w->npages, w->sp * pps + pps) * bt);
  return true;
}
// The pipelined decode over quantized pages for small GQA groups
// (QDecodeSwapKernel): the (row, q head) vectors a CTA holds and the CTAs an
// SM runs (its launch bounds); the 16-row kernel holds 16 and runs 2.
inline constexpr int kSmallGroupVectors = 8, kSmallGroupCtasPerSm = 3;
// The vectors a CTA of that decode holds: kSmallGroupVectors when a kv head
// of a sequence has at most that many and head_dim is at most 128, else 16.
// Host and device.
__host__ __device__ inline int QuantizedDecodeVectorsPerCta(const QueryView& q, const PagedKvView& kv) {
  return kv.head_dim <= 128 && q.max_rows_per_seq * (q.q_heads / kv.kv_heads) <= kSmallGroupVectors ? kSmallGroupVectors
                                                                                                    : 16;
}
// CTAs of that kernel an SM runs at once.
__host__ __device__ inline int QuantizedDecodeCtasPerSm(const QueryView& q, const PagedKvView& kv) {
  return QuantizedDecodeVectorsPerCta(q, kv) == kSmallGroupVectors ? kSmallGroupCtasPerSm : 2;
}

// The listed pages of a decode CTA's stream as a window of 64 page ids in the
// registers of one warp (lane l: listed pages wb + l and wb + 32 + l), so a
// producer issuing a stage never waits on a dependent global load: the next
// 32 ids are loaded when the stream passes the window's first half, 32
// pages before their use. Every lane of the warp calls every method.
struct PageWindow {
  int wb = 0, cur = 0, nxt = 0;
  // The window from listed page `first` of the sequence whose pages start at
  // pb (npages of them).
  __device__ __forceinline__ void Load(const PagedKvView& kv, int pb, int npages, int first) {
    const int lane = threadIdx.x & 31;
    wb = first;
    cur = wb + lane < npages ? kv.page_ids[pb + wb + lane] : 0;
    nxt = wb + 32 + lane < npages ? kv.page_ids[pb + wb + 32 + lane] : 0;
  }
  // Pool page of listed page pg, wb <= pg < wb + 64 (this lane's pg).
  __device__ __forceinline__ int Page(int pg) const {
    const int local = pg - wb;
    const int a = __shfl_sync(0xffffffffu, cur, local & 31), b = __shfl_sync(0xffffffffu, nxt, local & 31);
    return local < 32 ? a : b;
  }
  // Slides by 32 pages when listed page `next` (the next stage's first) is
  // past the window's first half.
  __device__ __forceinline__ void Advance(const PagedKvView& kv, int pb, int npages, int next) {
    if (next - wb >= 32) {
      const int lane = threadIdx.x & 31;
      wb += 32;
      cur = nxt;
      nxt = wb + 32 + lane < npages ? kv.page_ids[pb + wb + 32 + lane] : 0;
    }
  }
};
// (row, q head) index of vector v.
__device__ __forceinline__ size_t DecodeRowHead(const DecodeWork& w, const QueryView& q, int v) {
  return (size_t)(w.rb + v / w.G) * q.q_heads + w.h * w.G + v % w.G;
}
// The 16 query vectors of a decode CTA (vector r < nv: query row rb + (v0 +
// r) / G, q head h * G + (v0 + r) % G; rows past nv zero) into shared memory
// `sq` as [16][D] 16-bit values, 128-byte swizzled (Swz<D>), by cp.async;
// their positions into s_qpos (INT32_MIN past nv) and their min / max into
// *s_qmin / *s_qmax. Called by threads 0 .. nthreads - 1, which wait for
// their copies; the caller's barrier publishes the results.
template <int D, typename T>
__device__ __forceinline__ void LoadDecodeQueries(const QueryView& q, const DecodeWork& w, uint8_t* sq, int* s_qpos,
                                                  int* s_qmin, int* s_qmax, int nthreads) {
  constexpr int kChunks = D / 8, kVecs = 16;
  const int tid = threadIdx.x;
  for (int c = tid; c < kVecs * kChunks; c += nthreads) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool valid = r < w.nv;
    const int v = w.v0 + (valid ? r : 0);
    const T* src =
        static_cast<const T*>(q.q) + ((size_t)(w.rb + v / w.G) * q.q_heads + w.h * w.G + v % w.G) * D + ch * 8;
    CpAsync16(SmemAddr(sq + Swz<D>(r, ch)), src, valid);
  }
  CpAsyncCommit();
  if (tid < kVecs) s_qpos[tid] = tid < w.nv ? q.positions[w.rb + (w.v0 + tid) / w.G] : INT32_MIN;
  if (tid == 0) {
    int mn = INT32_MAX, mx = INT32_MIN;
    for (int r = 0; r < w.nv; ++r) {
      const int qp = q.positions[w.rb + (w.v0 + r) / w.G];
      mn = min(mn, qp);
      mx = max(mx, qp);
    }
    *s_qmin = mn;
    *s_qmax = mx;
  }
  CpAsyncWait<0>();
}

// A decode consumer warp's Q fragments: the 16 vectors LoadDecodeQueries
// left at `sq` as the A operands of m16n8k16 MMAs, one set per 16 of D.
template <int D>
__device__ __forceinline__ void LoadDecodeQFragments(const uint8_t* sq, uint32_t (&qa)[D / 16][4]) {
  const int lane = threadIdx.x & 31, mi = lane >> 3, rr = lane & 7;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    LdMatrixX4(SmemAddr(sq + Swz<D>((mi & 1) * 8 + rr, 2 * kk + (mi >> 1))), qa[kk][0], qa[kk][1], qa[kk][2],
               qa[kk][3]);
  }
}
// The absolute positions of a decode CTA's first and last stream tokens
// (tok_lo and tok_hi - 1; zeros when the stream is empty or no mask needs
// them), which DecodeMaskMayHide compares.
struct StreamEnds {
  int first = 0, last = 0;
};
__device__ __forceinline__ StreamEnds DecodeStreamEnds(const AttnParams& p, const PagedKvView& kv, int pb, int tok_lo,
                                                       int tok_hi) {
  StreamEnds e;
  if (tok_hi > tok_lo && (p.causal || p.window > 0)) {
    e.first = TokenPos(kv, pb, tok_lo);
    e.last = TokenPos(kv, pb, tok_hi - 1);
  }
  return e;
}
// Whether the causal or window mask can hide any of a decode CTA's stream
// tokens [tok_lo, tok_hi) (false when empty) from its query positions in
// [qmin, qmax]: DecodeScores' cta_pos_mask (when false, no stage reads a
// page position). `e`: DecodeStreamEnds of the stream.
__device__ __forceinline__ bool DecodeMaskMayHide(const AttnParams& p, int tok_lo, int tok_hi, StreamEnds e, int qmin,
                                                  int qmax) {
  return tok_hi > tok_lo && ((p.causal && e.last > qmin) || (p.window > 0 && e.first <= qmax - p.window));
}

// The scaling and masking half of DecodeScores, over raw Q K^T fragments
// `sc` (any MMA that leaves the m16n8k16 accumulator layout).
template <bool kKScale>
__device__ __forceinline__ void DecodeMaskScores(const AttnParams& p, const PagedKvView& kv, int pb, int tile_first,
                                                 int tok_hi, int qpos0, int qpos1, int qmin, int qmax,
                                                 bool cta_pos_mask, float scale, const float* ks, float (&sc)[2][4]) {
  const int tig = threadIdx.x & 3;
  const int tile_last = min(tile_first + 16, tok_hi) - 1;
  const bool tail = tile_first + 16 > tok_hi;
  const bool pos_mask = cta_pos_mask && ((p.causal && TokenPos(kv, pb, tile_last) > qmin) ||
                                         (p.window > 0 && TokenPos(kv, pb, tile_first) <= qmax - p.window));
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = tile_first + j * 8 + tig * 2 + (e & 1);
      const int qp = e < 2 ? qpos0 : qpos1;
      bool vis = (!tail || i < tok_hi) && qp != INT32_MIN;
      if (vis && pos_mask) {
        const int kp = TokenPos(kv, pb, i);
        if (p.causal) vis = kp <= qp;
        if (p.window > 0) vis = vis && kp > qp - p.window;
      }
      float f = scale;
      if constexpr (kKScale) f = ks[j * 2 + (e & 1)] * scale;
      sc[j][e] = vis ? sc[j][e] * f : -INFINITY;
    }
  }
}

// S = Q K^T of one 16-token stage of a decode consumer warp (qa: the warp's
// Q fragments, 16 vectors; kt: the stage's K tile, [D/64][16][128 B] 128-byte
// swizzled), as m16n8k16 fragments (rows g and g + 8 of the lane, tokens
// tile_first + j * 8 + tig * 2 + {0, 1}), scaled to the log2 domain (with
// kKScale, also by the tokens' K scales ks[j * 2 + {0, 1}]) and -inf where
// not visible: past tok_hi, for rows without a vector (position INT32_MIN),
// and where the causal or window mask hides the token from the row's query
// position (qpos0 / qpos1). cta_pos_mask: whether any of the CTA's tokens
// can be hidden by position (else no page position is read); qmin / qmax:
// the CTA's query positions' range.
template <int D, typename T, bool kKScale>
__device__ __forceinline__ void DecodeScores(const uint32_t (&qa)[D / 16][4], const uint8_t* kt, const AttnParams& p,
                                             const PagedKvView& kv, int pb, int tile_first, int tok_hi, int qpos0,
                                             int qpos1, int qmin, int qmax, bool cta_pos_mask, float scale,
                                             const float* ks, float (&sc)[2][4]) {
  const int lane = threadIdx.x & 31, mi = lane >> 3, rr = lane & 7;
#pragma unroll
  for (int j = 0; j < 2; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t b0, b1, b2, b3;
    LdMatrixX4(SmemAddr(kt + Sw128(16, (mi >> 1) * 8 + rr, 2 * kk + (mi & 1))), b0, b1, b2, b3);
    Mma<T>(sc[0], qa[kk], b0, b1);
    Mma<T>(sc[1], qa[kk], b2, b3);
  }
  DecodeMaskScores<kKScale>(p, kv, pb, tile_first, tok_hi, qpos0, qpos1, qmin, qmax, cta_pos_mask, scale, ks, sc);
}

// The online-softmax half of DecodeSoftmaxPV: the maxima, sums and O's
// rescale, and P (times pscale with kPScale) as the A operand `pa` of P V.
template <int D, typename T, bool kPScale>
__device__ __forceinline__ void DecodeSoftmax(float (&sc)[2][4], const float* pscale, float& m0, float& m1, float& l0,
                                              float& l1, float (&o)[D / 8][4], uint32_t (&pa)[4]) {
  constexpr int kDTiles = D / 8;
  float mx0 = fmaxf(fmaxf(sc[0][0], sc[0][1]), fmaxf(sc[1][0], sc[1][1]));
  float mx1 = fmaxf(fmaxf(sc[0][2], sc[0][3]), fmaxf(sc[1][2], sc[1][3]));
  mx0 = QuadMax(mx0);
  mx1 = QuadMax(mx1);
  const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);
  const float c0 = nm0 == -INFINITY ? 1.f : exp2f(m0 - nm0);
  const float c1 = nm1 == -INFINITY ? 1.f : exp2f(m1 - nm1);
  const float b0f = nm0 == -INFINITY ? 0.f : nm0, b1f = nm1 == -INFINITY ? 0.f : nm1;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    sc[j][0] = exp2f(sc[j][0] - b0f);
    sc[j][1] = exp2f(sc[j][1] - b0f);
    sc[j][2] = exp2f(sc[j][2] - b1f);
    sc[j][3] = exp2f(sc[j][3] - b1f);
  }
  l0 = l0 * c0 + sc[0][0] + sc[0][1] + sc[1][0] + sc[1][1];
  l1 = l1 * c1 + sc[0][2] + sc[0][3] + sc[1][2] + sc[1][3];
  m0 = nm0;
  m1 = nm1;
  if constexpr (kPScale) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sc[j][0] *= pscale[j * 2];
      sc[j][1] *= pscale[j * 2 + 1];
      sc[j][2] *= pscale[j * 2];
      sc[j][3] *= pscale[j * 2 + 1];
    }
  }
  pa[0] = Pack<T>(sc[0][0], sc[0][1]);
  pa[1] = Pack<T>(sc[0][2], sc[0][3]);
  pa[2] = Pack<T>(sc[1][0], sc[1][1]);
  pa[3] = Pack<T>(sc[1][2], sc[1][3]);
  // O's rescale, skipped when no row's maximum moved (the usual case once a
  // long stream's first stages are in).
  if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
    for (int dn = 0; dn < kDTiles; ++dn) {
      o[dn][0] *= c0;
      o[dn][1] *= c0;
      o[dn][2] *= c1;
      o[dn][3] *= c1;
    }
  }
}

// One 16-token stage of a decode consumer warp, after S: the online softmax
// over the m16n8k16 score fragments sc (masked, scaled to the log2 domain,
// -inf where not visible; rows g and g + 8 of the lane: maxima m0 / m1,
// sums l0 / l1, per lane), then O += P V with V the stage's [D/64][16][128 B]
// swizzled 16-bit tile at `vt`. kPScale: P is multiplied by pscale (the
// tokens' V scales of quantized pages: columns tig * 2 + {0, 1} and 8 + those)
// for P V only, not for the sums.
template <int D, typename T, bool kPScale>
__device__ __forceinline__ void DecodeSoftmaxPV(float (&sc)[2][4], const float* pscale, float& m0, float& m1, float& l0,
                                                float& l1, float (&o)[D / 8][4], const uint8_t* vt) {
  constexpr int kDTiles = D / 8;
  const int lane = threadIdx.x & 31, mi = lane >> 3, rr = lane & 7;
  uint32_t pa[4];
  DecodeSoftmax<D, T, kPScale>(sc, pscale, m0, m1, l0, l1, o, pa);
#pragma unroll
  for (int dn = 0; dn < kDTiles; dn += 2) {
    uint32_t b0, b1, b2, b3;
    LdMatrixX4T(SmemAddr(vt + Sw128(16, (mi & 1) * 8 + rr, dn + (mi >> 1))), b0, b1, b2, b3);
    Mma<T>(o[dn], pa, b0, b1);
    Mma<T>(o[dn + 1], pa, b2, b3);
  }
}

// The exact merge of the CTA's warps' partials (log2-domain maxima m and sums
// l in m[w * rows + r], l[...]; O in o[(w * rows + r) * kStride + d], shared
// memory, 16-byte aligned, kStride a multiple of 4) and its store: to
// out/lse with one split, else to the split's partial slot: split-major
// (part_out[split][row, head][D], part_lse[split][row, head], what
// MergePartials reads) or with kSplitMinor each (row, head)'s splits
// together (part_out[row, head][split][D], part_lse[row, head][split], what
// the fused split merge reads). NaN propagates. `fac` is shared scratch of
// kWarps * rows floats. Called by every thread of the CTA (it holds a
// __syncthreads): the rows' merge factors first, a thread a row, then the
// outputs a float4 a thread.
template <int kWarps, int D, int kStride, bool kSplitMinor = false>
__device__ __forceinline__ void StoreDecodeRows(const DecodeWork& w, const QueryView& q, int rows, int num_splits,
                                                const float* m, const float* l, const float* o, float* fac,
                                                float* part_out, float* part_lse, float* out, float* lse) {
  const size_t rows_heads = (size_t)q.num_rows * q.q_heads;
  // Element strides of a (row, head) in the destination, and its base.
  const size_t rh_stride = num_splits > 1 && kSplitMinor ? (size_t)num_splits : 1;
  float* dst_o = num_splits == 1 ? out
                 : kSplitMinor   ? part_out + (size_t)w.sp * D
                                 : part_out + (size_t)w.sp * rows_heads * D;
  float* dst_l = num_splits == 1 ? lse : kSplitMinor ? part_lse + w.sp : part_lse + (size_t)w.sp * rows_heads;
  for (int r = threadIdx.x; r < w.nv; r += blockDim.x) {
    float M = -INFINITY;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) M = fmaxf(M, m[k * rows + r]);
    float f[kWarps], L = 0.f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) {
      f[k] = (M == -INFINITY || m[k * rows + r] == -INFINITY) ? 0.f : exp2f(m[k * rows + r] - M);
      L += l[k * rows + r] * f[k];
    }
    const bool some = L > 0.f || L != L;
    const float inv = some ? 1.f / L : 0.f;  // (NaN when L is)
#pragma unroll
    for (int k = 0; k < kWarps; ++k) fac[k * rows + r] = f[k] * inv;
    dst_l[DecodeRowHead(w, q, w.v0 + r) * rh_stride] = some ? (M + log2f(L)) * kLn2 : -INFINITY;
  }
  __syncthreads();
  constexpr int kD4 = D / 4;
  const bool vec = (reinterpret_cast<uintptr_t>(dst_o) & 15) == 0;  // (an unsplit call takes any output alignment)
  for (int i = threadIdx.x; i < w.nv * kD4; i += blockDim.x) {
    const int r = i / kD4, d = (i % kD4) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < kWarps; ++k) {
      const float f = fac[k * rows + r];
      const float4 v = *reinterpret_cast<const float4*>(o + (size_t)(k * rows + r) * kStride + d);
      acc.x += f * v.x;
      acc.y += f * v.y;
      acc.z += f * v.z;
      acc.w += f * v.w;
    }
    float* dp = dst_o + DecodeRowHead(w, q, w.v0 + r) * rh_stride * D + d;
    if (vec) {
      *reinterpret_cast<float4*>(dp) = acc;
    } else {
      dp[0] = acc.x;
      dp[1] = acc.y;
      dp[2] = acc.z;
      dp[3] = acc.w;
    }
  }
}

}  // namespace kvring::cuda::internal
