#include "kvring/attention/partial_attention.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "attention_test_util.h"
#include "gtest/gtest.h"
#include "kvring/cache/quantize.h"
#include "kvring/layout/fp8.h"

namespace kvring {
namespace {

using testing::DenseOf;
using testing::ExpectClose;
using testing::Poison;
using testing::RandomQueries;
using testing::RandomSequence;

constexpr double kTol = 2e-5;  // fp32 accumulation over exactly-represented inputs

struct Case {
  DType dtype;
  uint32_t ratio, head_dim, block_tokens;
  bool causal;
  int64_t window;
};

void RunCase(const Case& c, uint64_t seed, ThreadPool* pool) {
  std::mt19937_64 rng(seed);
  const uint32_t kv_heads = 2, q_heads = kv_heads * c.ratio;
  const BlockLayout layout{c.block_tokens, 2, kv_heads, c.head_dim, c.dtype};
  const int64_t start = 40;  // keys at [40, 40 + tokens): queries before 40 see nothing when causal
  const int64_t tokens = 1 + static_cast<int64_t>(rng() % 300);
  auto seq = RandomSequence(layout, tokens, rng, start);
  std::shuffle(seq.refs.begin(), seq.refs.end(), rng);  // any block order
  const uint32_t rows = 1 + rng() % 9;
  std::vector<int64_t> pos(rows);
  for (auto& p : pos) p = static_cast<int64_t>(rng() % (start + tokens + 8));
  pos[0] = 3;  // always one query that precedes every key
  auto q = RandomQueries(c.dtype, rows, q_heads, c.head_dim, pos, rng);
  std::vector<uint32_t> begin{0, static_cast<uint32_t>(seq.refs.size())};
  PagedKv kv{layout, {}, seq.refs, begin};
  AttentionOptions o;
  o.layer = 1;
  o.causal = c.causal;
  o.window = c.window;
  PartialResult got(rows, q_heads, c.head_dim);
  Poison(got);
  ASSERT_TRUE(PartialAttention(o, q.view, kv, got.view(), pool).ok());
  auto ref = reference::Attention(q.values, q.positions, q_heads, DenseOf(layout, seq.refs, 1), o);
  ExpectClose(got.out.data(), got.lse.data(), ref, kTol,
              absl::StrCat(DTypeName(c.dtype), " ratio ", c.ratio, " D ", c.head_dim, " bt ", c.block_tokens,
                           " causal ", c.causal, " window ", c.window, " seed ", seed));
}

TEST(PartialAttentionTest, MatchesFloat64ReferenceAcrossShapesAndDtypes) {
  ThreadPool pool(2);
  uint64_t seed = 1;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (uint32_t ratio : {1u, 4u, 8u})
      for (uint32_t d : {64u, 128u})
        for (uint32_t bt : {16u, 64u})
          for (bool causal : {false, true}) RunCase({dt, ratio, d, bt, causal, 0}, seed++, &pool);
}

TEST(PartialAttentionTest, SlidingWindowSeesOnlyRecentKeys) {
  for (int64_t w : {1, 7, 16, 100}) {
    for (uint64_t seed = 0; seed < 3; ++seed) RunCase({DType::kBF16, 4, 64, 16, true, w}, 100 + seed, nullptr);
  }
}

TEST(PartialAttentionTest, RowsThatSeeNoKeyAreZeroWithMinusInfLse) {
  std::mt19937_64 rng(5);
  const BlockLayout layout{16, 1, 1, 64, DType::kF32};
  auto seq = RandomSequence(layout, 32, rng, /*start=*/100);
  std::vector<uint32_t> begin{0, 2};
  PagedKv kv{layout, {}, seq.refs, begin};
  auto q = RandomQueries(DType::kF32, 2, 2, 64, {5, 99}, rng);
  PartialResult got(2, 2, 64);
  Poison(got);
  ASSERT_TRUE(PartialAttention({}, q.view, kv, got.view()).ok());
  for (float v : got.out) EXPECT_EQ(v, 0.0f);
  for (float l : got.lse) EXPECT_TRUE(std::isinf(l) && l < 0);
  // And with no blocks at all.
  std::vector<uint32_t> none{0, 0};
  PagedKv empty{layout, {}, {}, none};
  Poison(got);
  ASSERT_TRUE(PartialAttention({}, q.view, empty, got.view()).ok());
  for (float l : got.lse) EXPECT_TRUE(std::isinf(l) && l < 0);
}

TEST(PartialAttentionTest, BatchOfSequencesEachRowSeesItsOwnSequence) {
  std::mt19937_64 rng(9);
  const BlockLayout layout{16, 1, 8, 128, DType::kBF16};
  const uint32_t q_heads = 32, nseq = 5;
  std::vector<testing::SeqKv> seqs;
  std::vector<KvBlockRef> refs;
  std::vector<uint32_t> begin{0};
  std::vector<int64_t> pos;
  std::vector<uint32_t> ids;
  for (uint32_t s = 0; s < nseq; ++s) {
    seqs.push_back(RandomSequence(layout, 20 + 37 * s, rng));
    refs.insert(refs.end(), seqs.back().refs.begin(), seqs.back().refs.end());
    begin.push_back(static_cast<uint32_t>(refs.size()));
    for (uint32_t r = 0; r <= s % 3; ++r) {  // 1..3 query tokens per sequence
      pos.push_back(seqs.back().num_tokens - 1 - r);
      ids.push_back(s);
    }
  }
  const uint32_t rows = static_cast<uint32_t>(pos.size());
  auto q = RandomQueries(DType::kBF16, rows, q_heads, 128, pos, rng, ids);
  PagedKv kv{layout, {}, refs, begin};
  PartialResult got(rows, q_heads, 128);
  Poison(got);
  ThreadPool pool(2);
  ASSERT_TRUE(PartialAttention({}, q.view, kv, got.view(), &pool).ok());
  for (uint32_t s = 0; s < nseq; ++s) {
    std::vector<uint32_t> mine;
    for (uint32_t r = 0; r < rows; ++r)
      if (ids[r] == s) mine.push_back(r);
    std::vector<int64_t> mpos;
    for (uint32_t r : mine) mpos.push_back(pos[r]);
    auto ref = reference::Attention(testing::RowsOf(q, mine, q_heads, 128), mpos, q_heads,
                                    DenseOf(layout, seqs[s].refs, 0), {});
    PartialResult sub(static_cast<uint32_t>(mine.size()), q_heads, 128);
    for (size_t i = 0; i < mine.size(); ++i) {
      std::copy_n(got.out.begin() + size_t{mine[i]} * q_heads * 128, q_heads * 128,
                  sub.out.begin() + i * q_heads * 128);
      std::copy_n(got.lse.begin() + size_t{mine[i]} * q_heads, q_heads, sub.lse.begin() + i * q_heads);
    }
    ExpectClose(sub.out.data(), sub.lse.data(), ref, kTol, absl::StrCat("sequence ", s));
  }
}

TEST(PartialAttentionTest, ThreadedRunIsBitwiseEqualToSingleThreaded) {
  std::mt19937_64 rng(21);
  const BlockLayout layout{16, 1, 8, 128, DType::kBF16};
  auto seq = RandomSequence(layout, 1000, rng);
  std::vector<int64_t> pos(64);
  std::iota(pos.begin(), pos.end(), 936);
  auto q = RandomQueries(DType::kBF16, 64, 32, 128, pos, rng);
  std::vector<uint32_t> begin{0, static_cast<uint32_t>(seq.refs.size())};
  PagedKv kv{layout, {}, seq.refs, begin};
  PartialResult a(64, 32, 128), b(64, 32, 128);
  ThreadPool pool(3);
  ASSERT_TRUE(PartialAttention({}, q.view, kv, a.view()).ok());
  ASSERT_TRUE(PartialAttention({}, q.view, kv, b.view(), &pool).ok());
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.lse, b.lse);
}

// Quantized blocks: encode a random block with per-head / per-token /
// K-channel scales, and check the kernel reads exactly what the reference
// dequantizes.
TEST(PartialAttentionTest, ReadsQuantizedBlocksDirectly) {
  std::mt19937_64 rng(33);
  const BlockLayout layout{16, 2, 2, 64, DType::kBF16};
  std::normal_distribution<double> nd;
  for (KvCodec codec : {KvCodec::kInt8, KvCodec::kFp8E4M3}) {
    for (ScaleMode mode : {ScaleMode::kPerHead, ScaleMode::kPerToken, ScaleMode::kKChannelVToken}) {
      const KvEncoding enc{codec, mode};
      std::vector<std::vector<uint8_t>> blocks(4, std::vector<uint8_t>(EncodedBytes(layout, enc)));
      std::vector<KvBlockRef> refs;
      for (size_t b = 0; b < blocks.size(); ++b) {
        uint8_t* p = blocks[b].data();
        float* scales = reinterpret_cast<float*>(p + layout.elements());
        for (uint64_t i = 0; i < ScaleCount(layout, mode); ++i)
          scales[i] = static_cast<float>(0.01 + 0.02 * (rng() % 10));
        for (uint64_t i = 0; i < layout.elements(); ++i) {
          p[i] = codec == KvCodec::kInt8
                     ? static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(rng() % 255) - 127))
                     : FloatToFp8E4M3(static_cast<float>(nd(rng) * 50));
        }
        refs.push_back(KvBlockRef{p, static_cast<int64_t>(b * 16), 16});
      }
      auto q = RandomQueries(DType::kF32, 3, 4, 64, {10, 40, 63}, rng);
      std::vector<uint32_t> begin{0, 4};
      PagedKv kv{layout, enc, refs, begin};
      AttentionOptions o;
      o.layer = 1;
      PartialResult got(3, 4, 64);
      Poison(got);
      ASSERT_TRUE(PartialAttention(o, q.view, kv, got.view()).ok());
      auto ref = reference::Attention(q.values, q.positions, 4, DenseOf(layout, refs, 1, enc), o);
      ExpectClose(got.out.data(), got.lse.data(), ref, kTol, absl::StrCat("codec ", int(codec), " mode ", int(mode)));
    }
  }
}

// Blocks quantized by QuantizeBlock (the node's Put path): attention over
// the codes equals attention over DequantizeBlock's output up to that
// output's bf16 rounding.
TEST(PartialAttentionTest, ReadsBlocksQuantizedByQuantizeBlock) {
  std::mt19937_64 rng(34);
  const BlockLayout layout{16, 2, 2, 64, DType::kBF16};
  auto seq = RandomSequence(layout, 64, rng);
  for (KvCodec codec : {KvCodec::kInt8, KvCodec::kFp8E4M3}) {
    for (ScaleMode mode : {ScaleMode::kPerHead, ScaleMode::kPerToken, ScaleMode::kKChannelVToken}) {
      const KvEncoding enc{codec, mode};
      std::vector<std::vector<uint8_t>> codes(seq.refs.size()), plain(seq.refs.size());
      std::vector<KvBlockRef> crefs, prefs;
      for (size_t b = 0; b < seq.refs.size(); ++b) {
        ASSERT_TRUE(QuantizeBlock(layout, absl::MakeConstSpan(seq.refs[b].data, layout.bytes()), enc, &codes[b]).ok());
        ASSERT_TRUE(DequantizeBlock(layout, enc, codes[b], &plain[b]).ok());
        crefs.push_back(KvBlockRef{codes[b].data(), seq.refs[b].start_pos, seq.refs[b].num_tokens});
        prefs.push_back(KvBlockRef{plain[b].data(), seq.refs[b].start_pos, seq.refs[b].num_tokens});
      }
      auto q = RandomQueries(DType::kF32, 3, 4, 64, {10, 40, 63}, rng);
      std::vector<uint32_t> begin{0, static_cast<uint32_t>(seq.refs.size())};
      AttentionOptions o;
      o.layer = 1;
      PartialResult got(3, 4, 64);
      Poison(got);
      ASSERT_TRUE(PartialAttention(o, q.view, PagedKv{layout, enc, crefs, begin}, got.view()).ok());
      const std::string what = absl::StrCat("codec ", int(codec), " mode ", int(mode));
      ExpectClose(got.out.data(), got.lse.data(),
                  reference::Attention(q.values, q.positions, 4, DenseOf(layout, prefs, 1), o), 5e-3, what);
      // (5e-3, not kTol: DequantizeBlock rounds the dequantized values to bf16.)
    }
  }
}

// Found by fuzz_requests: a NaN query reached a float-to-int conversion.
// Non-finite queries are refused; a NaN stored in a KV block gives NaN
// outputs for the rows that see it (no undefined behaviour, no crash).
TEST(PartialAttentionTest, NonFiniteQueriesAreRefusedAndNonFiniteKvGivesNaN) {
  std::mt19937_64 rng(5);
  const BlockLayout layout{16, 1, 2, 64, DType::kF16};
  auto seq = RandomSequence(layout, 16, rng);
  std::vector<uint32_t> begin{0, 1};
  PagedKv kv{layout, {}, seq.refs, begin};
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    auto q = RandomQueries(dt, 2, 4, 64, {5, 9}, rng);
    const size_t at = 4 * 64 + 3;  // row 1, head 0
    if (dt == DType::kF32)
      reinterpret_cast<float*>(q.data.data())[at] = std::numeric_limits<float>::quiet_NaN();
    else
      reinterpret_cast<uint16_t*>(q.data.data())[at] = dt == DType::kF16 ? 0x7e00 : 0x7fc0;  // NaN
    PartialResult out(2, 4, 64);
    absl::Status s = PartialAttention({}, q.view, kv, out.view());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("row 1 head 0"), std::string::npos) << s;
  }
  // A NaN key at position 7: rows at positions >= 7 see it.
  std::vector<uint8_t> block(static_cast<const uint8_t*>(seq.refs[0].data),
                             static_cast<const uint8_t*>(seq.refs[0].data) + layout.bytes());
  reinterpret_cast<uint16_t*>(block.data())[layout.index(0, 0, 0, 7, 0)] = 0x7e00;
  KvBlockRef ref{block.data(), 0, 16};
  auto q = RandomQueries(DType::kF32, 2, 4, 64, {5, 9}, rng);
  PartialResult out(2, 4, 64);
  ASSERT_TRUE(PartialAttention({}, q.view, PagedKv{layout, {}, absl::MakeConstSpan(&ref, 1), begin}, out.view()).ok());
  EXPECT_TRUE(std::isfinite(out.out[0]));            // row 0 (position 5) never sees key 7
  EXPECT_TRUE(std::isnan(out.out[size_t{4} * 64]));  // row 1, head 0 (kv head 0) does
}

TEST(PartialAttentionTest, RejectsMalformedInputsWithClearErrors) {
  std::mt19937_64 rng(1);
  const BlockLayout layout{16, 1, 2, 64, DType::kF16};
  auto seq = RandomSequence(layout, 16, rng);
  std::vector<uint32_t> begin{0, 1};
  PagedKv kv{layout, {}, seq.refs, begin};
  auto q = RandomQueries(DType::kF16, 1, 4, 64, {5}, rng);
  PartialResult out(1, 4, 64);
  auto code = [&](const AttentionOptions& o, QueryTensor qt, PagedKv k) {
    return PartialAttention(o, qt, k, out.view()).code();
  };
  QueryTensor bad = q.view;
  bad.q_heads = 3;  // not a multiple of kv_heads
  EXPECT_EQ(code({}, bad, kv), absl::StatusCode::kInvalidArgument);
  bad = q.view;
  bad.head_dim = 128;
  EXPECT_EQ(code({}, bad, kv), absl::StatusCode::kInvalidArgument);
  bad = q.view;
  bad.positions = nullptr;
  EXPECT_EQ(code({}, bad, kv), absl::StatusCode::kInvalidArgument);
  bad = q.view;
  bad.dtype = DType::kINT8;
  EXPECT_EQ(code({}, bad, kv), absl::StatusCode::kInvalidArgument);
  AttentionOptions o;
  o.layer = 1;
  EXPECT_EQ(code(o, q.view, kv), absl::StatusCode::kInvalidArgument);
  std::vector<KvBlockRef> refs = seq.refs;
  refs[0].num_tokens = 17;
  EXPECT_EQ(code({}, q.view, PagedKv{layout, {}, refs, begin}), absl::StatusCode::kInvalidArgument);
  std::vector<uint32_t> bad_begin{0, 2};
  EXPECT_EQ(code({}, q.view, PagedKv{layout, {}, seq.refs, bad_begin}), absl::StatusCode::kInvalidArgument);
  uint32_t seq_id = 4;
  bad = q.view;
  bad.seq_ids = &seq_id;
  absl::Status s = PartialAttention({}, bad, kv, out.view());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("sequence 4"), std::string::npos) << s;
}

}  // namespace
}  // namespace kvring
