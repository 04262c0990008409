// The CUDA kernels against the float64 CPU reference on fresh random inputs:
// decode (split-KV), prefill (tensor cores), merge; shapes that are not
// tile multiples, causal edges, rows that see no key, sharded page lists.
// Label gpu: skipped where there is no device.
#include <thread>

#include "absl/strings/str_cat.h"
#include "gpu_test_util.h"
#include "kvring/attention/cuda/copy_runs_cuda.h"
#include "kvring/attention/merge.h"
#include "kvring/attention/ring/gpu_ring.h"
#include "kvring/cache/quantize.h"
#include "kvring/transport/device_loopback_transport.h"
#include "kvring/transport/nccl_transport.h"

namespace kvring {
namespace {

using namespace gpu_testing;

// Whether the device is sm_90 (the TMA / wgmma kernels').
bool Sm90() {
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0;
}

// The two non-default masks the window tests run, set alike on the kernel's
// and the reference's options: mode 0 a sliding window of `window`
// positions (causal), mode 1 no mask (not causal).
void SetMaskMode(int mode, int window, cuda::AttnParams* p, AttentionOptions* o) {
  if (mode == 0) {
    p->window = window;
    o->window = window;
  } else {
    p->causal = false;
    o->causal = false;
  }
}

// Runs `kernel` on qb over layer 0 of kvb into NaN-poisoned outputs and
// checks them against the float64 reference (call it inside
// ASSERT_NO_FATAL_FAILURE: a failed launch stops the test).
void ExpectPrefillMatches(const cuda::AttnParams& p, const AttentionOptions& o, const QueryBatch& qb,
                          const PagedBatch& kvb, cuda::PrefillKernel kernel, double tol, const std::string& what) {
  Dev<float> out((size_t)qb.pos.size() * qb.q_heads * qb.D), lse((size_t)qb.pos.size() * qb.q_heads);
  out.Poison();
  lse.Poison();
  CUDA_OK(cuda::PagedPrefill(p, qb.View(), kvb.View(0), {out.p, lse.p}, nullptr, kernel));
  CUDA_OK(cudaDeviceSynchronize());
  ExpectMatches(out.Host(), lse.Host(), qb, kvb, o, tol, what);
}

// Views the kernels' 16-byte copies cannot read are refused at the boundary,
// before anything touches the device (runs without a GPU: the pointers are
// never dereferenced).
TEST(GpuViewsTest, MisalignedViewsAreRefused) {
  alignas(16) static uint16_t pool[16], q[16];
  static int32_t ints[4] = {0, 1, 1, 16};
  cuda::PagedKvView kv;
  kv.pool = pool;
  kv.page_stride = 2 * 2 * 16 * 64 * 2;
  kv.block_tokens = 16;
  kv.layers = 1;
  kv.kv_heads = 2;
  kv.head_dim = 64;
  kv.page_ids = kv.page_pos = kv.seq_page_begin = kv.seq_tokens = ints;
  kv.num_seqs = 1;
  cuda::QueryView qv;
  qv.q = q;
  qv.positions = qv.seq_row_begin = ints;
  qv.num_rows = 1;
  qv.q_heads = 2;
  qv.max_rows_per_seq = 1;
  EXPECT_EQ(cuda::CheckViews(qv, kv), nullptr);
  float out[64], lse[2];
  qv.q = q + 1;
  EXPECT_STREQ(cuda::CheckViews(qv, kv), "query array must be 16-byte aligned");
  EXPECT_EQ(cuda::PagedPrefill({}, qv, kv, {out, lse}, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::PagedDecode({}, qv, kv, {out, lse}, 1, nullptr, 0, nullptr), cudaErrorInvalidValue);
  qv.q = q;
  kv.pool = pool + 4;
  EXPECT_STREQ(cuda::CheckViews(qv, kv), "pool and page_stride must be 16-byte aligned");
  kv.pool = pool;
  kv.page_stride += 8;
  EXPECT_STREQ(cuda::CheckViews(qv, kv), "pool and page_stride must be 16-byte aligned");
  EXPECT_EQ(cuda::PagedPrefill({}, qv, kv, {out, lse}, nullptr), cudaErrorInvalidValue);
}

// Decode: batches of sequences with 1..8 query rows each, GQA 1/4/8.
TEST(GpuDecodeTest, MatchesReferenceAcrossShapes) {
  KVRING_REQUIRE_GPU();
  uint64_t seed = 1;
  for (int D : {64, 128, 256})
    for (int ratio : {1, 4, 8})
      for (int bt : {16, 64})
        for (int splits : {1, 7}) {
          std::mt19937_64 rng(seed++);
          const int kv_heads = 2, q_heads = kv_heads * ratio;
          const bool bf16 = seed % 2;
          std::vector<int> toks = {1 + (int)(rng() % 700), 33, 16 * 9, 1};
          std::vector<int> starts = {0, 5, 100, 0};
          auto kvb = MakeBatch(rng, bt, 2, kv_heads, D, bf16, toks, starts, /*gap=*/seed % 3 == 0, /*layer=*/1);
          std::vector<std::vector<int32_t>> qpos;
          for (size_t s = 0; s < toks.size(); ++s) {
            const auto& kp = kvb.seqs[s].dense.positions;
            std::vector<int32_t> rows;
            const int nr = 1 + rng() % 8;
            for (int r = 0; r < nr; ++r) rows.push_back(kp.back() - (int)(rng() % 3));
            if (s == 1) rows[0] = 2;  // before every key of sequence 1: sees nothing
            qpos.push_back(rows);
          }
          auto qb = MakeQueries(rng, q_heads, D, bf16, qpos);
          Dev<float> out((size_t)qb.pos.size() * q_heads * D), lse((size_t)qb.pos.size() * q_heads);
          out.Poison();
          lse.Poison();
          const size_t ws = cuda::DecodeWorkspaceBytes(qb.View(), splits, D);
          Dev<uint8_t> work(ws);
          work.Zero();  // the split merge's counters start at 0
          cuda::AttnParams p;
          CUDA_OK(cuda::PagedDecode(p, qb.View(), kvb.View(1), {out.p, lse.p}, splits, work.p, ws, nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          AttentionOptions o;
          o.layer = 1;
          // The tensor cores take P rounded to 16 bits for P V: the tolerance of 16-bit operands.
          ExpectMatches(out.Host(), lse.Host(), qb, kvb, o, bf16 ? 1e-2 : 3e-3,
                        absl::StrCat("decode D=", D, " ratio=", ratio, " bt=", bt, " splits=", splits));
        }
}

// Long KV streams: hundreds of pages a split (the stage ring turns many
// times and the producer's page-id window slides), page sizes smaller than
// a 16-token stage (cp.async gathers), equal to it and a multiple of it (TMA
// boxes).
TEST(GpuDecodeTest, LongSequencesMatchTheReference) {
  KVRING_REQUIRE_GPU();
  uint64_t seed = 500;
  for (int D : {128, 256})  // (256: a ring of 8 stages of 16 KB)
    for (int bt : {4, 16, 48})
      for (int splits : {1, 3, 40}) {
        std::mt19937_64 rng(seed++);
        const bool bf16 = seed % 2;
        std::vector<int> toks = {5000 + (int)(rng() % 700), 2100};
        auto kvb = MakeBatch(rng, bt, 1, 2, D, bf16, toks, {0, 0}, /*gap=*/bt == 16, 0);
        std::vector<std::vector<int32_t>> qpos;
        for (const auto& sq : kvb.seqs) qpos.push_back({sq.dense.positions.back() + 1, sq.dense.positions.back() + 2});
        auto qb = MakeQueries(rng, 8, D, bf16, qpos);
        Dev<float> out((size_t)qb.pos.size() * 8 * D), lse((size_t)qb.pos.size() * 8);
        out.Poison();
        lse.Poison();
        const size_t ws = cuda::DecodeWorkspaceBytes(qb.View(), splits, D);
        Dev<uint8_t> work(ws);
        work.Zero();  // the split merge's counters start at 0
        cuda::AttnParams p;
        // Twice on one workspace: the fused split merge's counters must be
        // back at zero after a call (else the second merges too early or never).
        for (int call = 0; call < 2; ++call) {
          out.Poison();
          lse.Poison();
          CUDA_OK(cuda::PagedDecode(p, qb.View(), kvb.View(0), {out.p, lse.p}, splits, work.p, ws, nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          ExpectMatches(out.Host(), lse.Host(), qb, kvb, {}, bf16 ? 1e-2 : 3e-3,
                        absl::StrCat("long decode D=", D, " bt=", bt, " splits=", splits, " call ", call));
        }
      }
}

// The fused split merge loads as many splits' partial rows as fit in shared
// memory at once: full 16-vector row groups (2 rows x GQA 8) and up to
// kMaxDecodeSplits splits (most of them empty) take several chunks, every
// head size.
TEST(GpuDecodeTest, ManySplitsMergeInChunks) {
  KVRING_REQUIRE_GPU();
  uint64_t seed = 700;
  for (int D : {64, 128, 256})
    for (int splits : {100, cuda::kMaxDecodeSplits}) {
      std::mt19937_64 rng(seed++);
      auto kvb = MakeBatch(rng, 16, 1, 2, D, /*bf16=*/true, {1900 + (int)(rng() % 300), 40}, {0, 0}, false, 0);
      std::vector<std::vector<int32_t>> qpos;
      for (const auto& sq : kvb.seqs) qpos.push_back({sq.dense.positions.back(), sq.dense.positions.back() + 1});
      auto qb = MakeQueries(rng, 16, D, true, qpos);
      Dev<float> out((size_t)qb.pos.size() * 16 * D), lse((size_t)qb.pos.size() * 16);
      out.Poison();
      lse.Poison();
      const size_t ws = cuda::DecodeWorkspaceBytes(qb.View(), splits, D);
      Dev<uint8_t> work(ws);
      work.Zero();
      CUDA_OK(
          cuda::PagedDecode(cuda::AttnParams{}, qb.View(), kvb.View(0), {out.p, lse.p}, splits, work.p, ws, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      ExpectMatches(out.Host(), lse.Host(), qb, kvb, {}, 1e-2, absl::StrCat("decode D=", D, " splits=", splits));
    }
}

// Split counts changed call to call on one workspace (the merge's counters
// are shared by all of them and must be back at zero after each call):
// batch A (one 40-token sequence: 3 pages, so most of 9 or 16 splits are
// empty), batch B (three sequences, two row groups a kv head), both head
// sizes.
TEST(GpuDecodeTest, SplitCountsChangeOnOneWorkspace) {
  KVRING_REQUIRE_GPU();
  uint64_t seed = 900;
  for (int D : {64, 128})
    for (int batch = 0; batch < 2; ++batch) {
      std::mt19937_64 rng(seed++);
      const std::vector<int> toks =
          batch == 0 ? std::vector<int>{40} : std::vector<int>{1200 + (int)(rng() % 100), 40, 333};
      auto kvb =
          MakeBatch(rng, 16, 1, 2, D, /*bf16=*/seed % 2, toks, std::vector<int>(toks.size(), 3), /*gap=*/true, 0);
      std::vector<std::vector<int32_t>> qpos;
      for (const auto& sq : kvb.seqs) {
        const int last = sq.dense.positions.back();
        qpos.push_back(batch == 0 ? std::vector<int32_t>{last} : std::vector<int32_t>{last - 2, last - 1, last});
      }
      auto qb = MakeQueries(rng, 16, D, seed % 2, qpos);
      const size_t ws = cuda::DecodeWorkspaceBytes(qb.View(), 17, D);
      Dev<uint8_t> work(ws);
      work.Zero();
      for (int splits : {2, 8, 9, 16, 17, 16}) {
        Dev<float> out((size_t)qb.pos.size() * 16 * D), lse((size_t)qb.pos.size() * 16);
        out.Poison();
        lse.Poison();
        CUDA_OK(
            cuda::PagedDecode(cuda::AttnParams{}, qb.View(), kvb.View(0), {out.p, lse.p}, splits, work.p, ws, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        ExpectMatches(out.Host(), lse.Host(), qb, kvb, {}, 1e-2,
                      absl::StrCat("decode D=", D, " batch ", batch, " splits=", splits));
      }
    }
}

// kv.tables_stable: the decode kernel reads the page tables, and prefetches
// its first KV into L2, before its grid-dependency wait, while the stream's
// previous kernel may still run. Here that kernel (PackLayerPages, which lets
// a dependent launch early) writes the very pages the decode reads, into a
// buffer poisoned with NaN before each round: the decode must see the packed
// KV, never the poison. A second decode follows the first directly (the
// decode kernel lets its successor launch early too), on the same workspace.
// Pages of 16 tokens (TMA boxes, prefetched) and of 8 (cp.async gathers).
TEST(GpuDecodeTest, StableTablesOverlapTheKernelThatWritesTheKv) {
  KVRING_REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  uint64_t seed = 1100;
  for (int bt : {8, 16})
    for (int splits : {1, 9, 40}) {
      std::mt19937_64 rng(seed++);
      const int D = 128, kv_heads = 2, q_heads = 8;
      const std::vector<int> toks = {3000 + (int)(rng() % 500), 700, 1};
      auto kvb =
          MakeBatch(rng, bt, /*layers=*/2, kv_heads, D, /*bf16=*/true, toks, {0, 0, 0}, /*gap=*/false, /*layer=*/1);
      std::vector<std::vector<int32_t>> qpos;
      for (const auto& sq : kvb.seqs) qpos.push_back({sq.dense.positions.back() + 1});
      auto qb = MakeQueries(rng, q_heads, D, /*bf16=*/true, qpos);
      // The packed buffer: layer 1 of listed page i is page i there.
      const cuda::PagedKvView src = kvb.View(1);
      const int npages = static_cast<int>(kvb.page_ids.n);
      const uint64_t slice = cuda::LayerSliceBytes(src);
      Dev<uint8_t> packed(npages * slice);
      std::vector<int32_t> listed(npages);
      std::iota(listed.begin(), listed.end(), 0);
      Dev<int32_t> ids(listed);
      cuda::PagedKvView kv = src;
      kv.pool = packed.p;
      kv.page_stride = slice;
      kv.layers = 1;
      kv.layer = 0;
      kv.page_ids = ids.p;
      kv.tables_stable = true;
      const size_t ws = cuda::DecodeWorkspaceBytes(qb.View(), splits, D);
      Dev<uint8_t> work(ws);
      work.Zero();
      const size_t nrh = qb.pos.size() * q_heads;
      Dev<float> out1(nrh * D), lse1(nrh), out2(nrh * D), lse2(nrh);
      AttentionOptions o;
      o.layer = 1;
      for (int round = 0; round < 3; ++round) {
        CUDA_OK(cudaMemsetAsync(packed.p, 0xff, packed.n, stream));  // NaN until the pack writes it
        for (Dev<float>* d : {&out1, &lse1, &out2, &lse2}) CUDA_OK(cudaMemsetAsync(d->p, 0xff, d->n * 4, stream));
        CUDA_OK(cuda::PackLayerPages(src, kvb.page_ids.p, npages, packed.p, stream));
        CUDA_OK(cuda::PagedDecode({}, qb.View(), kv, {out1.p, lse1.p}, splits, work.p, ws, stream));
        CUDA_OK(cuda::PagedDecode({}, qb.View(), kv, {out2.p, lse2.p}, splits, work.p, ws, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        const std::string what = absl::StrCat("stable tables bt=", bt, " splits=", splits, " round ", round);
        ExpectMatches(out1.Host(), lse1.Host(), qb, kvb, o, 1e-2, what + ", after the pack");
        ExpectMatches(out2.Host(), lse2.Host(), qb, kvb, o, 1e-2, what + ", after a decode");
      }
    }
  cudaStreamDestroy(stream);
}

// The pages of `kvb` quantized with `enc` (QuantizeBlock) into a pool of
// 16-byte aligned pages on the device (*pool), and the view of `layer` over
// them; each sequence's reference becomes exactly the dequantized values
// (code * scale, through the CPU path's FromBlocks).
void QuantizePages(PagedBatch& kvb, const std::vector<int>& toks, KvEncoding enc, int layer, Dev<uint8_t>* pool,
                   cuda::PagedKvView* view) {
  const int bt = kvb.bt;
  const BlockLayout L{static_cast<uint32_t>(bt), static_cast<uint32_t>(kvb.layers), static_cast<uint32_t>(kvb.kv_heads),
                      static_cast<uint32_t>(kvb.D), kvb.bf16 ? DType::kBF16 : DType::kF16};
  const uint64_t stride = (EncodedBytes(L, enc) + 15) / 16 * 16;
  const size_t capacity = kvb.pool_host.size() / kvb.page_elems();
  std::vector<uint8_t> qpool(capacity * stride, 0);
  for (size_t pg = 0; pg < capacity; ++pg) {
    std::vector<uint8_t> codes;
    const auto* plain = reinterpret_cast<const uint8_t*>(kvb.pool_host.data() + pg * kvb.page_elems());
    ASSERT_TRUE(QuantizeBlock(L, absl::MakeConstSpan(plain, L.bytes()), enc, &codes).ok());
    std::memcpy(qpool.data() + pg * stride, codes.data(), codes.size());
  }
  for (size_t s = 0, at = 0; s < toks.size(); ++s) {
    const int np = (toks[s] + bt - 1) / bt;
    std::vector<int32_t> hid(np), hpos(np);
    CUDA_OK(cudaMemcpy(hid.data(), kvb.page_ids.p + at, np * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(hpos.data(), kvb.page_pos.p + at, np * 4, cudaMemcpyDeviceToHost));
    std::vector<KvBlockRef> refs;
    for (int i = 0; i < np; ++i) {
      refs.push_back(KvBlockRef{qpool.data() + (size_t)hid[i] * stride, hpos[i],
                                static_cast<uint32_t>(std::min(bt, toks[s] - i * bt))});
    }
    std::vector<uint32_t> begin{0, static_cast<uint32_t>(np)};
    kvb.seqs[s].dense = reference::FromBlocks(PagedKv{L, enc, refs, begin}, 0, static_cast<uint32_t>(layer));
    at += np;
  }
  *pool = Dev<uint8_t>(qpool);
  *view = kvb.View(layer);
  view->pool = pool->p;
  view->page_stride = stride;
  view->encoding = enc;
}

// Decode over int8 / fp8 pages (every scale mode), made by QuantizeBlock
// from random bf16/f16 blocks: both kernels (the pipelined TMA one for pages
// of a multiple of 16 tokens, the CUDA-core one otherwise) read the codes and
// must match the float64 reference over exactly the dequantized values (code
// * scale).
TEST(GpuDecodeTest, QuantizedPagesMatchTheReferenceOverTheCodes) {
  KVRING_REQUIRE_GPU();
  uint64_t seed = 500;
  // 16-token pages: the pipelined TMA kernels (on sm_90); 24: the CUDA-core
  // one. Up to 2 rows a sequence (G = 4: at most 8 vectors a kv head) take
  // the kernel of small GQA groups at head_dim <= 128, up to 4 the 16-row
  // one; the small groups' cases also run the window and non-causal masks.
  for (int bt : {16, 24})
    for (int D : {64, 128, 256})
      for (const char* name :
           {"int8/per-head", "int8/per-token", "int8/kivi", "fp8/per-head", "fp8/per-token", "fp8/kivi"})
        for (int splits : {1, 5})
          for (int max_rows : {2, 4}) {
            std::mt19937_64 rng(seed++);
            const int kv_heads = 2, q_heads = 8, layers = 2;
            const int mask = max_rows == 2 ? static_cast<int>(seed % 3) : 2;  // 0 window, 1 non-causal, 2 causal
            const bool bf16 = seed % 2;
            KvEncoding enc;
            ASSERT_TRUE(ParseKvEncoding(name, &enc).ok());
            std::vector<int> toks = {1 + (int)(rng() % 600), 40, 16 * 5};
            std::vector<int> starts = {0, 3, 64};
            // (QuantizeBlock refuses NaN: finite junk past the ends here.)
            auto kvb =
                MakeBatch(rng, bt, layers, kv_heads, D, bf16, toks, starts, /*gap=*/false, /*layer=*/1, /*junk=*/7.0);
            Dev<uint8_t> dq;
            cuda::PagedKvView view;
            ASSERT_NO_FATAL_FAILURE(QuantizePages(kvb, toks, enc, /*layer=*/1, &dq, &view));
            std::vector<std::vector<int32_t>> qpos;
            for (size_t s = 0; s < toks.size(); ++s) {
              const auto& kp = kvb.seqs[s].dense.positions;
              std::vector<int32_t> rows;
              const int nr = 1 + rng() % max_rows;
              for (int r = 0; r < nr; ++r) rows.push_back(kp.back() - (int)(rng() % 20));
              if (s == 1) rows[0] = 1;  // before every key of sequence 1
              qpos.push_back(rows);
            }
            auto qb = MakeQueries(rng, q_heads, D, bf16, qpos);
            const size_t ws = cuda::DecodeWorkspaceBytes(qb.View(), splits, D);
            Dev<uint8_t> work(ws);
            work.Zero();  // the split merge's counters start at 0
            cuda::AttnParams p;
            AttentionOptions o;
            o.layer = 1;
            if (mask < 2) SetMaskMode(mask, 50, &p, &o);
            // The pipelined kernels (pages of 16-token multiples, head_dim <= 128 on sm_90): tensor cores on 16-bit
            // operands (codes are exact in 16 bits, P and per-channel-scaled K or Q are rounded). The CUDA-core
            // kernel: fp32 arithmetic over exact code * scale values.
            const bool pipelined = bt % 16 == 0 && D <= 128 && Sm90();
            const double tol = pipelined ? (bf16 ? 1e-2 : 3e-3) : 1e-4;
            const bool small_fits = qb.View().max_rows_per_seq * (q_heads / kv_heads) <= 8;
            using K = cuda::QuantDecodeKernel;
            for (K kernel : {K::kAuto, K::kSixteenRows, K::kSmallGroups}) {
              const std::string what =
                  absl::StrCat("quantized decode ", name, " bt=", bt, " D=", D, " splits=", splits,
                               " max_rows=", max_rows, " mask=", mask, " kernel=", static_cast<int>(kernel));
              Dev<float> out((size_t)qb.pos.size() * q_heads * D), lse((size_t)qb.pos.size() * q_heads);
              out.Poison();
              lse.Poison();
              const cudaError_t e =
                  cuda::PagedDecode(p, qb.View(), view, {out.p, lse.p}, splits, work.p, ws, nullptr, kernel);
              if (kernel != K::kAuto && (!pipelined || (kernel == K::kSmallGroups && !small_fits))) {
                EXPECT_EQ(e, cudaErrorNotSupported) << what;  // a kernel that cannot serve the view says so
                continue;
              }
              CUDA_OK(e);
              CUDA_OK(cudaDeviceSynchronize());
              ExpectMatches(out.Host(), lse.Host(), qb, kvb, o, tol, what);
            }
          }
}

TEST(GpuDecodeTest, SlidingWindowAndNonCausal) {
  KVRING_REQUIRE_GPU();
  std::mt19937_64 rng(77);
  auto kvb = MakeBatch(rng, 16, 1, 8, 128, true, {1000, 300}, {0, 0}, false, 0);
  auto qb = MakeQueries(rng, 32, 128, true, {{999}, {500, 250}});
  for (int mode = 0; mode < 2; ++mode) {
    Dev<float> out((size_t)3 * 32 * 128), lse(3 * 32);
    out.Poison();
    lse.Poison();
    cuda::AttnParams p;
    AttentionOptions o;
    SetMaskMode(mode, 100, &p, &o);
    const size_t ws = cuda::DecodeWorkspaceBytes(qb.View(), 5, 128);
    Dev<uint8_t> work(ws);
    work.Zero();  // the split merge's counters start at 0
    CUDA_OK(cuda::PagedDecode(p, qb.View(), kvb.View(0), {out.p, lse.p}, 5, work.p, ws, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    ExpectMatches(out.Host(), lse.Host(), qb, kvb, o, 1e-2, mode == 0 ? "window" : "non-causal");
  }
}

// The split merge's limits: at most kMaxDecodeSplits splits (its weights live
// in shared memory), and a 16-byte aligned output and workspace when splits
// are merged; one split takes any output alignment.
TEST(GpuDecodeTest, SplitLimitsAreCheckedAtTheBoundary) {
  KVRING_REQUIRE_GPU();
  std::mt19937_64 rng(91);
  auto kvb = MakeBatch(rng, 16, 1, 8, 128, true, {300}, {0}, false, 0);
  auto qb = MakeQueries(rng, 32, 128, true, {{299}});
  Dev<float> out(32 * 128 + 4), lse(32);
  const size_t ws = cuda::DecodeWorkspaceBytes(qb.View(), cuda::kMaxDecodeSplits + 1, 128);
  Dev<uint8_t> work(ws);
  work.Zero();
  const cuda::AttnParams p;
  EXPECT_EQ(
      cuda::PagedDecode(p, qb.View(), kvb.View(0), {out.p, lse.p}, cuda::kMaxDecodeSplits + 1, work.p, ws, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(cuda::PagedDecode(p, qb.View(), kvb.View(0), {out.p + 1, lse.p}, 3, work.p, ws, nullptr),
            cudaErrorInvalidValue);
  // The merge's bulk copies need a 16-byte aligned workspace.
  EXPECT_EQ(cuda::PagedDecode(p, qb.View(), kvb.View(0), {out.p, lse.p}, 3, work.p + 4, ws - 4, nullptr),
            cudaErrorInvalidValue);
  out.Poison();
  CUDA_OK(cuda::PagedDecode(p, qb.View(), kvb.View(0), {out.p + 1, lse.p}, 1, nullptr, 0, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> o = out.Host();
  o.erase(o.begin());
  o.resize(32 * 128);
  ExpectMatches(o, lse.Host(), qb, kvb, {}, 1e-2, "one split, unaligned output");
}

// Both prefill kernels: the wgmma one where the device has it (sm_90), and
// the mma.sync one everywhere.
std::vector<cuda::PrefillKernel> PrefillKernels() {
  std::vector<cuda::PrefillKernel> ks = {cuda::PrefillKernel::kMmaSync};
  if (Sm90()) ks.push_back(cuda::PrefillKernel::kWgmma);
  return ks;
}
const char* KernelName(cuda::PrefillKernel k) {
  return k == cuda::PrefillKernel::kWgmma ? "wgmma" : k == cuda::PrefillKernel::kAuto ? "auto" : "mma.sync";
}

// The query rows of the prefill tests' two sequences (the second starting
// at position 40): sequence 0's last 200 tokens as a chunk (a prefix hit
// before them); sequence 1's every key position, plus rows that see nothing
// (before position 40).
std::vector<std::vector<int32_t>> PrefillRows(const PagedBatch& kvb) {
  std::vector<std::vector<int32_t>> qpos(2);
  const auto& kp0 = kvb.seqs[0].dense.positions;
  for (size_t i = kp0.size() - 200; i < kp0.size(); ++i) qpos[0].push_back(kp0[i]);
  for (int32_t x : kvb.seqs[1].dense.positions) qpos[1].push_back(x);
  qpos[1].push_back(3);
  qpos[1].push_back(39);
  return qpos;
}

// Prefill: causal chunks of new tokens over a cached prefix, row counts that
// are not multiples of the 128-row tile, sharded (gapped) page lists.
TEST(GpuPrefillTest, MatchesReferenceAcrossShapes) {
  KVRING_REQUIRE_GPU();
  uint64_t seed = 100;
  for (cuda::PrefillKernel kernel : PrefillKernels())
    for (int D : {64, 128, 256})
      for (int ratio : {1, 4})
        for (int bt : {16, 64})
          for (bool gap : {false, true}) {
            std::mt19937_64 rng(seed++);
            const int kv_heads = 2, q_heads = kv_heads * ratio;
            const bool bf16 = seed % 2;
            std::vector<int> toks = {300 + (int)(rng() % 200), 129};
            auto kvb = MakeBatch(rng, bt, 1, kv_heads, D, bf16, toks, {0, 40}, gap, 0);
            auto qb = MakeQueries(rng, q_heads, D, bf16, PrefillRows(kvb));
            cuda::PrefillKernel run = kernel;
            if (D == 256 && kernel == cuda::PrefillKernel::kWgmma) {  // kAuto serves it with the mma.sync kernel
              Dev<float> out((size_t)qb.pos.size() * q_heads * D), lse((size_t)qb.pos.size() * q_heads);
              EXPECT_EQ(cuda::PagedPrefill({}, qb.View(), kvb.View(0), {out.p, lse.p}, nullptr, kernel),
                        cudaErrorNotSupported);
              (void)cudaGetLastError();
              run = cuda::PrefillKernel::kAuto;
            }
            // P is rounded to 16 bits for the second matmul: tolerance of bf16 operands.
            ASSERT_NO_FATAL_FAILURE(ExpectPrefillMatches(
                {}, {}, qb, kvb, run, bf16 ? 1e-2 : 3e-3,
                absl::StrCat("prefill ", KernelName(run), " D=", D, " ratio=", ratio, " bt=", bt, " gap=", gap)));
          }
}

// Prefill over int8 / fp8 pages, every scale mode: causal chunks over a
// cached prefix, rows that see nothing, several row tiles, pages of 16 and
// of 24 tokens (the mma.sync kernel reads any page size), GQA 1 and 4,
// against the float64 reference over exactly the dequantized values; kWgmma
// refuses quantized pages and kAuto serves them.
TEST(GpuPrefillTest, QuantizedPagesMatchTheReferenceOverTheCodes) {
  KVRING_REQUIRE_GPU();
  uint64_t seed = 900;
  for (int bt : {16, 24})
    for (int D : {64, 128, 256})
      for (const char* name :
           {"int8/per-head", "int8/per-token", "int8/kivi", "fp8/per-head", "fp8/per-token", "fp8/kivi"}) {
        std::mt19937_64 rng(seed++);
        const int kv_heads = 2, q_heads = kv_heads * (seed % 2 ? 4 : 1), layers = 2;
        const bool bf16 = (seed / 2) % 2;
        KvEncoding enc;
        ASSERT_TRUE(ParseKvEncoding(name, &enc).ok());
        std::vector<int> toks = {300 + (int)(rng() % 200), 129};
        auto kvb = MakeBatch(rng, bt, layers, kv_heads, D, bf16, toks, {0, 40}, /*gap=*/false, /*layer=*/1,
                             /*junk=*/7.0);
        Dev<uint8_t> dq;
        cuda::PagedKvView view;
        ASSERT_NO_FATAL_FAILURE(QuantizePages(kvb, toks, enc, /*layer=*/1, &dq, &view));
        auto qb = MakeQueries(rng, q_heads, D, bf16, PrefillRows(kvb));
        const std::string what = absl::StrCat("quantized prefill ", name, " bt=", bt, " D=", D, " G=", q_heads / 2);
        Dev<float> out((size_t)qb.pos.size() * q_heads * D), lse((size_t)qb.pos.size() * q_heads);
        EXPECT_EQ(cuda::PagedPrefill({}, qb.View(), view, {out.p, lse.p}, nullptr, cuda::PrefillKernel::kWgmma),
                  cudaErrorNotSupported)
            << what;
        (void)cudaGetLastError();
        out.Poison();
        lse.Poison();
        CUDA_OK(cuda::PagedPrefill({}, qb.View(), view, {out.p, lse.p}, nullptr, cuda::PrefillKernel::kAuto));
        CUDA_OK(cudaDeviceSynchronize());
        AttentionOptions o;
        o.layer = 1;
        // The dequantized values and P are rounded to 16 bits for the MMAs.
        ExpectMatches(out.Host(), lse.Host(), qb, kvb, o, bf16 ? 1e-2 : 3e-3, what);
        // Through the 16-bit kernels: the codes dequantized into a workspace
        // (too small a one is refused), then kAuto (wgmma where it serves).
        const int listed = static_cast<int>(kvb.page_ids.n);
        const size_t wsb = cuda::DequantizedPrefillWorkspaceBytes(view, listed);
        Dev<uint8_t> ws(wsb);
        EXPECT_EQ(cuda::PagedPrefillDequantized({}, qb.View(), view, listed, ws.p, wsb - 1, {out.p, lse.p}, nullptr),
                  cudaErrorInvalidValue);
        out.Poison();
        lse.Poison();
        CUDA_OK(cuda::PagedPrefillDequantized({}, qb.View(), view, listed, ws.p, wsb, {out.p, lse.p}, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        ExpectMatches(out.Host(), lse.Host(), qb, kvb, o, bf16 ? 1e-2 : 3e-3, what + " (dequantized)");
      }
}

// Long chunks: many 128-row tiles and KV streams that go round the wgmma
// kernel's stage ring many times (its barrier phases flip), page sizes that
// are not a power of two (48: TMA boxes at offsets inside a page; 24: not a
// multiple of 16, where kAuto must fall back to the mma.sync kernel, as it
// must at head_dim 256), several sequences of different lengths.
TEST(GpuPrefillTest, LongChunksMatchTheReference) {
  KVRING_REQUIRE_GPU();
  uint64_t seed = 300;
  for (cuda::PrefillKernel requested : PrefillKernels())
    for (int D : {64, 128, 256})
      for (int bt : {16, 24, 48}) {
        const cuda::PrefillKernel kernel = requested == cuda::PrefillKernel::kWgmma && (bt % 16 != 0 || D == 256)
                                               ? cuda::PrefillKernel::kAuto
                                               : requested;
        std::mt19937_64 rng(seed++);
        const int kv_heads = 2, q_heads = 8;
        const bool bf16 = seed % 2;
        std::vector<int> toks = {1500 + (int)(rng() % 600), 700};
        auto kvb = MakeBatch(rng, bt, 1, kv_heads, D, bf16, toks, {0, 0}, false, 0);
        std::vector<std::vector<int32_t>> qpos(2);
        const auto& kp0 = kvb.seqs[0].dense.positions;
        for (size_t i = kp0.size() - 600; i < kp0.size(); ++i) qpos[0].push_back(kp0[i]);  // a chunk after a prefix hit
        for (int32_t x : kvb.seqs[1].dense.positions) qpos[1].push_back(x);                // a whole prompt
        auto qb = MakeQueries(rng, q_heads, D, bf16, qpos);
        ASSERT_NO_FATAL_FAILURE(
            ExpectPrefillMatches({}, {}, qb, kvb, kernel, bf16 ? 1e-2 : 3e-3,
                                 absl::StrCat("long prefill ", KernelName(kernel), " D=", D, " bt=", bt)));
      }
}

// More row tiles than SMs (the wgmma kernel's persistent CTAs take four or
// five each, its producer streams one row tile's KV after another through the
// ring, and its metadata and Q double as the next tile's): sequences of
// different lengths (row tiles past a short sequence's end are skipped),
// 128-row tiles whose rows all come before every key (no key: zeros and
// -inf, and no KV tile in the ring), GQA 4, both head sizes.
TEST(GpuPrefillTest, ManyRowTilesPerCta) {
  KVRING_REQUIRE_GPU();
  uint64_t seed = 700;
  for (int D : {128, 64}) {
    std::mt19937_64 rng(seed++);
    const int kv_heads = 4, q_heads = 16;
    const bool bf16 = D == 128;
    std::vector<int> toks = {1500, 500, 40};
    auto kvb = MakeBatch(rng, 64, 1, kv_heads, D, bf16, toks, {0, 1000, 0}, false, 0);
    std::vector<std::vector<int32_t>> qpos(3);
    for (int32_t x : kvb.seqs[0].dense.positions) qpos[0].push_back(x);  // a whole prompt: 12 row tiles
    for (int i = 0; i < 300; ++i) qpos[1].push_back(i);                  // before position 1000: sees nothing
    for (int32_t x : kvb.seqs[1].dense.positions) qpos[1].push_back(x);
    for (int32_t x : kvb.seqs[2].dense.positions) qpos[2].push_back(x);
    auto qb = MakeQueries(rng, q_heads, D, bf16, qpos);
    for (cuda::PrefillKernel kernel : PrefillKernels()) {
      ASSERT_NO_FATAL_FAILURE(ExpectPrefillMatches({}, {}, qb, kvb, kernel, bf16 ? 1e-2 : 3e-3,
                                                   absl::StrCat(KernelName(kernel), " many row tiles D=", D)));
    }
  }
}

TEST(GpuPrefillTest, SlidingWindowAndNonCausal) {
  KVRING_REQUIRE_GPU();
  std::mt19937_64 rng(5);
  auto kvb = MakeBatch(rng, 16, 1, 8, 128, true, {700}, {0}, false, 0);
  std::vector<int32_t> rows;
  for (int i = 0; i < 700; i += 3) rows.push_back(i);
  auto qb = MakeQueries(rng, 32, 128, true, {rows});
  for (cuda::PrefillKernel kernel : PrefillKernels())
    for (int mode = 0; mode < 2; ++mode) {
      cuda::AttnParams p;
      AttentionOptions o;
      SetMaskMode(mode, 150, &p, &o);
      ASSERT_NO_FATAL_FAILURE(ExpectPrefillMatches(
          p, o, qb, kvb, kernel, 1e-2,
          absl::StrCat(KernelName(kernel), mode == 0 ? " prefill window" : " prefill non-causal")));
    }
}

TEST(GpuMergeTest, MatchesCpuMerge) {
  KVRING_REQUIRE_GPU();
  std::mt19937_64 rng(9);
  std::normal_distribution<float> nd;
  const int P = 5, RH = 77, D = 128;
  std::vector<float> outs((size_t)P * RH * D), lses((size_t)P * RH);
  for (auto& x : outs) x = nd(rng);
  for (size_t i = 0; i < lses.size(); ++i) lses[i] = (i % 7 == 0) ? -INFINITY : nd(rng) * 5;
  for (int r = 0; r < RH; r += 11) {
    for (int s = 0; s < P; ++s) lses[(size_t)s * RH + r] = -INFINITY;  // rows no partial saw anything for
  }
  Dev<float> dout(outs), dlse(lses), mo((size_t)RH * D), ml(RH);
  mo.Poison();
  ml.Poison();
  CUDA_OK(cuda::MergePartials(dout.p, dlse.p, P, RH, D, {mo.p, ml.p}, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<ConstPartial> parts;
  for (int s = 0; s < P; ++s) parts.push_back({outs.data() + (size_t)s * RH * D, lses.data() + (size_t)s * RH});
  PartialResult ref(RH, 1, D);
  ASSERT_TRUE(MergePartials(parts, RH, 1, D, ref.view()).ok());
  auto go = mo.Host(), gl = ml.Host();
  for (size_t i = 0; i < go.size(); ++i) ASSERT_NEAR(go[i], ref.out[i], 1e-5 + 1e-5 * std::abs(ref.out[i])) << i;
  for (int r = 0; r < RH; ++r) {
    if (std::isinf(ref.lse[r])) {
      EXPECT_TRUE(std::isinf(gl[r]) && gl[r] < 0);
    } else {
      EXPECT_NEAR(gl[r], ref.lse[r], 1e-5 * std::max(1.f, std::abs(ref.lse[r])));
    }
  }
}

// MergeRows with its indexes in the launch's parameters equals MergeRows
// over device arrays (the same kernel body, to rounding); the cast output
// is the float32 output rounded (bf16 and f16); no indexes with init
// clears, without it casts the output as it is; bad arguments are refused.
TEST(GpuMergeTest, RowsMergedFromTheLaunchsParametersAndCastToTheModelsDtype) {
  KVRING_REQUIRE_GPU();
  std::mt19937_64 rng(19);
  std::normal_distribution<float> nd;
  const int rows = 37, H = 4, D = 128, parts = 90;
  std::vector<float> po((size_t)parts * H * D), pl((size_t)parts * H), acc((size_t)rows * H * D), al((size_t)rows * H);
  for (auto& x : po) x = nd(rng);
  for (size_t i = 0; i < pl.size(); ++i) pl[i] = i % 9 == 0 ? -INFINITY : nd(rng) * 4;
  for (auto& x : acc) x = nd(rng);
  for (auto& x : al) x = nd(rng);
  std::vector<int32_t> csr(rows + 1, 0);  // begin[rows + 1], then contrib
  std::uniform_int_distribution<int> pick(0, parts - 1), count(0, 4);
  std::vector<int32_t> contrib;
  for (int r = 0; r < rows; ++r) {
    const int n = r % 6 == 0 ? 0 : count(rng);  // some rows with no contribution
    for (int i = 0; i < n; ++i) contrib.push_back(pick(rng));
    csr[r + 1] = static_cast<int32_t>(contrib.size());
  }
  std::vector<int32_t> all = csr;
  all.insert(all.end(), contrib.begin(), contrib.end());
  ASSERT_LE(all.size(), (size_t)cuda::kInlineCsrEntries);
  Dev<float> dpo(po), dpl(pl);
  Dev<int32_t> dall(all);
  for (bool init : {false, true}) {
    Dev<float> o1(acc), l1(al), o2(acc), l2(al);
    Dev<uint16_t> bf((size_t)rows * H * D), hf((size_t)rows * H * D);
    bf.Poison();
    hf.Poison();
    CUDA_OK(cuda::MergeRows({o1.p, l1.p}, rows, dpo.p, dpl.p, dall.p, dall.p + rows + 1, H, D, init, nullptr,
                            cuda::CastOutput{bf.p, cuda::CastOutput::kBf16}));
    CUDA_OK(cuda::MergeRowsInline({o2.p, l2.p}, rows, dpo.p, dpl.p, all.data(), (int)all.size(), H, D, init, nullptr,
                                  cuda::CastOutput{hf.p, cuda::CastOutput::kF16}));
    CUDA_OK(cudaDeviceSynchronize());
    auto a1 = o1.Host(), a2 = o2.Host(), b1 = l1.Host(), b2 = l2.Host();
    auto cb = bf.Host(), ch = hf.Host();
    for (size_t i = 0; i < a1.size(); ++i) {
      ASSERT_NEAR(a1[i], a2[i], 1e-6f * (1.f + std::abs(a1[i]))) << "init " << init << " O " << i;
      ASSERT_EQ(cb[i], FloatToBf16(a1[i])) << "bf16 " << i;
      ASSERT_EQ(ch[i], FloatToF16(a2[i])) << "f16 " << i;
    }
    for (size_t i = 0; i < b1.size(); ++i) {
      if (std::isinf(b1[i])) {
        ASSERT_EQ(b1[i], b2[i]) << "LSE " << i;
      } else {
        ASSERT_NEAR(b1[i], b2[i], 1e-6f * (1.f + std::abs(b1[i]))) << "LSE " << i;
      }
    }
    // Rows with no contribution: left as they were without init, (0, -inf) with it.
    for (int r = 0; r < rows; r += 6) {
      for (int h = 0; h < H; ++h) {
        const size_t rh = (size_t)r * H + h;
        EXPECT_EQ(b1[rh], init ? -INFINITY : al[rh]) << r;
        EXPECT_EQ(a1[rh * D + 5], init ? 0.f : acc[rh * D + 5]) << r;
      }
    }
  }
  // No indexes: with init, O = 0 and LSE = -inf; without, O cast as it is.
  Dev<float> o(acc), l(al);
  Dev<uint16_t> c((size_t)rows * H * D);
  CUDA_OK(cuda::MergeRowsInline({o.p, l.p}, rows, nullptr, nullptr, nullptr, 0, H, D, /*init=*/false, nullptr,
                                cuda::CastOutput{c.p, cuda::CastOutput::kBf16}));
  CUDA_OK(cudaDeviceSynchronize());
  auto co = c.Host();
  auto oo = o.Host();
  for (size_t i = 0; i < acc.size(); ++i) ASSERT_EQ(co[i], FloatToBf16(acc[i])) << i;
  EXPECT_EQ(oo, acc);
  CUDA_OK(cuda::MergeRowsInline({o.p, l.p}, rows, nullptr, nullptr, nullptr, 0, H, D, /*init=*/true, nullptr, {}));
  CUDA_OK(cudaDeviceSynchronize());
  for (float x : o.Host()) ASSERT_EQ(x, 0.f);
  for (float x : l.Host()) ASSERT_TRUE(std::isinf(x) && x < 0);
  // Refused: more indexes than a launch carries, fewer than rows + 1, a cast without its buffer.
  std::vector<int32_t> big(cuda::kInlineCsrEntries + 1, 0);
  EXPECT_EQ(cuda::MergeRowsInline({o.p, l.p}, rows, dpo.p, dpl.p, big.data(), (int)big.size(), H, D, true, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::MergeRowsInline({o.p, l.p}, rows, dpo.p, dpl.p, all.data(), rows, H, D, true, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::MergeRowsInline({o.p, l.p}, rows, dpo.p, dpl.p, all.data(), (int)all.size(), H, D, true, nullptr,
                                  cuda::CastOutput{nullptr, cuda::CastOutput::kBf16}),
            cudaErrorInvalidValue);
}

// CopyRuns copies every run, 16-byte aligned or not, over several launches
// (more runs than one launch carries), and writes nothing outside them.
TEST(GpuCopyTest, CopyRunsCopiesEveryRunAndNothingElse) {
  KVRING_REQUIRE_GPU();
  std::mt19937_64 rng(23);
  const size_t n = 8 << 20;
  std::vector<uint8_t> src(n);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  Dev<uint8_t> ds(src), dd(n);
  CUDA_OK(cudaMemset(dd.p, 0xab, n));
  std::vector<cuda::CopyRun> runs;
  std::vector<uint8_t> want(n, 0xab);
  size_t at = 0;
  std::uniform_int_distribution<int> len(0, 3000);
  for (int i = 0; at < n / 2 && i < 2 * cuda::kCopyRunsPerLaunch + 7; ++i) {
    // aligned runs, odd lengths, odd offsets, an empty one, one large run
    size_t bytes = i == 3 ? 0 : i == 11 ? (1 << 20) + 48 : (size_t)len(rng) * (i % 3 == 0 ? 16 : 1);
    const size_t soff = (i % 5 == 0 ? 1 : 0) + ((rng() % (n / 2)) & ~size_t{15});
    const size_t doff = at + (i % 4 == 1 ? 3 : 0);
    bytes = std::min(bytes, std::min(n - soff, n - doff));
    runs.push_back(cuda::CopyRun{dd.p + doff, ds.p + soff, bytes});
    std::copy(src.begin() + soff, src.begin() + soff + bytes, want.begin() + doff);
    at = doff + bytes + 32;
  }
  ASSERT_GT(runs.size(), (size_t)cuda::kCopyRunsPerLaunch);
  CUDA_OK(cuda::CopyRuns(runs.data(), (int)runs.size(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(dd.Host() == want);
  EXPECT_EQ(cuda::CopyRuns(nullptr, 2, nullptr), cudaErrorInvalidValue);
  cuda::CopyRun bad{nullptr, ds.p, 16};
  EXPECT_EQ(cuda::CopyRuns(&bad, 1, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::CopyRuns(nullptr, 0, nullptr), cudaSuccess);
}

// The GPU rings on N ranks sharing this GPU (device loopback) equal one GPU
// attending over everything; the load-balanced causal layout.
TEST(GpuRingTest, PassKvAndPassQOnSeveralRanksEqualOneGpu) {
  KVRING_REQUIRE_GPU();
  for (int n : {1, 2, 3, 4}) {
    std::mt19937_64 rng(200 + n);
    const int bt = 16, D = 128, kv_heads = 8, q_heads = 32;
    const int chunk_blocks = 3, nblocks = 2 * n * chunk_blocks;
    auto whole = MakeBatch(rng, bt, 1, kv_heads, D, true, {nblocks * bt}, {0}, false, 0);
    // Every rank gets chunks i and 2N-1-i of the pages, and the queries of those tokens.
    std::vector<std::vector<int32_t>> ids_h(n), pos_h(n), qrows(n);
    auto ids_all = whole.page_ids.Host();
    auto pos_all = whole.page_pos.Host();
    for (int b = 0; b < nblocks; ++b) {
      const int c = b / chunk_blocks;
      const int owner = c < n ? c : 2 * n - 1 - c;
      ids_h[owner].push_back(ids_all[b]);
      pos_h[owner].push_back(pos_all[b]);
      for (int t = 0; t < bt; ++t) qrows[owner].push_back(pos_all[b] + t);
    }
    auto all_q = MakeQueries(rng, q_heads, D, true, {[&] {
                               std::vector<int32_t> v;
                               for (int r = 0; r < n; ++r) v.insert(v.end(), qrows[r].begin(), qrows[r].end());
                               return v;
                             }()});
    // Reference: one GPU, all queries over all pages.
    Dev<float> ref_out((size_t)all_q.pos.size() * q_heads * D), ref_lse(all_q.pos.size() * q_heads);
    ASSERT_TRUE(cuda::AttendLocal({}, all_q.View(), whole.View(0), {ref_out.p, ref_lse.p}, nblocks, nullptr).ok());
    CUDA_OK(cudaDeviceSynchronize());
    auto ro = ref_out.Host(), rl = ref_lse.Host();
    for (int algo = 0; algo < 2; ++algo) {
      auto group = DeviceLoopbackTransport::CreateGroup(n, 0);
      std::vector<absl::Status> st(n);
      std::vector<std::vector<float>> got_o(n), got_l(n);
      std::vector<std::thread> ts;
      for (int r = 0; r < n; ++r) {
        ts.emplace_back([&, r] {
          cudaSetDevice(0);
          // This rank's view: its pages of the shared pool, its queries.
          Dev<int32_t> ids(ids_h[r]), pos(pos_h[r]), begin(std::vector<int32_t>{0, (int32_t)ids_h[r].size()}),
              ntok(std::vector<int32_t>{(int32_t)ids_h[r].size() * bt});
          cuda::PagedKvView kv = whole.View(0);
          kv.page_ids = ids.p;
          kv.page_pos = pos.p;
          kv.seq_page_begin = begin.p;
          kv.seq_tokens = ntok.p;
          size_t off = 0;
          for (int k = 0; k < r; ++k) off += qrows[k].size();
          Dev<int32_t> qpos(qrows[r]), qbeg(std::vector<int32_t>{0, (int32_t)qrows[r].size()});
          cuda::QueryView q;
          q.q = all_q.q.p + off * q_heads * D;
          q.positions = qpos.p;
          q.seq_row_begin = qbeg.p;
          q.num_rows = (int)qrows[r].size();
          q.q_heads = q_heads;
          q.max_rows_per_seq = q.num_rows;
          Dev<float> o((size_t)q.num_rows * q_heads * D), l((size_t)q.num_rows * q_heads);
          o.Poison();
          l.Poison();
          cudaStream_t s;
          cudaStreamCreate(&s);
          cuda::GpuRingOptions ro_opts;
          ro_opts.stream = s;
          ro_opts.timeout = absl::Seconds(60);
          st[r] = algo == 0 ? cuda::GpuRingPassKv(*group[r], {}, q, kv, {o.p, l.p}, ro_opts)
                            : cuda::GpuRingPassQ(*group[r], {}, q, kv, {o.p, l.p}, ro_opts);
          cudaStreamSynchronize(s);
          cudaStreamDestroy(s);
          got_o[r] = o.Host();
          got_l[r] = l.Host();
        });
      }
      for (auto& t : ts) t.join();
      size_t off = 0;
      for (int r = 0; r < n; ++r) {
        ASSERT_TRUE(st[r].ok()) << "algo " << algo << " n=" << n << " rank " << r << ": " << st[r];
        double num = 0, den = 0;
        for (size_t i = 0; i < got_o[r].size(); ++i) {
          ASSERT_FALSE(std::isnan(got_o[r][i]));
          const double d = got_o[r][i] - ro[off * q_heads * D + i];
          num += d * d;
          den += ro[off * q_heads * D + i] * ro[off * q_heads * D + i];
        }
        EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 1e-2)
            << (algo ? "pass-Q" : "pass-KV") << " n=" << n << " rank " << r;
        for (size_t i = 0; i < got_l[r].size(); ++i) {
          EXPECT_NEAR(got_l[r][i], rl[off * q_heads + i], 2e-2 * std::max(1.f, std::abs(rl[off * q_heads + i])));
        }
        off += qrows[r].size();
      }
    }
  }
}

// NCCL with one rank: the same ring code over a real communicator.
TEST(GpuRingTest, NcclTransportWorldSizeOne) {
  KVRING_REQUIRE_GPU();
  auto id = NcclTransport::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  auto t = NcclTransport::Create(0, 1, *id, 0);
  ASSERT_TRUE(t.ok()) << t.status();
  std::mt19937_64 rng(3);
  auto kvb = MakeBatch(rng, 16, 1, 8, 128, true, {512}, {0}, false, 0);
  std::vector<int32_t> rows;
  for (int i = 0; i < 512; i += 2) rows.push_back(i);
  auto qb = MakeQueries(rng, 32, 128, true, {rows});
  Dev<float> o((size_t)rows.size() * 32 * 128), l(rows.size() * 32);
  o.Poison();
  l.Poison();
  cuda::GpuRingOptions ro;
  ASSERT_TRUE(cuda::GpuRingPassKv(**t, {}, qb.View(), kvb.View(0), {o.p, l.p}, ro).ok());
  CUDA_OK(cudaDeviceSynchronize());
  ExpectMatches(o.Host(), l.Host(), qb, kvb, {}, 1e-2, "nccl n=1");
}

}  // namespace
}  // namespace kvring
