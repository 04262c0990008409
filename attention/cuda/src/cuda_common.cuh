// Device helpers shared by the attention kernels (internal).
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct; nothing links libcuda)
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

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4T(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void Mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma<__half>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <typename T>
__device__ __forceinline__ uint32_t Pack(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t Pack<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t Pack<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The sum / maximum of x over the 4 lanes of a quad (lanes 4k .. 4k + 3:
// the lanes that hold one row of an m16n8 MMA fragment).
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// Byte offset of 16-byte chunk `c` of row `r` in a swizzled tile of D dims.
template <int D>
__device__ __forceinline__ uint32_t Swz(int r, int c) {
  constexpr int kChunks = D / 8;
  return (uint32_t)(r * kChunks + (c ^ (r & 7))) * 16u;
}

// Byte offset of 16-byte chunk c of row r in a [D/64][rows][128 B] tile with
// the 128-byte swizzle that TMA writes and wgmma reads (chunk c % 8 of a
// 128-byte row at (c % 8) ^ (r % 8)); the tile must start 1024-aligned.
__device__ __forceinline__ uint32_t Sw128(int rows, int r, int c) {
  return (uint32_t)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
// The shared address of dynamic shared memory rounded up to 1024 bytes (the
// 128-byte swizzle's period; kernels ask for 1024 bytes of slack).
__device__ __forceinline__ uint32_t SmemBase1024(const void* dynamic_smem) {
  return (SmemAddr(dynamic_smem) + 1023u) & ~1023u;
}

// mbarrier (shared memory, CTA scope) and its cp.async hook.
__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// The barrier's pending count drops by one when all of this thread's earlier
// cp.async copies have landed (the count set at init includes this arrival).
__device__ __forceinline__ void CpAsyncArriveNoInc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  }
}

// Arrive on a barrier and expect `bytes` of asynchronous (TMA) copies in
// this phase.
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// One box of a 5-d tensor map into shared memory; completes on `bar`.
__device__ __forceinline__ void TmaLoad5d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3, int c4,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
      "%6}], [%7];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}
// TmaLoad5d with an L2 cache policy (from createpolicy).
__device__ __forceinline__ void TmaLoad5dHint(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                              int c4, uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
      "%3, %4, %5, %6}], [%7], %8;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar), "l"(policy)
      : "memory");
}
// An L2 policy that evicts the lines it touches first (data read once).
__device__ __forceinline__ uint64_t L2EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// The same box of a 5-d tensor map fetched into L2 only (no completion to
// wait for; a hint: later loads of it hit L2 if it is still there).
__device__ __forceinline__ void TmaPrefetchL2_5d(const CUtensorMap* map, int c0, int c1, int c2, int c3, int c4) {
  asm volatile("cp.async.bulk.prefetch.tensor.5d.L2.global.tile [%0, {%1, %2, %3, %4, %5}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
               : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to
// shared memory by the bulk-copy engine; completes on `bar`. Global data
// written by other threads' plain stores needs fence.proxy.async.global
// (after the acquire that made them visible) first.
__device__ __forceinline__ void BulkLoad(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// One box of a 3-d tensor map into shared memory; completes on `bar`.
__device__ __forceinline__ void TmaLoad3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Programmatic dependent launch (sm_90; no-ops before, and when the kernel
// was launched without the attribute): let the stream's next kernel begin
// its launch / wait until the previous kernel completed and its writes are
// visible. A kernel reads no global memory a predecessor may write before
// GridDepWait.
__device__ __forceinline__ void GridDepLaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void GridDepWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Fetch a (__grid_constant__ parameter) tensor map into the TMA unit's cache
// ahead of its first use.
__device__ __forceinline__ void TmaPrefetchMap(const CUtensorMap* map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

// Barrier `id` (1..15; 0 is __syncthreads') of `threads` threads (a multiple of 32).
__device__ __forceinline__ void NamedBarrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Generic-proxy writes to shared memory ordered with the async proxy's
// accesses (wgmma reads, TMA writes) that follow.
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Mbarrier initializations visible to the other threads and the async proxy
// (then a CTA barrier).
__device__ __forceinline__ void FenceMbarInit() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ unsigned SmId() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Position of stream token i of a sequence (pages full but the last).
__device__ __forceinline__ int TokenPos(const PagedKvView& kv, int pb, int i) {
  const int pg = i / kv.block_tokens;
  return kv.page_pos[pb + pg] + (i - pg * kv.block_tokens);
}

// Whether a sequence's listed pages have contiguous positions (the first and
// last pages exactly npages - 1 pages apart: every page follows the one
// before, so token i sits at *p0 + i); *p0 is the first page's position.
__device__ __forceinline__ bool PagesContiguous(const PagedKvView& kv, int pb, int npages, int* p0) {
  *p0 = kv.page_pos[pb];
  return kv.page_pos[pb + npages - 1] == *p0 + (npages - 1) * kv.block_tokens;
}

// Number of stream tokens with position <= p (pages in increasing position order).
__device__ __forceinline__ int CountUpTo(const PagedKvView& kv, int pb, int npages, int ntok, int p) {
  if (npages == 0) return 0;
  int p0;
  if (PagesContiguous(kv, pb, npages, &p0)) return (int)max(0ll, min((long long)ntok, (long long)p - p0 + 1));
  int lo = 0, hi = npages;  // first page whose token 0 is > p
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (kv.page_pos[pb + mid] > p)
      hi = mid;
    else
      lo = mid + 1;
  }
  if (lo == 0) return 0;
  const int page = lo - 1;
  const int in_page = min(kv.block_tokens, p - kv.page_pos[pb + page] + 1);
  return min(ntok, page * kv.block_tokens + in_page);
}

// ---- prefill CTAs (paged_prefill_cuda.cu, paged_prefill_sm90_cuda.cu)

// Min and max of positions[0, n) over the CTA: every thread calls it (it
// holds two __syncthreads); s_min / s_max are two shared ints of the caller.
__device__ __forceinline__ int2 BlockMinMax(const int32_t* positions, int n, int* s_min, int* s_max) {
  if (threadIdx.x == 0) {
    *s_min = INT32_MAX;
    *s_max = INT32_MIN;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < n; r += blockDim.x) {
    atomicMin(s_min, positions[r]);
    atomicMax(s_max, positions[r]);
  }
  __syncthreads();
  return make_int2(*s_min, *s_max);
}
// The stream tokens that rows with positions in [qmin, qmax] can see (causal
// and window masks): [x, y), x rounded down to a multiple of `tile`.
__device__ __forceinline__ int2 VisibleKeys(const AttnParams& p, const PagedKvView& kv, int pb, int npages, int ntok,
                                            int qmin, int qmax, int tile) {
  int n_end = ntok, n_begin = 0;
  if (p.causal) n_end = CountUpTo(kv, pb, npages, ntok, qmax);
  if (p.window > 0) n_begin = CountUpTo(kv, pb, npages, ntok, qmin - p.window);
  return make_int2((n_begin / tile) * tile, n_end);
}

// ---- decode CTAs (paged_decode_cuda.cu, paged_decode_quant_cuda.cu)

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
  const int lane = threadIdx.x & 31, mi = lane >> 3, rr = lane & 7, tig = lane & 3;
#pragma unroll
  for (int j = 0; j < 2; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t b0, b1, b2, b3;
    LdMatrixX4(SmemAddr(kt + Sw128(16, (mi >> 1) * 8 + rr, 2 * kk + (mi & 1))), b0, b1, b2, b3);
    Mma<T>(sc[0], qa[kk], b0, b1);
    Mma<T>(sc[1], qa[kk], b2, b3);
  }
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
  uint32_t pa[4] = {Pack<T>(sc[0][0], sc[0][1]), Pack<T>(sc[0][2], sc[0][3]), Pack<T>(sc[1][0], sc[1][1]),
                    Pack<T>(sc[1][2], sc[1][3])};
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
