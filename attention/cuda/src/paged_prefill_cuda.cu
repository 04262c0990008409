// Paged prefill attention on tensor cores (FlashAttention-2 structure), with
// mma.sync: the kernel for devices other than sm_90 (which runs the wgmma
// kernel of paged_prefill_sm90_cuda.cu), and the dispatch between the two.
//
// CTA: 128 query rows of one (sequence, q head), 4 warps x 32 rows (two m16
// tiles each, so every K/V fragment loaded from shared memory feeds four
// MMAs; at head_dim 256, 64 rows, one m16 tile a warp); the KV
// stream of the sequence (its listed pages, in position order) in tiles of
// 64 tokens, double-buffered in shared memory with cp.async (gathered page by
// page, 16-byte chunks, XOR-swizzled rows so ldmatrix is conflict-free).
// S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16/fp16 in, fp32
// accumulate); the softmax is online in registers, in the log2 domain. Q
// fragments are re-read from shared memory per tile (registers hold the two
// 32 x D accumulators instead). Causal and window masks
// use absolute positions; tiles wholly outside the visible range are never
// loaded. Quantized pages (int8 / fp8 codes): the same kernel, the tile's
// codes copied a tile ahead and dequantized into the 16-bit tiles.
#include <cfloat>

#include "cuda_common.cuh"
#include "quant_access.cuh"

namespace kvring::cuda {
namespace internal {
namespace {

constexpr int kBN = 64, kWarps = 4, kThreads = kWarps * 32;
// m16 row tiles a warp: two (every K/V fragment feeds four MMAs), one at
// head_dim 256 (two tiles' 32 x 256 fp32 accumulators do not fit a thread's
// registers); a CTA's rows.
template <int D>
inline constexpr int kMT = D > 128 ? 1 : 2;
template <int D>
inline constexpr int kBM = kWarps * 16 * kMT<D>;

// Epilogue of a row tile: each thread's rows of O normalized by their
// softmax sums (completed across the quad), and their LSE.
template <int D>
__device__ __forceinline__ void StoreRowTile(const QueryView& q, OutputView& out, int hq, int r0, int nrows, int warp,
                                             int g, int tig, const float (&o)[kMT<D>][D / 8][4],
                                             const float (&m)[kMT<D>][2], const float (&l)[kMT<D>][2]) {
  constexpr int kDTiles = D / 8;
#pragma unroll
  for (int mt = 0; mt < kMT<D>; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float lv = QuadSum(l[mt][hf]);
      const int r = warp * 16 * kMT<D> + mt * 16 + g + hf * 8;
      if (r >= nrows) continue;
      const float inv = lv > 0.f ? 1.f / lv : 0.f;
      float* dst = out.out + ((size_t)(r0 + r) * q.q_heads + hq) * D;
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        *reinterpret_cast<float2*>(dst + j * 8 + tig * 2) =
            make_float2(o[mt][j][2 * hf] * inv, o[mt][j][2 * hf + 1] * inv);
      }
      if (tig == 0) out.lse[(size_t)(r0 + r) * q.q_heads + hq] = lv > 0.f ? (m[mt][hf] + log2f(lv)) * kLn2 : -INFINITY;
    }
  }
}

// One 64-token KV tile of a CTA's row tile, from 16-bit K and V tiles in
// shared memory (swizzled rows): S = Q K^T, the masks where `edge` (the tile
// straddles the causal diagonal, the window edge or the end), the online
// softmax, O += P V.
template <int D, typename T>
__device__ __forceinline__ void TileStep(const AttnParams& p, const PagedKvView& kv, const uint8_t* sq,
                                         const uint8_t* kt, const uint8_t* vt, int n0, int n_end, int pb, bool edge,
                                         const int (&qpos)[kMT<D>][2], float scale, int warp, int lane,
                                         float (&o)[kMT<D>][D / 8][4], float (&m)[kMT<D>][2], float (&l)[kMT<D>][2]) {
  constexpr int kKChunks = D / 16, kDTiles = D / 8;
  const int tig = lane & 3;
  const int mi = lane >> 3, rr = lane & 7;
  // S = Q K^T : 32 x 64 per warp.
  float sc[kMT<D>][8][4];
#pragma unroll
  for (int mt = 0; mt < kMT<D>; ++mt)
#pragma unroll
    for (int j = 0; j < 8; ++j) sc[mt][j][0] = sc[mt][j][1] = sc[mt][j][2] = sc[mt][j][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kKChunks; ++kk) {
    uint32_t qa[kMT<D>][4];
#pragma unroll
    for (int mt = 0; mt < kMT<D>; ++mt) {
      LdMatrixX4(SmemAddr(sq + Swz<D>(warp * 16 * kMT<D> + mt * 16 + (mi & 1) * 8 + rr, 2 * kk + (mi >> 1))), qa[mt][0],
                 qa[mt][1], qa[mt][2], qa[mt][3]);
    }
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      uint32_t b0, b1, b2, b3;
      LdMatrixX4(SmemAddr(kt + Swz<D>((j + (mi >> 1)) * 8 + rr, 2 * kk + (mi & 1))), b0, b1, b2, b3);
#pragma unroll
      for (int mt = 0; mt < kMT<D>; ++mt) {
        Mma<T>(sc[mt][j], qa[mt], b0, b1);
        Mma<T>(sc[mt][j + 1], qa[mt], b2, b3);
      }
    }
  }
  // Masks: only tiles that straddle the causal diagonal / window edge / end
  // (positions increase along the stream).
  float pa_c[kMT<D>][2];
#pragma unroll
  for (int mt = 0; mt < kMT<D>; ++mt) {
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = sc[mt][j][e] * scale;
        if (edge) {
          const int i = n0 + j * 8 + tig * 2 + (e & 1);
          const int qp = qpos[mt][e >> 1];
          bool vis = i < n_end;
          if (vis && (p.causal || p.window > 0)) {
            const int kp = TokenPos(kv, pb, i);
            if (p.causal) vis = kp <= qp;
            if (p.window > 0) vis = vis && kp > qp - p.window;
          }
          if (!vis) v = -INFINITY;
        }
        sc[mt][j][e] = v;
      }
      mx0 = fmaxf(mx0, fmaxf(sc[mt][j][0], sc[mt][j][1]));
      mx1 = fmaxf(mx1, fmaxf(sc[mt][j][2], sc[mt][j][3]));
    }
    mx0 = QuadMax(mx0);
    mx1 = QuadMax(mx1);
    const float nm0 = fmaxf(m[mt][0], mx0), nm1 = fmaxf(m[mt][1], mx1);
    pa_c[mt][0] = nm0 == -INFINITY ? 1.f : exp2f(m[mt][0] - nm0);
    pa_c[mt][1] = nm1 == -INFINITY ? 1.f : exp2f(m[mt][1] - nm1);
    const float base0 = nm0 == -INFINITY ? 0.f : nm0, base1 = nm1 == -INFINITY ? 0.f : nm1;
    float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      sc[mt][j][0] = exp2f(sc[mt][j][0] - base0);
      sc[mt][j][1] = exp2f(sc[mt][j][1] - base0);
      sc[mt][j][2] = exp2f(sc[mt][j][2] - base1);
      sc[mt][j][3] = exp2f(sc[mt][j][3] - base1);
      rs0 += sc[mt][j][0] + sc[mt][j][1];
      rs1 += sc[mt][j][2] + sc[mt][j][3];
    }
    l[mt][0] = l[mt][0] * pa_c[mt][0] + rs0;
    l[mt][1] = l[mt][1] * pa_c[mt][1] + rs1;
    m[mt][0] = nm0;
    m[mt][1] = nm1;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      o[mt][j][0] *= pa_c[mt][0];
      o[mt][j][1] *= pa_c[mt][0];
      o[mt][j][2] *= pa_c[mt][1];
      o[mt][j][3] *= pa_c[mt][1];
    }
  }
  // O += P V over the 4 k16 token chunks of the tile.
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    uint32_t pa[kMT<D>][4];
#pragma unroll
    for (int mt = 0; mt < kMT<D>; ++mt) {
      pa[mt][0] = Pack<T>(sc[mt][2 * t][0], sc[mt][2 * t][1]);
      pa[mt][1] = Pack<T>(sc[mt][2 * t][2], sc[mt][2 * t][3]);
      pa[mt][2] = Pack<T>(sc[mt][2 * t + 1][0], sc[mt][2 * t + 1][1]);
      pa[mt][3] = Pack<T>(sc[mt][2 * t + 1][2], sc[mt][2 * t + 1][3]);
    }
#pragma unroll
    for (int dn = 0; dn < kDTiles; dn += 2) {
      uint32_t b0, b1, b2, b3;
      LdMatrixX4T(SmemAddr(vt + Swz<D>(16 * t + (mi & 1) * 8 + rr, dn + (mi >> 1))), b0, b1, b2, b3);
#pragma unroll
      for (int mt = 0; mt < kMT<D>; ++mt) {
        Mma<T>(o[mt][dn], pa[mt], b0, b1);
        Mma<T>(o[mt][dn + 1], pa[mt], b2, b3);
      }
    }
  }
}

// Shared memory of a CTA: the Q tile and the 16-bit K and V tiles (two of
// each, double-buffered, for plain pages; one of each for quantized pages,
// whose codes are double-buffered instead, 1 byte each).
template <int D, KvCodec kCodec>
constexpr size_t SmemBytes() {
  return kCodec == KvCodec::kPlain ? (size_t)(kBM<D> + 4 * kBN) * D * 2
                                   : (size_t)(kBM<D> + 2 * kBN) * D * 2 + 4 * (size_t)kBN * D;
}

// kCodec kPlain: plain pages of T. kInt8 / kFp8E4M3 with kMode (the scale
// mode): quantized pages (quant_access.cuh). A tile's codes are copied
// (cp.async, a tile ahead) into shared memory, then every thread dequantizes
// its chunks (code x scale, rounded to T) into the 16-bit tiles the MMAs read;
// the rest is the plain kernel's. The prefill is compute-bound: one pass over
// the tile's codes per 128 query rows.
template <int D, typename T, KvCodec kCodec = KvCodec::kPlain, ScaleMode kMode = ScaleMode::kPerHead>
__global__ void __launch_bounds__(kThreads, 2)
    PrefillKernel(AttnParams p, QueryView q, PagedKvView kv, OutputView out) {
  constexpr int kDTiles = D / 8;  // n8 tiles of the output
  constexpr bool kQuant = kCodec != KvCodec::kPlain;
  constexpr int kKvBufs = kQuant ? 1 : 2;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sq = smem;                        // kBM<D> x D
  uint8_t* sk = smem + kBM<D> * D * 2;       // kKvBufs x kBN x D
  uint8_t* sv = sk + kKvBufs * kBN * D * 2;  // kKvBufs x kBN x D
  uint8_t* ck = sv + kKvBufs * kBN * D * 2;  // quantized: 2 x kBN x D codes of K
  uint8_t* cv = ck + 2 * kBN * D;            // and of V
  __shared__ int s_qmin, s_qmax;

  const int tile = blockIdx.x, hq = blockIdx.y, s = blockIdx.z;
  const int G = q.q_heads / kv.kv_heads;
  const int hk = hq / G;
  const int rb = q.seq_row_begin[s], re = q.seq_row_begin[s + 1];
  const int r0 = rb + tile * kBM<D>;
  if (r0 >= re) return;
  const int nrows = min(kBM<D>, re - r0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const float scale = (p.softmax_scale > 0 ? p.softmax_scale : rsqrtf((float)D)) * kLog2e;

  // Q tile -> smem (rows past the end zero-filled).
  {
    const T* qbase = static_cast<const T*>(q.q);
    for (int c = tid; c < kBM<D> * (D / 8); c += kThreads) {
      const int r = c / (D / 8), ch = c % (D / 8);
      const bool valid = r < nrows;
      const T* src = qbase + ((size_t)(r0 + (valid ? r : 0)) * q.q_heads + hq) * D + ch * 8;
      CpAsync16(SmemAddr(sq + Swz<D>(r, ch)), src, valid);
    }
    CpAsyncCommit();
  }
  const int2 qrange = BlockMinMax(q.positions + r0, nrows, &s_qmin, &s_qmax);
  const int qmin = qrange.x, qmax = qrange.y;
  int qpos[kMT<D>][2];
#pragma unroll
  for (int mt = 0; mt < kMT<D>; ++mt) {
    const int r = warp * 16 * kMT<D> + mt * 16 + g;
    qpos[mt][0] = r < nrows ? q.positions[r0 + r] : INT32_MIN;
    qpos[mt][1] = r + 8 < nrows ? q.positions[r0 + r + 8] : INT32_MIN;
  }

  // The stream tokens this tile can see: [n_begin, n_end).
  const int pb = kv.seq_page_begin[s], npages = kv.seq_page_begin[s + 1] - pb;
  const int ntok = kv.seq_tokens[s];
  const int2 keys = VisibleKeys(p, kv, pb, npages, ntok, qmin, qmax, kBN);
  const int n_begin = keys.x, n_end = keys.y;

  const char* pool = static_cast<const char*>(kv.pool);
  const uint64_t koff = PlaneOffset(kv, 0, hk) * sizeof(T), voff = PlaneOffset(kv, 1, hk) * sizeof(T);
  // Coalesced tile loads: each copy instruction of a warp covers 32
  // consecutive 16-byte chunks (whole sectors); a thread's rows are fixed
  // and their page addresses looked up a tile ahead.
  constexpr int kLoads = kBN * (D / 8) / kThreads;
  constexpr int kRowsPerPass = kThreads / (D / 8);
  const int lch = tid % (D / 8), lrow0 = tid / (D / 8);
  struct Bases {
    const char* b[kLoads];
  };
  auto row_bases = [&](int n0) {
    Bases r;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = n0 + k * kRowsPerPass + lrow0;
      r.b[k] = nullptr;
      if (n0 < n_end && i < n_end) {
        const int pg = i / kv.block_tokens, off = i - pg * kv.block_tokens;
        r.b[k] = pool + (uint64_t)kv.page_ids[pb + pg] * kv.page_stride + (uint64_t)off * D * sizeof(T) + lch * 16;
      }
    }
    return r;
  };
  auto load_kv = [&](const Bases& bs, int buf) {
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const uint32_t o = Swz<D>(k * kRowsPerPass + lrow0, lch);
      const bool valid = bs.b[k] != nullptr;
      CpAsync16(SmemAddr(sk + buf * kBN * D * 2 + o), valid ? bs.b[k] + koff : pool, valid);
      CpAsync16(SmemAddr(sv + buf * kBN * D * 2 + o), valid ? bs.b[k] + voff : pool, valid);
    }
    CpAsyncCommit();
  };

  // Whether a tile needs masks (it straddles the causal diagonal, the window
  // edge or the end; positions increase along the stream). Computed a tile
  // ahead, so no tile waits on the position loads.
  auto tile_edge = [&](int n0) -> bool {
    if (n0 >= n_end) return false;
    const int last = min(n0 + kBN, n_end) - 1;
    return n0 + kBN > n_end || (p.causal && TokenPos(kv, pb, last) > qmin) ||
           (p.window > 0 && TokenPos(kv, pb, n0) <= qmax - p.window);
  };
  // Quantized pages: each thread copies and converts chunks of 16 codes,
  // kCLoads rows a plane.
  constexpr int kCChunks = D / 16, kCLoads = kBN * kCChunks / kThreads, kCRowsPerPass = kThreads / kCChunks;
  const int cch = tid % kCChunks, crow0 = tid / kCChunks;
  const uint64_t kcoff = PlaneOffset(kv, 0, hk), vcoff = PlaneOffset(kv, 1, hk);
  auto code_page = [&](int i, int* off) {
    const int pg = i / kv.block_tokens;
    *off = i - pg * kv.block_tokens;
    return pool + (uint64_t)kv.page_ids[pb + pg] * kv.page_stride;
  };
  auto load_codes = [&](int n0, int cb) {
#pragma unroll
    for (int k = 0; k < kCLoads; ++k) {
      const int r = k * kCRowsPerPass + crow0, i = n0 + r;
      const bool valid = i < n_end;
      int off = 0;
      const char* row = valid ? code_page(i, &off) + (uint64_t)off * D + cch * 16 : pool;
      const uint32_t o = cb * kBN * D + r * D + cch * 16;
      CpAsync16(SmemAddr(ck + o), valid ? row + kcoff : pool, valid);
      CpAsync16(SmemAddr(cv + o), valid ? row + vcoff : pool, valid);
    }
    CpAsyncCommit();
  };
  auto convert = [&](int n0, int cb) {
    const uint64_t code_bytes = CodeBytes(kv);
#pragma unroll
    for (int k = 0; k < kCLoads; ++k) {
      const int r = k * kCRowsPerPass + crow0, i = n0 + r;
      const uint32_t o = cb * kBN * D + r * D + cch * 16;
      const uint4 kc = *reinterpret_cast<const uint4*>(ck + o), vc = *reinterpret_cast<const uint4*>(cv + o);
      uint32_t kw[8] = {}, vw[8] = {};
      if (i < n_end) {
        int off = 0;
        const float* scales = reinterpret_cast<const float*>(code_page(i, &off) + code_bytes);
        const float vs = scales[ScaleAt<kMode>(kv, 1, hk, off, 0)];
        const float ks_tok = kMode == ScaleMode::kKChannelVToken ? 1.f : scales[ScaleAt<kMode>(kv, 0, hk, off, 0)];
        const uint8_t* kb = reinterpret_cast<const uint8_t*>(&kc);
        const uint8_t* vb = reinterpret_cast<const uint8_t*>(&vc);
#pragma unroll
        for (int e = 0; e < 16; e += 2) {
          float ks0 = ks_tok, ks1 = ks_tok;
          if constexpr (kMode == ScaleMode::kKChannelVToken) {
            ks0 = scales[ScaleAt<kMode>(kv, 0, hk, off, cch * 16 + e)];
            ks1 = scales[ScaleAt<kMode>(kv, 0, hk, off, cch * 16 + e + 1)];
          }
          kw[e / 2] = Pack<T>(Code<kCodec>(kb[e]) * ks0, Code<kCodec>(kb[e + 1]) * ks1);
          vw[e / 2] = Pack<T>(Code<kCodec>(vb[e]) * vs, Code<kCodec>(vb[e + 1]) * vs);
        }
      }
      *reinterpret_cast<uint4*>(sk + Swz<D>(r, 2 * cch)) = make_uint4(kw[0], kw[1], kw[2], kw[3]);
      *reinterpret_cast<uint4*>(sk + Swz<D>(r, 2 * cch + 1)) = make_uint4(kw[4], kw[5], kw[6], kw[7]);
      *reinterpret_cast<uint4*>(sv + Swz<D>(r, 2 * cch)) = make_uint4(vw[0], vw[1], vw[2], vw[3]);
      *reinterpret_cast<uint4*>(sv + Swz<D>(r, 2 * cch + 1)) = make_uint4(vw[4], vw[5], vw[6], vw[7]);
    }
  };
  // (At head_dim 256 a thread's 16 row addresses, held a tile ahead, would
  // spill beside the accumulators: looked up when the tile is loaded.)
  constexpr bool kLookAhead = D <= 128;
  Bases next_bases{};
  if constexpr (kQuant) {
    if (n_begin < n_end) load_codes(n_begin, 0);
  } else {
    if (n_begin < n_end) load_kv(row_bases(n_begin), 0);
    if constexpr (kLookAhead) next_bases = row_bases(n_begin + kBN);
  }
  bool edge_cur = tile_edge(n_begin);
  CpAsyncWait<0>();  // Q and the first KV tile
  __syncthreads();
  float o[kMT<D>][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMT<D>; ++mt)
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
  float m[kMT<D>][2], l[kMT<D>][2];
#pragma unroll
  for (int mt = 0; mt < kMT<D>; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;

  int buf = 0;
  for (int n0 = n_begin; n0 < n_end; n0 += kBN, buf ^= 1) {
    const bool edge_next = tile_edge(n0 + kBN);
    if (n0 + kBN < n_end) {
      if constexpr (kQuant) {
        load_codes(n0 + kBN, buf ^ 1);
      } else {
        if constexpr (kLookAhead) {
          load_kv(next_bases, buf ^ 1);
          next_bases = row_bases(n0 + 2 * kBN);
        } else {
          load_kv(row_bases(n0 + kBN), buf ^ 1);
        }
      }
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    if constexpr (kQuant) {
      convert(n0, buf);
      __syncthreads();
    }
    const int kb = kQuant ? 0 : buf;
    TileStep<D, T>(p, kv, sq, sk + kb * kBN * D * 2, sv + kb * kBN * D * 2, n0, n_end, pb, edge_cur, qpos, scale, warp,
                   lane, o, m, l);
    edge_cur = edge_next;
    __syncthreads();  // the buffer is reloaded two iterations on (quantized: converted into next iteration)
  }
  StoreRowTile<D>(q, out, hq, r0, nrows, warp, g, tig, o, m, l);
}

template <int D, typename T, KvCodec kCodec = KvCodec::kPlain, ScaleMode kMode = ScaleMode::kPerHead>
cudaError_t Launch(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                   cudaStream_t stream) {
  constexpr size_t smem = SmemBytes<D, kCodec>();
  auto* kernel = PrefillKernel<D, T, kCodec, kMode>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return e;
  dim3 grid((q.max_rows_per_seq + kBM<D> - 1) / kBM<D>, q.q_heads, kv.num_seqs);
  kernel<<<grid, kThreads, smem, stream>>>(p, q, kv, out);
  return cudaGetLastError();
}

// Listed page i's codes of kv.layer, dequantized (code x scale, rounded to
// T as the quantized kernel rounds them) into plain page i of `dst` (one
// layer: [K|V][kv_head][token][D], dst_stride bytes apart), and ids[i] = i.
// A CTA a page; a thread converts 8 codes at a time.
template <int D, typename T, KvCodec kCodec, ScaleMode kMode>
__global__ void __launch_bounds__(256)
    DequantizePagesKernel(PagedKvView kv, int n, int32_t* ids, uint8_t* dst, uint64_t dst_stride) {
  const int i = blockIdx.x;
  if (i >= n) return;
  if (threadIdx.x == 0) ids[i] = i;
  const char* page = static_cast<const char*>(kv.pool) + (uint64_t)kv.page_ids[i] * kv.page_stride;
  const float* scales = reinterpret_cast<const float*>(page + CodeBytes(kv));
  T* out = reinterpret_cast<T*>(dst + (uint64_t)i * dst_stride);
  const int bt = kv.block_tokens, H = kv.kv_heads;
  for (int c = threadIdx.x; c < 2 * H * bt * (D / 8); c += blockDim.x) {
    const int d0 = (c % (D / 8)) * 8, r = c / (D / 8), tok = r % bt, h = (r / bt) % H, which = r / (bt * H);
    const uint2 raw = *reinterpret_cast<const uint2*>(page + PlaneOffset(kv, which, h) + (uint64_t)tok * D + d0);
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float s0 = scales[ScaleAt<kMode>(kv, which, h, tok, d0 + 2 * e)];
      const float s1 = scales[ScaleAt<kMode>(kv, which, h, tok, d0 + 2 * e + 1)];
      w[e] = Pack<T>(Code<kCodec>(b[2 * e]) * s0, Code<kCodec>(b[2 * e + 1]) * s1);
    }
    *reinterpret_cast<uint4*>(out + ((uint64_t)(which * H + h) * bt + tok) * D + d0) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Bytes of a dequantized prefill's workspace: the listed pages' ids (rounded
// up to 1024 bytes), then a plain one-layer page a listed page.
uint64_t DequantizedPageBytes(const PagedKvView& kv) { return 2ull * kv.kv_heads * kv.block_tokens * kv.head_dim * 2; }
uint64_t IdsBytes(int listed_pages) { return ((uint64_t)listed_pages * 4 + 1023) / 1024 * 1024; }

template <int D, typename T>
cudaError_t LaunchQuantized(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                            cudaStream_t stream) {
  return WithEncoding(kv.encoding, [&]<KvCodec kCodec, ScaleMode kMode>() {
    return Launch<D, T, kCodec, kMode>(p, q, kv, out, stream);
  });
}

}  // namespace

// paged_prefill_sm90_cuda.cu (built for sm_90a only).
cudaError_t PagedPrefillSm90(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                             cudaStream_t stream);
}  // namespace internal

cudaError_t PagedPrefill(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                         cudaStream_t stream, PrefillKernel kernel) {
  if (CheckViews(q, kv) != nullptr || out.out == nullptr || out.lse == nullptr) return cudaErrorInvalidValue;
  if (q.num_rows == 0) return cudaSuccess;
  if (kv.encoding.quantized()) {  // quantized pages: the mma.sync kernel, codes converted in shared memory
    if (kernel == PrefillKernel::kWgmma) return cudaErrorNotSupported;
    return internal::WithHeadDim(
        kv, [&]<int D, typename T>() { return internal::LaunchQuantized<D, T>(p, q, kv, out, stream); });
  }
  if (kernel != PrefillKernel::kMmaSync) {
    int dev = 0, major = 0, minor = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (e != cudaSuccess) return e;
    if (major == 9 && minor == 0) {
      e = internal::PagedPrefillSm90(p, q, kv, out, stream);
      if (e != cudaErrorNotSupported || kernel != PrefillKernel::kAuto) return e;
      (void)cudaGetLastError();  // (nothing was launched) kAuto: the mma.sync kernel serves this view
    } else if (kernel != PrefillKernel::kAuto) {
      return cudaErrorNotSupported;
    }
  }
  return internal::WithHeadDim(kv, [&]<int D, typename T>() { return internal::Launch<D, T>(p, q, kv, out, stream); });
}

size_t DequantizedPrefillWorkspaceBytes(const PagedKvView& kv, int listed_pages) {
  if (!kv.encoding.quantized() || listed_pages <= 0) return 0;
  return internal::IdsBytes(listed_pages) + (uint64_t)listed_pages * internal::DequantizedPageBytes(kv);
}

cudaError_t PagedPrefillDequantized(const AttnParams& p, const QueryView& q, const PagedKvView& kv, int listed_pages,
                                    void* workspace, size_t workspace_bytes, OutputView out, cudaStream_t stream,
                                    PrefillKernel kernel) {
  if (!kv.encoding.quantized()) return PagedPrefill(p, q, kv, out, stream, kernel);
  if (CheckViews(q, kv) != nullptr || out.out == nullptr || out.lse == nullptr || listed_pages <= 0 ||
      workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 256 != 0 ||
      workspace_bytes < DequantizedPrefillWorkspaceBytes(kv, listed_pages)) {
    return cudaErrorInvalidValue;
  }
  if (q.num_rows == 0) return cudaSuccess;
  int32_t* ids = static_cast<int32_t*>(workspace);
  uint8_t* pool = static_cast<uint8_t*>(workspace) + internal::IdsBytes(listed_pages);
  const uint64_t page_bytes = internal::DequantizedPageBytes(kv);
  const cudaError_t e = internal::WithHeadDim(kv, [&]<int D, typename T>() {
    return internal::WithEncoding(kv.encoding, [&]<KvCodec kCodec, ScaleMode kMode>() {
      internal::DequantizePagesKernel<D, T, kCodec, kMode>
          <<<listed_pages, 256, 0, stream>>>(kv, listed_pages, ids, pool, page_bytes);
      return cudaGetLastError();
    });
  });
  if (e != cudaSuccess) return e;
  PagedKvView plain = kv;
  plain.pool = pool;
  plain.page_stride = page_bytes;
  plain.layers = 1;
  plain.layer = 0;
  plain.encoding = KvEncoding{};
  plain.page_ids = ids;
  return PagedPrefill(p, q, plain, out, stream, kernel);
}

}  // namespace kvring::cuda
