// Paged prefill attention on Hopper's warpgroup MMA (wgmma, sm_90a) with
// tensor-memory-accelerator loads, as a persistent kernel.
//
// Same contract as the mma.sync kernel in paged_prefill_cuda.cu (which stays
// the kernel for other devices, for page sizes that are not a multiple of 16
// tokens and for query arrays TMA cannot read): O fp32 and LSE (natural log)
// of each (row, q head), causal/window by absolute position, GQA.
//
// Work: "row tiles" of 128 query rows of one (sequence, q head), taken
// heaviest first (causal: later rows see more keys) by one CTA an SM for the
// whole call: CTA c of G takes tiles c, 2G-1-c, 2G+c, ... (a snake, so no CTA
// takes the heaviest tile of every round). Not measured yet: batches of very
// different lengths. The item space is (q head, sequence) x the longest
// sequence's row tiles, and the producer skips the empty items (past a short
// sequence's end) one at a time, two cached loads each; with many short
// sequences beside a long one most items are empty and that scan is not
// hidden, and the static assignment does not rebalance.
// CTA: three warpgroups. A producer warp (warpgroup 2; its other warps
// leave, and the warpgroup gives its registers to the consumers: setmaxnreg
// 24 / 240) computes each row tile's metadata (rows, positions' min/max, the
// visible key range) into shared memory, brings its Q by TMA as soon as the
// consumers hold the previous Q in registers, and streams the KV of one row
// tile after another in 64-token tiles through a 5-stage shared-memory ring:
// per tile, four lanes issue TMA copies of 16-token boxes of the K and V
// planes of the kv head against a tensor map of the page pool, landing in
// the 128-byte-swizzled layout wgmma reads ([D/64][64 rows][128 B]); the
// stage's "full" mbarrier completes when the bytes have landed, its "empty"
// one when every consumer thread is done with it. A row tile's prologue
// (dependent global round trips, Q, the first KV tiles) thus runs under the
// previous tile's main loop, and the consumers never issue a load.
// Consumers: two warpgroups of 64 rows. Per KV tile and warpgroup: S = Q K^T
// (wgmma m64n64k16, Q as register fragments, K from shared memory), the
// online softmax in registers (log2 domain), P as 16-bit A fragments in
// registers, O += P V (wgmma m64nDk16, V read transposed from the same
// swizzled layout). Within a warpgroup the softmax of tile j+1 runs while the
// tensor cores do P_j V_j, and the rescale of O is skipped when no row's
// maximum moved; the two warpgroups take turns to issue their tensor-core
// work ("ping-pong", as FlashAttention-3 does), and the turns carry over from
// one row tile to the next.
// A TMA box copies whole 16-token slices of a page: the slots of a last page
// past the sequence's end are junk, so their V rows are zeroed (P is 0 there,
// but 0 x NaN is not); K junk is masked to -inf before the softmax. Q rows
// past a tile's last row are read too (zeros past the array, or the next
// sequence's rows) and never stored.
// (Measured on the H200: 1.5-1.7x the earlier non-persistent kernel, whose
// loads were issued by lanes of a consumer warp and whose prologue ran in
// front of each row tile.)
#include <algorithm>
#include <cfloat>

#include "cuda_common.cuh"
#include "tma_cuda.h"
#include "wgmma_sm90.cuh"

namespace kvring::cuda {
namespace internal {
namespace {

constexpr int kBM = 128, kBN = 64, kStages = 5, kBox = 16;
constexpr int kThreads = 256;                // the two consumer warpgroups
constexpr int kCtaThreads = kThreads + 128;  // and the producer warpgroup

template <int D>
struct Sm90Smem {
  static constexpr int kQBytes = kBM * D * 2;     // [D/64][kBM][128 B]
  static constexpr int kTileBytes = kBN * D * 2;  // one K or V tile: [D/64][kBN][128 B]
  static constexpr int kK = kQBytes;
  static constexpr int kV = kK + kStages * kTileBytes;
  static constexpr int kBars = kV + kStages * kTileBytes;  // full[kStages], empty[kStages], q_full, q_empty
  static constexpr int kBytes = kBars + (2 * kStages + 2) * 8;
  static constexpr int kDynamic = kBytes + 1024;  // slack to align the base to 1024 (the swizzle period)
};

// Named barriers of the consumers: 2 + wg a warpgroup (junk rows zeroed),
// kTurn + wg the warpgroups' alternation of their tensor-core work (0 is the
// CTA's: its one use is before the producer warpgroup's idle warps leave).
constexpr int kTurn = 4;

// Shared ints of the next row tile's metadata (s_item).
enum ItemField { kDone, kHq, kR0, kNrows, kPb, kNtok, kNBegin, kNEnd, kQmin, kQmax, kContig, kP0, kItemInts };

template <int N>
__device__ __forceinline__ void RegAlloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void RegDealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// The CTA's barriers in shared memory (addresses), past the Q and K/V stages.
struct Sm90Barriers {
  uint32_t base, full0, empty0, q_full, q_empty;
};

// Producer (one warp): walks this CTA's row tiles; for each it publishes the
// tile's metadata (s_item, s_pos) and its Q once the consumers hold the last
// one, then streams the tile's visible K/V tiles through the stage ring
// (full0/empty0). Ends with s_item[kDone] = 1.
template <int D>
__device__ __forceinline__ void ProduceRowTiles(const AttnParams& p, const QueryView& q, const PagedKvView& kv,
                                                int row_tiles, const CUtensorMap* pool_map, const CUtensorMap* q_map,
                                                const Sm90Barriers& b, int* s_item, int* s_pos, int tid) {
  using S = Sm90Smem<D>;
  const uint32_t base = b.base, full0 = b.full0, empty0 = b.empty0, q_full = b.q_full, q_empty = b.q_empty;
  const int lane = tid & 31;
  if (lane == 0) {
    TmaPrefetchMap(pool_map);
    TmaPrefetchMap(q_map);
  }
  const int X = q.q_heads * kv.num_seqs, G = q.q_heads / kv.kv_heads;
  const long long total = (long long)X * row_tiles;
  int k = 0, gl = 0;  // row tiles sent, KV tiles sent
  for (long long round = 0; round * gridDim.x < total; ++round) {
    const long long idx = round * gridDim.x + ((round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
    if (idx >= total) continue;
    const int x = (int)(idx % X), tile = row_tiles - 1 - (int)(idx / X), hq = x % q.q_heads, s = x / q.q_heads;
    const int rb = q.seq_row_begin[s], re = q.seq_row_begin[s + 1];
    const int r0 = rb + tile * kBM;
    if (r0 >= re) continue;
    const int nrows = min(kBM, re - r0);
    const int pb = kv.seq_page_begin[s], npages = kv.seq_page_begin[s + 1] - pb, ntok = kv.seq_tokens[s];
    int pos[kBM / 32], mn = INT32_MAX, mx = INT32_MIN;
#pragma unroll
    for (int i = 0; i < kBM / 32; ++i) {
      const int r = lane + 32 * i;
      pos[i] = r < nrows ? q.positions[r0 + r] : INT32_MIN;
      if (r < nrows) {
        mn = min(mn, pos[i]);
        mx = max(mx, pos[i]);
      }
    }
    mn = __reduce_min_sync(0xffffffffu, mn);
    mx = __reduce_max_sync(0xffffffffu, mx);
    const int2 keys = VisibleKeys(p, kv, pb, npages, ntok, mn, mx, kBN);
    const int ntiles = keys.y > keys.x ? (keys.y - keys.x + kBN - 1) / kBN : 0;
    int p0 = 0;
    const bool contiguous = npages > 0 && PagesContiguous(kv, pb, npages, &p0);
    // The consumers hold the previous tile's Q and metadata in registers.
    if (k > 0) MbarWait(q_empty, (k - 1) & 1);
#pragma unroll
    for (int i = 0; i < kBM / 32; ++i) s_pos[lane + 32 * i] = pos[i];
    if (lane == 0) {
      s_item[kDone] = 0;
      s_item[kHq] = hq;
      s_item[kR0] = r0;
      s_item[kNrows] = nrows;
      s_item[kPb] = pb;
      s_item[kNtok] = ntok;
      s_item[kNBegin] = keys.x;
      s_item[kNEnd] = keys.y;
      s_item[kQmin] = mn;
      s_item[kQmax] = mx;
      s_item[kContig] = contiguous;
      s_item[kP0] = p0;
    }
    __threadfence_block();
    __syncwarp();
    if (lane == 0) {  // Q rows past the last row read as zeros (or as the next sequence's rows: never stored)
      MbarArriveExpectTx(q_full, S::kQBytes);
#pragma unroll
      for (int dc = 0; dc < D / 64; ++dc) TmaLoad3d(base + dc * kBM * 128, q_map, dc * 64, hq, r0, q_full);
    }
    ++k;
    // KV tiles: lanes 0..3 copy a 16-token box each of K and V (the page
    // id is read before the wait for the stage).
    const int hk = hq / G, kplane = (kv.layer * 2) * kv.kv_heads + hk, vplane = kplane + kv.kv_heads;
    for (int j = 0; j < ntiles; ++j, ++gl) {
      const int st = gl % kStages;
      int page = -1, off = 0;
      if (lane < kBN / kBox) {
        const int i0 = keys.x + j * kBN + lane * kBox, pg = i0 / kv.block_tokens;
        page = pg < npages ? kv.page_ids[pb + pg] : -1;
        off = i0 - pg * kv.block_tokens;
      }
      if (gl >= kStages) MbarWait(empty0 + 8 * st, ((gl / kStages) - 1) & 1);
      if (lane == 0) MbarArriveExpectTx(full0 + 8 * st, 2 * S::kTileBytes);
      __syncwarp();
      if (lane < kBN / kBox) {
        const uint32_t kt = base + S::kK + st * S::kTileBytes, vt = base + S::kV + st * S::kTileBytes;
#pragma unroll
        for (int dc = 0; dc < D / 64; ++dc) {
          const uint32_t o = dc * kBN * 128 + lane * kBox * 128;
          TmaLoad5d(kt + o, pool_map, 0, dc, off, kplane, page, full0 + 8 * st);
          TmaLoad5d(vt + o, pool_map, 0, dc, off, vplane, page, full0 + 8 * st);
        }
      }
    }
  }
  if (k > 0) MbarWait(q_empty, (k - 1) & 1);
  if (lane == 0) {
    s_item[kDone] = 1;
    MbarArrive(q_full);
  }
}

// Epilogue of a row tile: this thread's two rows (wr, wr + 8) of O
// normalized by their softmax sums, and their LSE.
template <int D>
__device__ __forceinline__ void StoreRows(const QueryView& q, OutputView& out, int hq, int r0, int nrows, int wr,
                                          int tig, const float (&o)[D / 2], float m0, float m1, float l0, float l1) {
  l0 = QuadSum(l0);
  l1 = QuadSum(l1);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = wr + hf * 8;
    if (r >= nrows) continue;
    const float lv = hf ? l1 : l0, mv = hf ? m1 : m0;
    const float inv = lv > 0.f ? 1.f / lv : 0.f;
    float* dst = out.out + ((size_t)(r0 + r) * q.q_heads + hq) * D;
#pragma unroll
    for (int jd = 0; jd < D / 8; ++jd) {
      *reinterpret_cast<float2*>(dst + jd * 8 + tig * 2) =
          make_float2(o[4 * jd + 2 * hf] * inv, o[4 * jd + 2 * hf + 1] * inv);
    }
    if (tig == 0) out.lse[(size_t)(r0 + r) * q.q_heads + hq] = lv > 0.f ? (mv + log2f(lv)) * kLn2 : -INFINITY;
  }
}

// Consumers (two warpgroups of 64 rows): for each row tile the producer
// publishes, the mainloop (S = Q K^T on the tensor cores, online softmax,
// O += P V, the warpgroups taking turns at the tensor cores), then the
// epilogue. A tile no row of which sees a key writes O = 0, LSE = -inf.
template <int D, typename T>
__device__ __forceinline__ void ConsumeRowTiles(const AttnParams& p, const QueryView& q, const PagedKvView& kv,
                                                OutputView& out, const Sm90Barriers& b, const int* s_item,
                                                const int* s_pos, int tid) {
  using S = Sm90Smem<D>;
  constexpr int kKSteps = D / 16;
  const uint32_t base = b.base, full0 = b.full0, empty0 = b.empty0, q_full = b.q_full, q_empty = b.q_empty;
  const int wg = tid >> 7, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tig = lane & 3;
  const float scale = (p.softmax_scale > 0 ? p.softmax_scale : rsqrtf((float)D)) * kLog2e;
  const int wr = wg * 64 + (warp & 3) * 16 + g;          // this thread's two rows (of its warpgroup's 64): wr, wr + 8
  if (wg == 1) NamedBarrierArrive(kTurn + 0, kThreads);  // warpgroup 0 takes the first turn
  int gc = 0;                                            // KV tiles consumed (the ring's position)
  for (int k = 0;; ++k) {
    MbarWait(q_full, k & 1);
    if (s_item[kDone]) break;
    const int hq = s_item[kHq], r0 = s_item[kR0], nrows = s_item[kNrows], pb = s_item[kPb];
    const int ntok = s_item[kNtok], n_begin = s_item[kNBegin], n_end = s_item[kNEnd], qmin = s_item[kQmin];
    const int qmax = s_item[kQmax], p0 = s_item[kP0];
    const bool contiguous = s_item[kContig] != 0;
    const int qpos0 = s_pos[wr], qpos1 = s_pos[wr + 8];
    uint32_t qf[kKSteps][4];
    {
      const int mi = lane >> 3, rr = lane & 7, r = wg * 64 + (warp & 3) * 16 + (mi & 1) * 8 + rr;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        LdMatrixX4(base + Sw128(kBM, r, 2 * kk + (mi >> 1)), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
      }
    }
    MbarArrive(q_empty);
    const int ntiles = n_end > n_begin ? (n_end - n_begin + kBN - 1) / kBN : 0;
    if (ntiles == 0) {  // no row of this tile sees a key
      for (int i = tid; i < nrows * D; i += kThreads)
        out.out[((size_t)(r0 + i / D) * q.q_heads + hq) * D + i % D] = 0.f;
      for (int r = tid; r < nrows; r += kThreads) out.lse[(size_t)(r0 + r) * q.q_heads + hq] = -INFINITY;
      continue;
    }
    auto key_pos = [&](int i) { return contiguous ? p0 + i : TokenPos(kv, pb, i); };
    auto tile_edge = [&](int j) -> bool {
      const int n0 = n_begin + j * kBN;
      if (j >= ntiles) return false;
      const int last = min(n0 + kBN, n_end) - 1;
      return n0 + kBN > n_end || (p.causal && key_pos(last) > qmin) || (p.window > 0 && key_pos(n0) <= qmax - p.window);
    };

    float o[D / 2], sc[32];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    uint32_t pa[4][4];
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float c0 = 1.f, c1 = 1.f;

    auto issue_s = [&](int j) {
      const int st = (gc + j) % kStages;
      MbarWait(full0 + 8 * st, ((gc + j) / kStages) & 1);
      const int n0 = n_begin + j * kBN;
      if (n0 + kBN > ntok) {
        const uint32_t vt = base + S::kV + st * S::kTileBytes;
        const int first = ntok - n0;
        for (int c = tid & 127; c < (kBN - first) * (D / 8); c += 128) {
          const int r = first + c / (D / 8), ch = c % (D / 8);
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(vt + Sw128(kBN, r, ch)), "r"(0) : "memory");
        }
        FenceProxyAsync();
        NamedBarrier(2 + wg, 128);
      }
      const uint32_t kt = base + S::kK + st * S::kTileBytes;
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        const uint64_t db = SmemDesc128(kt + (kk >> 2) * kBN * 128 + (kk & 3) * 32, 16, 1024);
        if (kk == 0) {
          WgmmaRSK0<64, T>(sc, qf[kk], db);
        } else {
          WgmmaRSK<64, T>(sc, qf[kk], db, 1);
        }
      }
      WgmmaCommit();
    };
    auto softmax = [&](int j, bool edge) {
      if (edge) {
        const int n0 = n_begin + j * kBN;
        int bpos[kBN / kBox];
#pragma unroll
        for (int b = 0; b < kBN / kBox; ++b) {
          bpos[b] = (p.causal || p.window > 0) && n0 + b * kBox < n_end ? key_pos(n0 + b * kBox) : 0;
        }
#pragma unroll
        for (int jn = 0; jn < 8; ++jn) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = (jn & 1) * 8 + tig * 2 + (e & 1);
            const int qp = e < 2 ? qpos0 : qpos1, kp = bpos[jn >> 1] + c;
            bool vis = n0 + (jn >> 1) * kBox + c < n_end;
            if (p.causal) vis = vis && kp <= qp;
            if (p.window > 0) vis = vis && kp > qp - p.window;
            if (!vis) sc[4 * jn + e] = -INFINITY;
          }
        }
      }
      float t0[8], t1[8];
#pragma unroll
      for (int jn = 0; jn < 8; ++jn) {
        t0[jn] = fmaxf(sc[4 * jn], sc[4 * jn + 1]);
        t1[jn] = fmaxf(sc[4 * jn + 2], sc[4 * jn + 3]);
      }
#pragma unroll
      for (int w = 4; w >= 1; w >>= 1) {
#pragma unroll
        for (int kx = 0; kx < w; ++kx) {
          t0[kx] = fmaxf(t0[kx], t0[kx + w]);
          t1[kx] = fmaxf(t1[kx], t1[kx + w]);
        }
      }
      float mx0 = t0[0], mx1 = t1[0];
      mx0 = QuadMax(mx0);
      mx1 = QuadMax(mx1);
      const float nm0 = fmaxf(m0, mx0 * scale), nm1 = fmaxf(m1, mx1 * scale);
      c0 = nm0 == -INFINITY ? 1.f : exp2f(m0 - nm0);
      c1 = nm1 == -INFINITY ? 1.f : exp2f(m1 - nm1);
      const float b0 = nm0 == -INFINITY ? 0.f : nm0, b1 = nm1 == -INFINITY ? 0.f : nm1;
#pragma unroll
      for (int jn = 0; jn < 8; ++jn) {
        sc[4 * jn] = exp2f(fmaf(sc[4 * jn], scale, -b0));
        sc[4 * jn + 1] = exp2f(fmaf(sc[4 * jn + 1], scale, -b0));
        sc[4 * jn + 2] = exp2f(fmaf(sc[4 * jn + 2], scale, -b1));
        sc[4 * jn + 3] = exp2f(fmaf(sc[4 * jn + 3], scale, -b1));
        t0[jn] = sc[4 * jn] + sc[4 * jn + 1];
        t1[jn] = sc[4 * jn + 2] + sc[4 * jn + 3];
      }
#pragma unroll
      for (int w = 4; w >= 1; w >>= 1) {
#pragma unroll
        for (int kx = 0; kx < w; ++kx) {
          t0[kx] += t0[kx + w];
          t1[kx] += t1[kx + w];
        }
      }
      l0 = l0 * c0 + t0[0];
      l1 = l1 * c1 + t1[0];
      m0 = nm0;
      m1 = nm1;
    };
    auto pack = [&]() {
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        pa[t][0] = Pack<T>(sc[8 * t], sc[8 * t + 1]);
        pa[t][1] = Pack<T>(sc[8 * t + 2], sc[8 * t + 3]);
        pa[t][2] = Pack<T>(sc[8 * t + 4], sc[8 * t + 5]);
        pa[t][3] = Pack<T>(sc[8 * t + 6], sc[8 * t + 7]);
      }
    };
    auto rescale_o = [&]() {
      if (c0 != 1.f || c1 != 1.f) {
#pragma unroll
        for (int jd = 0; jd < D / 8; ++jd) {
          o[4 * jd] *= c0;
          o[4 * jd + 1] *= c0;
          o[4 * jd + 2] *= c1;
          o[4 * jd + 3] *= c1;
        }
      }
      FenceRegs<D / 2>(o);
    };
    auto issue_pv = [&](int j) {
      const uint32_t vt = base + S::kV + ((gc + j) % kStages) * S::kTileBytes;
      FenceRegs<16>(&pa[0][0]);
      WgmmaFence();
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        WgmmaRS<D, T>(o, pa[t], SmemDesc128(vt + t * 16 * 128, kBN * 128, 1024), 1);
      }
      WgmmaCommit();
    };

    issue_s(0);
    WgmmaWait<0>();
    FenceRegs<32>(sc);
    softmax(0, tile_edge(0));
    pack();
    bool edge_next = tile_edge(1);
    int j = 0;
    for (; j + 1 < ntiles; ++j) {
      const bool edge = edge_next;
      edge_next = tile_edge(j + 2);
      rescale_o();
      NamedBarrier(kTurn + wg, kThreads);
      issue_s(j + 1);
      issue_pv(j);
      NamedBarrierArrive(kTurn + (1 - wg), kThreads);
      WgmmaWait<1>();
      FenceRegs<32>(sc);
      softmax(j + 1, edge);
      WgmmaWait<0>();
      FenceRegs<D / 2>(o);
      MbarArrive(empty0 + 8 * ((gc + j) % kStages));
      pack();
    }
    rescale_o();
    NamedBarrier(kTurn + wg, kThreads);
    issue_pv(j);
    NamedBarrierArrive(kTurn + (1 - wg), kThreads);  // (the turns go on into the next row tile)
    WgmmaWait<0>();
    FenceRegs<D / 2>(o);
    MbarArrive(empty0 + 8 * ((gc + j) % kStages));
    gc += ntiles;

    StoreRows<D>(q, out, hq, r0, nrows, wr, tig, o, m0, m1, l0, l1);
  }
  if (wg == 0) NamedBarrier(kTurn + 0, kThreads);  // warpgroup 1's last hand-over (no barrier left half-arrived)
}

template <int D, typename T>
__global__ void __launch_bounds__(kCtaThreads, 1)
    PrefillSm90Kernel(AttnParams p, QueryView q, PagedKvView kv, OutputView out, int row_tiles,
                      const __grid_constant__ CUtensorMap pool_map, const __grid_constant__ CUtensorMap q_map) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Sm90Smem<D>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_item[kItemInts];
  __shared__ int s_pos[kBM];
  Sm90Barriers b;
  b.base = SmemBase1024(smem_raw);
  b.full0 = b.base + S::kBars;
  b.empty0 = b.full0 + kStages * 8;
  b.q_full = b.empty0 + kStages * 8;
  b.q_empty = b.q_full + 8;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      MbarInit(b.full0 + 8 * i, 1);          // the producer's expect-tx arrival (+ the tile's bytes)
      MbarInit(b.empty0 + 8 * i, kThreads);  // every consumer thread, once done with the tile
    }
    MbarInit(b.q_full, 1);          // the producer, once s_item / s_pos are written (+ Q's bytes)
    MbarInit(b.q_empty, kThreads);  // every consumer thread, once it holds Q, s_item and s_pos in registers
    FenceMbarInit();
  }
  __syncthreads();  // (the last CTA-wide barrier: the producer warpgroup's idle warps leave)
  if (tid >= kThreads) {
    // ---- producer (warp 8; warps 9-11 leave)
    RegDealloc<24>();
    if (tid >= kThreads + 32) return;
    ProduceRowTiles<D>(p, q, kv, row_tiles, &pool_map, &q_map, b, s_item, s_pos, tid);
    return;
  }
  // ---- consumers
  RegAlloc<240>();
  ConsumeRowTiles<D, T>(p, q, kv, out, b, s_item, s_pos, tid);
#else
  __trap();
#endif
}

template <int D, typename T>
cudaError_t LaunchSm90(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                       const CUtensorMap& map, const CUtensorMap& q_map, cudaStream_t stream) {
  const int smem = Sm90Smem<D>::kDynamic;
  cudaError_t e = cudaFuncSetAttribute(PrefillSm90Kernel<D, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int dev = 0, sms = 0;
  if (e == cudaSuccess) e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  const long long row_tiles = (q.max_rows_per_seq + kBM - 1) / kBM, items = row_tiles * q.q_heads * kv.num_seqs;
  if (items >= (1ll << 40)) return cudaErrorInvalidValue;
  const int grid = (int)std::min<long long>(items, sms);
  PrefillSm90Kernel<D, T><<<grid, kCtaThreads, smem, stream>>>(p, q, kv, out, (int)row_tiles, map, q_map);
  return cudaGetLastError();
}

}  // namespace

cudaError_t PagedPrefillSm90(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                             cudaStream_t stream) {
  alignas(64) CUtensorMap map{}, q_map{};
  // Not supported (the caller falls back): pages not a multiple of 16 tokens, a Q array TMA cannot read,
  // head_dim 256.
  if (!MakePoolMap(kv, kBox, &map) || !MakeQueryMap(q, kv.head_dim, kBM, &q_map)) return cudaErrorNotSupported;
  return WithHeadDim(kv, [&]<int D, typename T>() {
    if constexpr (D > 128) {
      return cudaErrorNotSupported;  // (Q's fragments and O's accumulators of 256 dims exceed a consumer's registers)
    } else {
      return LaunchSm90<D, T>(p, q, kv, out, map, q_map, stream);
    }
  });
}

}  // namespace internal
}  // namespace kvring::cuda
