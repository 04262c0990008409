// Paged decode attention (flash-decoding) on tensor cores.
//
// Grid (splits, kv_heads x row groups, sequences). A CTA owns one kv head of
// one sequence, a contiguous range of its pages (the split), and up to 16
// "rows": the (query row, q head) pairs of that kv head's GQA group, packed
// as the 16 rows of an m16n8k16 tile (GQA packing: a Llama-3 decode step,
// 1 query x 4 heads, fills 4 of them). Warps and splits merge exactly by LSE.
#include <cfloat>

#include "cuda_common.cuh"
#include "tma_cuda.h"

namespace kvring::cuda {
namespace internal {
// paged_decode_quant_cuda.cu: the same contract over int8/fp8 pages.
cudaError_t QuantizedDecode(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                            float* po, float* pl, cudaStream_t stream, QuantDecodeKernel kernel);
namespace {

#ifdef KVRING_DECODE_TRACE
// Diagnostic build only (-DKVRING_DECODE_TRACE; bench/gpu/decode_trace.py):
// each CTA of the last pipelined decode launch stamps %globaltimer at its
// phases into g_decode_trace[cta][slot]. Read with kvring_cuda_decode_trace().
// Slots: 0 entry, 1 past the grid-dependency wait, 2 the producer's first
// copy, 3 the first stage landed, 4 the producer's last copy issued, 5 every
// stage consumed, 13 warps' partials in shared memory, 6 partial stored
// (merge entry), 7 arrival counted, 10 the merger's loads issued, 12 its
// proxy fence passed, 14 its bulk copies issued, 11 its LSEs in, 8 its
// partials in, 9 done; 15: SM id | merged << 32.
constexpr int kTraceSlots = 16, kTraceCtas = 8192;
__device__ unsigned long long g_decode_trace[kTraceCtas * kTraceSlots];
__device__ __forceinline__ void Trace(int slot, unsigned long long v = 0) {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta >= kTraceCtas) return;
  if (slot != 15) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
  g_decode_trace[cta * kTraceSlots + slot] = v;
}
#define KVRING_TRACE(cond, ...)   \
  do {                            \
    if (cond) Trace(__VA_ARGS__); \
  } while (0)
#else
#define KVRING_TRACE(cond, ...) \
  do {                          \
  } while (0)
#endif

constexpr int kRows = 16;  // (row, q head) vectors a CTA: the 16 rows of an m16n8k16 tile

// The split-merge of a decode CTA group, fused into the kernel: after a CTA
// stored its split's partial rows (StoreDecodeRows with num_splits > 1, in
// the split-minor layout: the partials of (row, q head) rh at part_out[(rh *
// num_splits + split) * D], its LSEs at part_lse[rh * num_splits + split]),
// the last of the group's num_splits CTAs to finish merges every split's
// partial into out/lse (exact LSE merge, NaN propagates as in MergePartials)
// and resets the group's counter to 0. `counter` is the group's int in the
// workspace (zero before the first call; each call leaves it zero),
// `scratch` 16-byte aligned shared memory of `scratch_bytes` (at least
// (num_splits + 1) * kRows floats, rounded up to 16 bytes, plus one split's
// kRows x D partial), `bar` an mbarrier initialized with count 1 and not used
// otherwise; `out` 16-byte aligned. Called by every thread of the CTA;
// returns whether this CTA merged.
// The merge is the tail of the launch (it starts when the group's slowest
// CTA is done), so its loads are one round trip where they fit: the bulk-copy
// engine brings the partial rows of as many splits as fit in shared memory
// (all 33 splits of a batch-1 Llama-3 group: 4 vectors x 33 x 512 B), one
// copy a vector (its splits are contiguous), while the threads load the
// LSEs; the weights are computed a warp a row. (A row's splits are stored
// together so that this is one copy a vector, not one a split; a merge
// inside thread block clusters was shorter but made the whole launch slower:
// docs/PERFORMANCE-NOTES.md has both measurements.)
template <int D, int kThreads>
__device__ __forceinline__ bool MergeSplitsIfLast(const DecodeWork& w, const QueryView& q, int num_splits, int* counter,
                                                  const float* part_out, const float* part_lse, uint8_t* scratch,
                                                  int scratch_bytes, uint32_t bar, float* out, float* lse) {
  constexpr int kD4 = D / 4, kOutPerThread = (kRows * kD4 + kThreads - 1) / kThreads;
  __shared__ int s_last;
  KVRING_TRACE(threadIdx.x == 0, 6);
  __threadfence();  // this CTA's partial stores, before its arrival on the counter
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(counter, 1);
    s_last = prev == num_splits - 1;
    if (s_last) {
      *counter = 0;     // every split has arrived: ready for the next call
      __threadfence();  // the other CTAs' partials, after their arrivals (the CTA barrier passes it on)
    }
  }
  __syncthreads();
  KVRING_TRACE(threadIdx.x == 0, 7);
  if (!s_last) return false;
  const int nv = w.nv, nout = nv * kD4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* wgt = reinterpret_cast<float*>(scratch);  // [num_splits][nv]: lse, then weight
  float* s_sum = wgt + num_splits * nv;            // [nv]
  const int head = ((num_splits + 1) * nv * 4 + 15) / 16 * 16;
  float4* buf = reinterpret_cast<float4*>(scratch + head);  // [nv][chunk][D/4]
  const int chunk = max(1, (scratch_bytes - head) / (nout * 16));
  auto load = [&](int s0) {  // partial rows of splits s0 .. s0 + chunk - 1 into buf, a copy a vector; warp 0 issues
    if (warp != 0) return;
    const int n = min(chunk, num_splits - s0);
    asm volatile("fence.proxy.async.global;\n" ::
                     : "memory");  // the partials (generic stores), before the bulk copies read them
    KVRING_TRACE(threadIdx.x == 0 && s0 == 0, 12);
    FenceProxyAsync();  // buf's earlier generic-proxy use, before the async writes
    if (lane == 0) MbarArriveExpectTx(bar, (uint32_t)(n * nout * 16));
    __syncwarp();
    for (int r = lane; r < nv; r += 32) {
      BulkLoad(SmemAddr(buf + (size_t)r * chunk * kD4),
               part_out + ((size_t)DecodeRowHead(w, q, w.v0 + r) * num_splits + s0) * D, (uint32_t)(n * D * 4), bar);
    }
  };
  KVRING_TRACE(threadIdx.x == 0, 10);
  load(0);
  KVRING_TRACE(threadIdx.x == 0, 14);
  for (int i = threadIdx.x; i < num_splits * nv; i += kThreads) {  // (r, split) order: each row's LSEs contiguous
    const int r = i / num_splits, sp = i % num_splits;
    wgt[sp * nv + r] = __ldcg(part_lse + (size_t)DecodeRowHead(w, q, w.v0 + r) * num_splits + sp);
  }
  __syncthreads();
  KVRING_TRACE(threadIdx.x == 0, 11);
  // Weights exp(lse - M) and their sums, a warp a row.
  for (int r = warp; r < nv; r += kThreads / 32) {
    float M = -INFINITY;
    for (int sp = lane; sp < num_splits; sp += 32) M = fmaxf(M, wgt[sp * nv + r]);
#pragma unroll
    for (int k = 16; k > 0; k >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, k));
    float L = 0.f;
    for (int sp = lane; sp < num_splits; sp += 32) {
      const float x = wgt[sp * nv + r];
      const float f = (M == -INFINITY || x == -INFINITY) ? 0.f : __expf(x - M);
      wgt[sp * nv + r] = f;
      L += f;
    }
#pragma unroll
    for (int k = 16; k > 0; k >>= 1) L += __shfl_xor_sync(0xffffffffu, L, k);
    if (lane == 0) {
      s_sum[r] = L;
      lse[DecodeRowHead(w, q, w.v0 + r)] = M == -INFINITY ? -INFINITY : M + __logf(L);
    }
  }
  __syncthreads();  // the weights
  float4 acc[kOutPerThread];
#pragma unroll
  for (int k = 0; k < kOutPerThread; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = 0, phase = 0; s0 < num_splits; s0 += chunk, phase ^= 1) {
    MbarWait(bar, phase);  // the chunk's partials are in
    KVRING_TRACE(threadIdx.x == 0 && s0 == 0, 8);
    const int n = min(chunk, num_splits - s0);
#pragma unroll
    for (int k = 0; k < kOutPerThread; ++k) {
      const int o = threadIdx.x + k * kThreads;
      if (o < nout) {
        const int r = o / kD4;
        const float4* src = buf + (size_t)r * chunk * kD4 + o % kD4;
#pragma unroll 4
        for (int c = 0; c < n; ++c) {
          const float f = wgt[(s0 + c) * nv + r];  // 0 for an empty split, whose partial is 0
          const float4 v = src[c * kD4];
          acc[k].x += f * v.x;
          acc[k].y += f * v.y;
          acc[k].z += f * v.z;
          acc[k].w += f * v.w;
        }
      }
    }
    if (s0 + chunk < num_splits) {
      __syncthreads();  // buf is read: the next chunk may land
      load(s0 + chunk);
    }
  }
#pragma unroll
  for (int k = 0; k < kOutPerThread; ++k) {
    const int o = threadIdx.x + k * kThreads;
    if (o < nout) {
      const int r = o / kD4;
      const float L = s_sum[r], inv = L == 0.f ? 0.f : 1.f / L;
      *reinterpret_cast<float4*>(out + DecodeRowHead(w, q, w.v0 + r) * D + (o % kD4) * 4) =
          make_float4(acc[k].x * inv, acc[k].y * inv, acc[k].z * inv, acc[k].w * inv);
    }
  }
  return true;
}

// ---- Pipelined variant: one producer warp streams the split's KV in
// 16-token stages through a deep ring of shared-memory stages (about 96 KB,
// so two CTAs an SM keep ~190 KB of reads in flight); each stage's "full"
// mbarrier completes when its copies land, and its "empty" one when the
// consumer warp that took it is done. Four consumer warps take the stages
// in turn (warp w: stages w, w+4, ...), each with its own online softmax,
// merged exactly at the end. No CTA-wide barrier inside the stream: a warp
// waits only for its own next stage.
// Copies: with kTma, one lane issues the tensor-memory-accelerator copies of
// a stage (a 16-token box of the K plane and one of the V plane, each
// holding every 64-column block, 128-byte swizzled) against a tensor map of
// the page pool: two copies per 8 KB instead of 512 16-byte cp.async (and
// half the boxes of one box per column block); it needs pages of a
// multiple of 16 tokens. Otherwise the 32 lanes gather the stage with
// cp.async into the same swizzled layout (any page size).
// Splits are static (contiguous page ranges): work claiming across a group's
// splits evened out the CTAs' finish times but slowed every CTA's stream
// more than it gained (docs/PERFORMANCE-NOTES.md, "work claiming").
constexpr int kPStage = 16, kPConsumers = 4, kPThreads = (kPConsumers + 1) * 32;

template <int D>
struct PipeCfg {
  static constexpr int kPlaneBytes = kPStage * D * 2;  // K (or V) of one stage: [D/64][16 rows][128 B]
  static constexpr int kStageBytes = 2 * kPlaneBytes;  // K, then V
  // 12 (D=128) or 24 (D=64) stages in ~96 KB, two CTAs an SM; D=256: 8 in
  // 128 KB, one CTA an SM (its 32 x 4 accumulators a thread leave no room for
  // a second CTA's registers; 96 KB would make 6 stages, not a multiple of the
  // 4 consumers).
  static constexpr int kStages = D > 128 ? 8 : (96 * 1024) / kStageBytes;
  static constexpr int kCtasPerSm = D > 128 ? 1 : 2;
  // Stages prefetched into L2 before the grid-dependency wait (stable
  // tables): half the ring, ~12 MB over a batch-1 Llama-3 launch's 264 CTAs
  // (half and the whole ring measured alike, two rings slower; the
  // prefetch only pays with the stream's loads evict-first:
  // docs/PERFORMANCE-NOTES.md).
  static constexpr int kPrefetchStages = kStages / 2;
  static_assert(kPrefetchStages * kPStage <= 64 * 16,
                "the prefetched stages lie in the producer's first page-id window (TMA pages hold >= 16 tokens)");
  static constexpr int kQOff = kStages * kStageBytes;  // stages first: 1024-aligned for the swizzle
  static constexpr int kBarOff = kQOff + kRows * D * 2;
  static constexpr int kBytes = kBarOff + 2 * kStages * 8;
  static constexpr int kDynamic = kBytes + 1024;  // slack to align the base
  static_assert(kPConsumers * kRows * D * 4 <= kStages * kStageBytes, "merge buffer reuses the stages");
  // A stage is always taken by the same consumer warp (stage t by warp t % 4),
  // so a warp waits for a stage's round r only after it released round r - 1
  // itself. With a ring of 13 (tried on the H200: the kernel faulted) stages
  // rotate between warps, and a warp can wait on a barrier still two phases
  // behind (same parity: mbarrier parity waits cannot tell) and read a stage
  // whose copy is still in flight.
  static_assert(kStages % kPConsumers == 0, "each stage belongs to one consumer warp");
  static_assert(((kMaxDecodeSplits + 1) * kRows * 4 + 15) / 16 * 16 + kRows * D * 4 <= kStages * kStageBytes,
                "the split-merge's weights and one split's partial rows fit in the stages");
};

// The decode CTA's producer warp: streams the split's K/V, one 16-token
// stage of K and V at a time, through the ring (full0 / empty0), by TMA (a
// box a plane) or cp.async (its 32 lanes), moving its page window along.
template <int D, typename T, bool kTma, typename StageBox, typename Plane>
__device__ __forceinline__ void ProduceDecodeStages(const PagedKvView& kv, PageWindow& win, int h, int pb, int npages,
                                                    int tok_lo, int tok_hi, int ntiles, uint8_t* stages, uint32_t full0,
                                                    uint32_t empty0, int lane, int bt, const CUtensorMap* pool_map,
                                                    StageBox& stage_box, Plane& plane) {
  using C = PipeCfg<D>;
  constexpr int kChunks = D / 8;
  const char* pool = static_cast<const char*>(kv.pool);
  const uint64_t koff = PlaneOffset(kv, 0, h) * sizeof(T), voff = PlaneOffset(kv, 1, h) * sizeof(T);
  // The stream is read once: its lines leave L2 first, so they do not push
  // out the next launch's prefetched stages (nor anything else).
  const uint64_t evict_first = L2EvictFirstPolicy();
  for (int t = 0; t < ntiles; ++t) {
    const int st = t % C::kStages;
    if (t >= C::kStages) MbarWait(empty0 + 8 * st, ((t / C::kStages) - 1) & 1);
    const uint32_t sk = SmemAddr(stages + st * C::kStageBytes), sv = sk + C::kPlaneBytes;
    if constexpr (kTma) {
      // The stage lies in one page (block_tokens % 16 == 0).
      int page, off;
      stage_box(t, &page, &off);
      KVRING_TRACE(lane == 0 && t == 0, 2);
      if (lane == 0) {
        MbarArriveExpectTx(full0 + 8 * st, C::kStageBytes);
        // One box a plane: its D / 64 column blocks land as [D/64][16][128 B].
        TmaLoad5dHint(sk, pool_map, 0, off, 0, plane(0), page, full0 + 8 * st, evict_first);
        TmaLoad5dHint(sv, pool_map, 0, off, 0, plane(1), page, full0 + 8 * st, evict_first);
      }
    } else {
      constexpr int kPerLane = kPStage * kChunks / 32;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int id = k * 32 + lane, row = id / kChunks, ch = id % kChunks;
        const int i = tok_lo + t * kPStage + row;
        const bool valid = i < tok_hi;
        const int pg = i / bt;  // in the window: a stage spans at most 16 pages
        const char* src =
            pool + (uint64_t)win.Page(pg) * kv.page_stride + (uint64_t)(i - pg * bt) * D * sizeof(T) + ch * 16;
        const uint32_t off = Sw128(kPStage, row, ch);
        CpAsync16(sk + off, valid ? src + koff : pool, valid);
        CpAsync16(sv + off, valid ? src + voff : pool, valid);
      }
      CpAsyncArriveNoInc(full0 + 8 * st);
    }
    win.Advance(kv, pb, npages, (tok_lo + (t + 1) * kPStage) / bt);
  }
  if constexpr (!kTma) CpAsyncWait<0>();
  KVRING_TRACE(lane == 0, 4);
}

template <int D, typename T, bool kTma>
__global__ void __launch_bounds__(kPThreads, PipeCfg<D>::kCtasPerSm)
    DecodePipelinedKernel(AttnParams p, QueryView q, PagedKvView kv, int num_splits, int row_groups, float* part_out,
                          float* part_lse, int* counters, float* out, float* lse,
                          const __grid_constant__ CUtensorMap pool_map) {
  using C = PipeCfg<D>;
  constexpr int kChunks = D / 8, kKSteps = D / 16, kDTiles = D / 8;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (SmemBase1024(smem_raw) - SmemAddr(smem_raw));
  uint8_t* stages = smem;
  uint8_t* sq = smem + C::kQOff;
  const uint32_t full0 = SmemAddr(smem + C::kBarOff), empty0 = full0 + 8 * C::kStages;
  __shared__ int s_qpos[kRows];
  __shared__ int s_qmin, s_qmax;
  __shared__ float s_m[kPConsumers][kRows], s_l[kPConsumers][kRows], s_fac[kPConsumers][kRows];
  __shared__ alignas(8) uint64_t s_merge_bar;  // the split-merge's bulk copies

  // Programmatic dependent launch: the next kernel in the stream may start
  // its launch now (its CTAs land as ours leave and wait in GridDepWait for
  // our completion); we wait for the previous kernel's before reading global
  // memory it may write. The barrier setup and the tensor map's prefetch come
  // first; with kv.tables_stable (the caller's promise that no running kernel
  // writes the tables) also the split's tables, the producer's first page
  // ids and an L2 prefetch of the split's first ring of stages, so the stream
  // starts from L2 the moment the previous kernel completes.
  KVRING_TRACE(threadIdx.x == 0, 0);
  GridDepLaunchDependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
  const int bt = kv.block_tokens;
  if (tid == 0) {
    if constexpr (kTma) TmaPrefetchMap(&pool_map);
    for (int i = 0; i < C::kStages; ++i) {
      MbarInit(full0 + 8 * i, kTma ? 1 : 32);  // the TMA lane's expect-tx arrival, or the 32 lanes' cp.async ones
      MbarInit(empty0 + 8 * i, 1);             // the consumer warp that took the stage
    }
    MbarInit(SmemAddr(&s_merge_bar), 1);
    FenceMbarInit();
  }
  DecodeWork w;
  bool has_work = false;
  PageWindow win;   // the producer's page ids
  StreamEnds ends;  // the consumers' mask check
  auto read_tables = [&] {
    has_work = DecodeWorkOf(q, kv, num_splits, row_groups, kRows, &w);
    if (has_work && warp == kPConsumers) {
      win.Load(kv, w.pb, w.npages, w.tok_lo / bt);
    } else if (has_work) {
      ends = DecodeStreamEnds(p, kv, w.pb, w.tok_lo, w.tok_hi);
    }
  };
  // TMA coordinates of stage t (16 tokens from tok_lo + 16 t, inside one
  // page: block_tokens % 16 == 0) while the window holds its page; every
  // lane of the producer warp calls it.
  auto stage_box = [&](int t, int* page, int* off) {
    const int i0 = w.tok_lo + t * kPStage, pg = i0 / bt;
    *page = win.Page(pg);
    *off = i0 - pg * bt;
  };
  // The pool map's plane of this CTA's kv head: K (side 0) or V (side 1).
  auto plane = [&](int side) { return (kv.layer * 2 + side) * kv.kv_heads + w.h; };
  if (kv.tables_stable) {
    read_tables();
    if constexpr (kTma) {
      if (has_work && warp == kPConsumers) {
        const int n = min(C::kPrefetchStages, (w.tok_hi - w.tok_lo + kPStage - 1) / kPStage);
        for (int t = 0; t < n; ++t) {
          int page, off;
          stage_box(t, &page, &off);
          if (lane == 0) {
            TmaPrefetchL2_5d(&pool_map, 0, off, 0, plane(0), page);
            TmaPrefetchL2_5d(&pool_map, 0, off, 0, plane(1), page);
          }
        }
      }
    }
  }
  __syncthreads();
  GridDepWait();
  KVRING_TRACE(threadIdx.x == 0, 1);
  if (!kv.tables_stable) read_tables();
  if (!has_work) return;
  const int h = w.h, nv = w.nv, pb = w.pb, npages = w.npages;
  const int tok_lo = w.tok_lo, tok_hi = w.tok_hi;
  const float scale = (p.softmax_scale > 0 ? p.softmax_scale : rsqrtf((float)D)) * kLog2e;
  const int ntiles = tok_hi > tok_lo ? (tok_hi - tok_lo + kPStage - 1) / kPStage : 0;

  // The producer starts streaming as soon as it has its page ids; the
  // consumers bring Q and the rows' positions meanwhile and meet at a barrier
  // of their own (the launch's first bytes of KV are on its critical path:
  // a batch-1 decode is one wave of CTAs).
  if (warp < kPConsumers) {
    LoadDecodeQueries<D, T>(q, w, sq, s_qpos, &s_qmin, &s_qmax, kPConsumers * 32);
    NamedBarrier(1, kPConsumers * 32);
  }

  float o[kDTiles][4];
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  if (warp == kPConsumers) {
    // ---- producer
    ProduceDecodeStages<D, T, kTma>(kv, win, h, pb, npages, tok_lo, tok_hi, ntiles, stages, full0, empty0, lane, bt,
                                    &pool_map, stage_box, plane);
  } else {
    // ---- consumers
    uint32_t qa[kKSteps][4];
    LoadDecodeQFragments<D>(sq, qa);
    const int qpos0 = s_qpos[g], qpos1 = s_qpos[g + 8], qmin = s_qmin, qmax = s_qmax;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    const bool cta_pos_mask = DecodeMaskMayHide(p, tok_lo, tok_hi, ends, qmin, qmax);
    for (int t = warp; t < ntiles; t += kPConsumers) {
      const int st = t % C::kStages;
      MbarWait(full0 + 8 * st, (t / C::kStages) & 1);
      KVRING_TRACE(t == 0 && lane == 0, 3);
      uint8_t* kt = stages + st * C::kStageBytes;
      uint8_t* vt = kt + C::kPlaneBytes;
      const int tile_first = tok_lo + t * kPStage;
      const bool tail = tile_first + kPStage > tok_hi;
      if (kTma && tail) {
        // A TMA box copies whole pages: zero the V rows past the end (their
        // weight is 0, but 0 x NaN junk would not be).
        const int valid_rows = tok_hi - tile_first;
        for (int c = lane; c < (kPStage - valid_rows) * kChunks; c += 32) {
          const int r = valid_rows + c / kChunks, ch = c % kChunks;
          *reinterpret_cast<uint4*>(vt + Sw128(kPStage, r, ch)) = make_uint4(0, 0, 0, 0);
        }
        __syncwarp();
      }
      float sc[2][4];
      DecodeScores<D, T, false>(qa, kt, p, kv, pb, tile_first, tok_hi, qpos0, qpos1, qmin, qmax, cta_pos_mask, scale,
                                nullptr, sc);
      DecodeSoftmaxPV<D, T, false>(sc, nullptr, m0, m1, l0, l1, o, vt);
      if (kTma && tail) FenceProxyAsync();  // our zeros before the next TMA write
      __syncwarp();
      if (lane == 0) MbarArrive(empty0 + 8 * st);
    }
    l0 = QuadSum(l0);
    l1 = QuadSum(l1);
  }
  __syncthreads();  // every stage consumed: the ring is free for the consumers' (m, l, O)
  KVRING_TRACE(threadIdx.x == 0, 5);
  // The consumers' (m, l, O) of the rows that exist, O at a row stride of D
  // + 4 floats (the 8 row groups of a fragment land in distinct banks).
  constexpr int kSoStride = D + 4;
  static_assert(kPConsumers * kRows * kSoStride * 4 <= C::kStages * C::kStageBytes,
                "O of the warps fits in the stages");
  float* so = reinterpret_cast<float*>(stages);  // [kPConsumers][kRows][kSoStride]
  if (warp < kPConsumers) {
    if (tig == 0) {
      s_m[warp][g] = m0;
      s_m[warp][g + 8] = m1;
      s_l[warp][g] = l0;
      s_l[warp][g + 8] = l1;
    }
    float* r0p = so + ((size_t)warp * kRows + g) * kSoStride + tig * 2;
    float* r1p = r0p + 8 * kSoStride;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      if (g < nv) *reinterpret_cast<float2*>(r0p + j * 8) = make_float2(o[j][0], o[j][1]);
      if (g + 8 < nv) *reinterpret_cast<float2*>(r1p + j * 8) = make_float2(o[j][2], o[j][3]);
    }
  }
  __syncthreads();
  KVRING_TRACE(threadIdx.x == 0, 13);
  StoreDecodeRows<kPConsumers, D, kSoStride, /*kSplitMinor=*/true>(w, q, kRows, num_splits, &s_m[0][0], &s_l[0][0], so,
                                                                   &s_fac[0][0], part_out, part_lse, out, lse);
  bool merged = false;
  if (num_splits > 1) {  // (its first barrier: every thread is done reading `so`, which the merge reuses)
    merged = MergeSplitsIfLast<D, kPThreads>(w, q, num_splits, counters + DecodeRowHead(w, q, w.v0), part_out, part_lse,
                                             stages, C::kStages * C::kStageBytes, SmemAddr(&s_merge_bar), out, lse);
  }
  KVRING_TRACE(threadIdx.x == 0, 9);
  KVRING_TRACE(threadIdx.x == 0, 15, (unsigned long long)SmId() | (merged ? 1ull << 32 : 0ull));
  (void)merged;
}

// Launched with programmatic stream serialization (PDL): a kernel that
// follows in the stream is launched while this one drains, and this one's
// launch overlaps its predecessor's tail (the kernel waits for it before it
// reads global memory).
template <int D, typename T, bool kTma>
cudaError_t LaunchPipelinedAs(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                              int splits, int row_groups, float* part_out, float* part_lse, int* counters,
                              const CUtensorMap& map, cudaStream_t stream) {
  const int smem = PipeCfg<D>::kDynamic;
  cudaError_t e =
      cudaFuncSetAttribute(DecodePipelinedKernel<D, T, kTma>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(splits, kv.kv_heads * row_groups, kv.num_seqs);
  cfg.blockDim = dim3(kPThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, DecodePipelinedKernel<D, T, kTma>, p, q, kv, splits, row_groups, part_out, part_lse,
                            counters, out.out, out.lse, map);
}

template <int D, typename T>
cudaError_t LaunchPipelined(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                            float* part_out, float* part_lse, int* counters, cudaStream_t stream) {
  const int G = q.q_heads / kv.kv_heads;
  const int row_groups = (q.max_rows_per_seq * G + kRows - 1) / kRows;
  alignas(64) CUtensorMap map{};
  if (MakePoolMap(kv, kPStage, &map, /*all_column_blocks=*/true, /*l2_promotion_bytes=*/128)) {
    return LaunchPipelinedAs<D, T, true>(p, q, kv, out, splits, row_groups, part_out, part_lse, counters, map, stream);
  }
  return LaunchPipelinedAs<D, T, false>(p, q, kv, out, splits, row_groups, part_out, part_lse, counters, map, stream);
}

}  // namespace
}  // namespace internal

const char* CheckViews(const QueryView& q, const PagedKvView& kv) {
  if (kv.pool == nullptr || kv.page_ids == nullptr || kv.page_pos == nullptr || kv.seq_page_begin == nullptr ||
      kv.seq_tokens == nullptr) {
    return "KV view has null pointers";
  }
  if (q.q == nullptr || q.positions == nullptr || q.seq_row_begin == nullptr) return "query view has null pointers";
  if (!KernelsTakeHeadDim(kv.head_dim)) return "head_dim must be 64, 128 or 256";
  if (kv.kv_heads <= 0 || q.q_heads <= 0 || q.q_heads % kv.kv_heads != 0)
    return "q_heads must be a multiple of kv_heads";
  if (kv.layer < 0 || kv.layer >= kv.layers) return "layer out of range";
  if (kv.block_tokens <= 0 || kv.block_tokens > 256) return "block_tokens must be in [1, 256]";
  // (16-byte copies: cp.async and TMA)
  if (reinterpret_cast<uintptr_t>(q.q) % 16 != 0) return "query array must be 16-byte aligned";
  if (reinterpret_cast<uintptr_t>(kv.pool) % 16 != 0 || kv.page_stride % 16 != 0) {
    return "pool and page_stride must be 16-byte aligned";
  }
  KvEncoding known;
  if (!KvEncoding::Unpack(kv.encoding.Pack(), &known)) return "unknown KV encoding";
  const BlockLayout layout{static_cast<uint32_t>(kv.block_tokens), static_cast<uint32_t>(kv.layers),
                           static_cast<uint32_t>(kv.kv_heads), static_cast<uint32_t>(kv.head_dim),
                           kv.dtype == KvType::kBF16 ? DType::kBF16 : DType::kF16};
  const uint64_t block = EncodedBytes(layout, kv.encoding);
  if (block >= (uint64_t{1} << 31)) return "a block of 2 GiB or more";  // (32-bit indices into a page)
  if (kv.page_stride < block) {
    return kv.encoding.quantized() ? "page_stride smaller than a quantized block" : "page_stride smaller than a block";
  }
  if (kv.num_seqs <= 0 || q.max_rows_per_seq <= 0) return "no sequences";
  return nullptr;
}

#ifdef KVRING_DECODE_TRACE
extern "C" int kvring_cuda_decode_trace(unsigned long long* host, int max_ctas) {
  const int n = max_ctas < internal::kTraceCtas ? max_ctas : internal::kTraceCtas;
  return cudaMemcpyFromSymbol(host, internal::g_decode_trace, (size_t)n * internal::kTraceSlots * 8);
}
#endif

int DefaultDecodeSplits(const QueryView& q, const PagedKvView& kv, int max_pages_per_seq, int sm_count) {
  // At least one full wave of the CTAs an SM holds (two; one at head_dim 256; three for the quantized
  // kernel of small GQA groups), and splits of at
  // most ~8K tokens: the split sweep on the H200 put a batch of 1 best at
  // exactly one wave and long streams best cut to 4-8K tokens a CTA
  // (docs/PERFORMANCE-NOTES.md).
  // (Quantized pages with small GQA groups: 8 vectors a CTA, three CTAs an SM.)
  const int G = q.q_heads / kv.kv_heads;
  const bool quantized = kv.encoding.quantized();
  const int vectors = quantized ? internal::QuantizedDecodeVectorsPerCta(q, kv) : 16;
  const int row_groups = (q.max_rows_per_seq * G + vectors - 1) / vectors;
  const long ctas = (long)kv.num_seqs * kv.kv_heads * row_groups;
  const long per_sm = kv.head_dim > 128 ? 1 : quantized ? internal::QuantizedDecodeCtasPerSm(q, kv) : 2;
  const long slots = per_sm * sm_count;
  const long tokens = (long)max_pages_per_seq * std::max(1, kv.block_tokens);
  long splits = std::max<long>(std::max<long>(1, slots / ctas), (tokens + 8191) / 8192);
  splits = std::min<long>(splits, std::max(1, max_pages_per_seq / 4));  // >= 4 pages per split
  return (int)std::max<long>(1, std::min<long>(splits, 256));
}

namespace {
// Workspace layout: the split-merge counters first (one int per (row, q
// head), at the same place whatever the split count, so partials of a call
// with more splits never land on them), then the partial O and LSE (plain
// pages: each (row, head)'s splits together, for the fused merge; quantized
// pages: split-major, for MergePartials).
size_t CounterBytes(const QueryView& q) { return ((size_t)q.num_rows * q.q_heads * sizeof(int) + 255) / 256 * 256; }
}  // namespace

size_t DecodeCounterBytes(const QueryView& q) { return CounterBytes(q); }

size_t DecodeWorkspaceBytes(const QueryView& q, int num_splits, int head_dim) {
  if (num_splits <= 1) return 0;
  const size_t rh = (size_t)q.num_rows * q.q_heads;
  return CounterBytes(q) + (size_t)num_splits * rh * (head_dim + 1) * sizeof(float);
}

cudaError_t PagedDecode(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int num_splits,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream, QuantDecodeKernel kernel) {
  if (CheckViews(q, kv) != nullptr || out.out == nullptr || out.lse == nullptr || num_splits < 1 ||
      num_splits > kMaxDecodeSplits || static_cast<uint32_t>(kernel) > 2) {
    return cudaErrorInvalidValue;
  }
  if (q.num_rows == 0) return cudaSuccess;
  const int D = kv.head_dim;
  if (workspace_bytes < DecodeWorkspaceBytes(q, num_splits, D)) return cudaErrorInvalidValue;
  int* counters = nullptr;
  float *po = nullptr, *pl = nullptr;
  if (num_splits > 1) {
    if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0) return cudaErrorInvalidValue;  // the merge's bulk copies
    counters = static_cast<int*>(workspace);
    po = reinterpret_cast<float*>(static_cast<char*>(workspace) + CounterBytes(q));
    pl = po + (size_t)num_splits * q.num_rows * q.q_heads * D;
  }
  if (kv.encoding.quantized()) {  // quantized pages: the splits' partials are merged by a second kernel
    const cudaError_t e = internal::QuantizedDecode(p, q, kv, out, num_splits, po, pl, stream, kernel);
    if (e != cudaSuccess || num_splits == 1) return e;
    return MergePartials(po, pl, num_splits, q.num_rows * q.q_heads, D, out, stream);
  }
  if (num_splits > 1 && reinterpret_cast<uintptr_t>(out.out) % 16 != 0) return cudaErrorInvalidValue;  // float4 merge
  return internal::WithHeadDim(kv, [&]<int kD, typename T>() {
    return internal::LaunchPipelined<kD, T>(p, q, kv, out, num_splits, po, pl, counters, stream);
  });
}

}  // namespace kvring::cuda
