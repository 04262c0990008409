#include "kvring/attention/merge.h"

#include <algorithm>
#include <limits>

#include "attention_test_util.h"
#include "gtest/gtest.h"
#include "kvring/attention/partial_attention.h"

namespace kvring {
namespace {

using testing::DenseOf;
using testing::ExpectClose;
using testing::RandomQueries;
using testing::RandomSequence;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Property: for any split of the KV into disjoint parts (some empty), the
// merge of the parts' partials equals attention over the whole.
TEST(MergePartialsTest, MergeOfAnySplitEqualsAttentionOverTheWhole) {
  for (uint64_t seed = 1; seed <= 25; ++seed) {
    std::mt19937_64 rng(seed);
    const BlockLayout layout{16, 1, 2, 64, seed % 2 ? DType::kBF16 : DType::kF32};
    auto seq = RandomSequence(layout, 1 + rng() % 400, rng);
    const uint32_t parts = 1 + rng() % 8, rows = 1 + rng() % 6;
    std::vector<int64_t> pos(rows);
    for (auto& p : pos) p = static_cast<int64_t>(rng() % (seq.num_tokens + 4));
    auto q = RandomQueries(DType::kF32, rows, 8, 64, pos, rng);
    AttentionOptions o;
    o.causal = rng() % 2;
    std::vector<std::vector<KvBlockRef>> split(parts);
    for (const auto& r : seq.refs) split[rng() % parts].push_back(r);
    std::vector<PartialResult> partials;
    for (auto& s : split) {
      std::vector<uint32_t> begin{0, static_cast<uint32_t>(s.size())};
      partials.emplace_back(rows, 8, 64);
      ASSERT_TRUE(PartialAttention(o, q.view, PagedKv{layout, {}, s, begin}, partials.back().view()).ok());
    }
    std::shuffle(partials.begin(), partials.end(), rng);  // order does not matter
    std::vector<ConstPartial> views;
    for (auto& p : partials) views.push_back(p.cview());
    PartialResult merged(rows, 8, 64);
    testing::Poison(merged);
    ASSERT_TRUE(MergePartials(views, rows, 8, 64, merged.view()).ok());
    auto ref = reference::Attention(q.values, q.positions, 8, DenseOf(layout, seq.refs, 0), o);
    ExpectClose(merged.out.data(), merged.lse.data(), ref, 2e-5, "seed " + std::to_string(seed));
  }
}

TEST(MergePartialsTest, MinusInfinityPartialsContributeNothing) {
  PartialResult a(1, 1, 8), b(1, 1, 8), out(1, 1, 8);
  std::fill(a.out.begin(), a.out.end(), 2.0f);
  a.lse[0] = 1.5f;
  std::fill(b.out.begin(), b.out.end(), 0.0f);
  b.lse[0] = kNegInf;
  ConstPartial in[2] = {a.cview(), b.cview()};
  ASSERT_TRUE(MergePartials(in, 1, 1, 8, out.view()).ok());
  EXPECT_FLOAT_EQ(out.lse[0], 1.5f);
  for (float v : out.out) EXPECT_FLOAT_EQ(v, 2.0f);
  a.lse[0] = kNegInf;
  std::fill(a.out.begin(), a.out.end(), 0.0f);
  ConstPartial none[2] = {a.cview(), b.cview()};
  ASSERT_TRUE(MergePartials(none, 1, 1, 8, out.view()).ok());
  EXPECT_TRUE(std::isinf(out.lse[0]) && out.lse[0] < 0);
  for (float v : out.out) EXPECT_EQ(v, 0.0f);
}

TEST(MergePartialsTest, StableForHugeLseDifferences) {
  PartialResult a(1, 1, 8), b(1, 1, 8), out(1, 1, 8);
  std::fill(a.out.begin(), a.out.end(), 1.0f);
  std::fill(b.out.begin(), b.out.end(), -1.0f);
  a.lse[0] = 1000.0f;
  b.lse[0] = 1000.0f;  // equal weights despite exp(1000) overflowing fp32
  ConstPartial in[2] = {a.cview(), b.cview()};
  ASSERT_TRUE(MergePartials(in, 1, 1, 8, out.view()).ok());
  EXPECT_NEAR(out.lse[0], 1000.0f + std::log(2.0f), 1e-3);
  for (float v : out.out) EXPECT_NEAR(v, 0.0f, 1e-6);
}

TEST(MergePartialsTest, MergesInPlaceAndRejectsNan) {
  PartialResult a(2, 1, 8), b(2, 1, 8);
  std::fill(a.out.begin(), a.out.end(), 1.0f);
  std::fill(b.out.begin(), b.out.end(), 3.0f);
  a.lse = {0.0f, 0.0f};
  b.lse = {0.0f, kNegInf};
  MergeInto(a.view(), b.cview(), 2, 1, 8);
  EXPECT_FLOAT_EQ(a.out[0], 2.0f);
  EXPECT_FLOAT_EQ(a.out[8], 1.0f);
  EXPECT_NEAR(a.lse[0], std::log(2.0f), 1e-6);
  b.lse[0] = std::numeric_limits<float>::quiet_NaN();
  ConstPartial in[1] = {b.cview()};
  EXPECT_EQ(MergePartials(in, 2, 1, 8, a.view()).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvring
