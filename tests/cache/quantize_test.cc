#include "kvring/cache/quantize.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"
#include "kvring/layout/float_convert.h"
#include "kvring/layout/fp8.h"

namespace kvring {
namespace {

const BlockLayout kL{16, 2, 2, 64, DType::kBF16};

std::vector<uint8_t> RandomBlock(std::mt19937_64& rng, float outlier = 0) {
  std::vector<uint8_t> b(kL.bytes());
  std::normal_distribution<float> nd;
  auto* h = reinterpret_cast<uint16_t*>(b.data());
  for (uint64_t e = 0; e < kL.elements(); ++e) {
    float v = nd(rng);
    if (outlier > 0 && e % kL.head_dim == 3) v *= outlier;  // an outlier channel
    h[e] = FloatToBf16(v);
  }
  return b;
}

float Elem(const std::vector<uint8_t>& b, uint64_t e) { return PlainElement(kL, b.data(), e); }

TEST(QuantizeTest, Int8RoundTripIsWithinHalfAScaleAndScalesAreAbsmax) {
  std::mt19937_64 rng(1);
  for (ScaleMode m : {ScaleMode::kPerHead, ScaleMode::kPerToken, ScaleMode::kKChannelVToken}) {
    const KvEncoding e{KvCodec::kInt8, m};
    auto plain = RandomBlock(rng, 20);
    std::vector<uint8_t> q, back;
    ASSERT_TRUE(QuantizeBlock(kL, plain, e, &q).ok());
    ASSERT_EQ(q.size(), EncodedBytes(kL, e));
    ASSERT_TRUE(DequantizeBlock(kL, e, q, &back).ok());
    const float* scales = reinterpret_cast<const float*>(q.data() + kL.elements());
    std::vector<float> amax(ScaleCount(kL, m), 0.f);
    for (uint32_t l = 0; l < kL.layers; ++l)
      for (uint32_t kv = 0; kv < 2; ++kv)
        for (uint32_t h = 0; h < kL.kv_heads; ++h)
          for (uint32_t t = 0; t < kL.block_tokens; ++t)
            for (uint32_t d = 0; d < kL.head_dim; ++d) {
              const uint64_t i = kL.index(l, kv, h, t, d);
              const uint64_t si = ScaleIndex(kL, m, l, kv, h, t, d);
              amax[si] = std::max(amax[si], std::fabs(Elem(plain, i)));
              // bf16 storage of the dequantized value adds its own rounding.
              EXPECT_LE(std::fabs(Elem(plain, i) - Elem(back, i)),
                        scales[si] * 0.5f + std::fabs(Elem(plain, i)) / 128.f)
                  << "mode " << int(m) << " element " << i;
            }
    for (size_t i = 0; i < amax.size(); ++i) EXPECT_FLOAT_EQ(scales[i], amax[i] / 127.f) << "scale " << i;
  }
}

TEST(QuantizeTest, Fp8RoundTripHasThreeMantissaBits) {
  std::mt19937_64 rng(2);
  const KvEncoding e{KvCodec::kFp8E4M3, ScaleMode::kPerToken};
  auto plain = RandomBlock(rng);
  std::vector<uint8_t> q, back;
  ASSERT_TRUE(QuantizeBlock(kL, plain, e, &q).ok());
  ASSERT_TRUE(DequantizeBlock(kL, e, q, &back).ok());
  const float* scales = reinterpret_cast<const float*>(q.data() + kL.elements());
  for (uint64_t i = 0; i < kL.elements(); ++i) {
    const float x = Elem(plain, i), y = Elem(back, i);
    const float sc = scales[i / kL.head_dim];  // per token: rows are (layer, K|V, head, token) in layout order
    // Relative 2^-4 for normal codes, absolute 2^-10 * scale for subnormal ones, plus bf16 storage.
    EXPECT_LE(std::fabs(x - y), std::max(std::fabs(x) * 0.0625f, sc * 0.001f) + std::fabs(x) / 128.f) << i;
  }
}

TEST(QuantizeTest, TheLargestValueSaturatesTheCodeRange) {
  std::vector<uint8_t> plain(kL.bytes(), 0);
  auto* h = reinterpret_cast<uint16_t*>(plain.data());
  h[kL.index(0, 0, 0, 3, 5)] = FloatToBf16(-9.5f);  // the absmax of head 0's K plane
  h[kL.index(0, 0, 0, 4, 5)] = FloatToBf16(1.0f);
  for (KvCodec c : {KvCodec::kInt8, KvCodec::kFp8E4M3}) {
    const KvEncoding e{c, ScaleMode::kPerHead};
    std::vector<uint8_t> q;
    ASSERT_TRUE(QuantizeBlock(kL, plain, e, &q).ok());
    const uint8_t code = q[kL.index(0, 0, 0, 3, 5)];
    if (c == KvCodec::kInt8) {
      EXPECT_EQ(static_cast<int8_t>(code), -127);
    } else {
      EXPECT_EQ(code, 0xFE);  // -448
      EXPECT_EQ(Fp8E4M3ToFloat(code), -448.f);
    }
    // An all-zero plane gets scale 1 and zero codes.
    const float* scales = reinterpret_cast<const float*>(q.data() + kL.elements());
    EXPECT_FLOAT_EQ(scales[ScaleIndex(kL, e.scales, 1, 1, 1, 0, 0)], 1.f);
    EXPECT_EQ(q[kL.index(1, 1, 1, 7, 7)], 0);
  }
}

TEST(QuantizeTest, NonFiniteValuesAreRejectedWithTheirLocation) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<uint8_t> plain(kL.bytes(), 0);
    reinterpret_cast<uint16_t*>(plain.data())[kL.index(1, 1, 0, 2, 9)] = FloatToBf16(bad);
    std::vector<uint8_t> q;
    absl::Status s = QuantizeBlock(kL, plain, {KvCodec::kInt8, ScaleMode::kPerHead}, &q);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("layer 1 V head 0 token 2 dim 9"), std::string::npos) << s;
  }
  std::vector<uint8_t> q;
  EXPECT_FALSE(QuantizeBlock(kL, std::vector<uint8_t>(10), {KvCodec::kInt8, ScaleMode::kPerHead}, &q).ok());
  EXPECT_FALSE(QuantizeBlock(kL, std::vector<uint8_t>(kL.bytes()), {}, &q).ok());  // plain is not a target
}

// Found by fuzz_blocks: a group of subnormal values got scale 0, and 0/0
// codes. Scales are now at least the smallest normal float.
TEST(QuantizeTest, SubnormalGroupsGetAPositiveScaleAndFiniteCodes) {
  const BlockLayout l{4, 1, 1, 8, DType::kF32};
  std::vector<float> x(l.elements(), 0.0f);
  x[3] = std::numeric_limits<float>::denorm_min() * 7;
  x[9] = -std::numeric_limits<float>::denorm_min();
  std::vector<uint8_t> plain(l.bytes());
  std::memcpy(plain.data(), x.data(), plain.size());
  for (const char* name : {"int8/per-head", "int8/per-token", "int8/kivi", "fp8/per-head", "fp8/kivi"}) {
    KvEncoding enc;
    ASSERT_TRUE(ParseKvEncoding(name, &enc).ok());
    std::vector<uint8_t> codes, back;
    ASSERT_TRUE(QuantizeBlock(l, plain, enc, &codes).ok()) << name;
    const float* scales = reinterpret_cast<const float*>(codes.data() + l.elements());
    for (uint64_t i = 0; i < ScaleCount(l, enc.scales); ++i) EXPECT_GT(scales[i], 0.0f) << name;
    ASSERT_TRUE(DequantizeBlock(l, enc, codes, &back).ok());
    for (uint64_t e = 0; e < l.elements(); ++e) {
      const float v = PlainElement(l, back.data(), e);
      EXPECT_TRUE(std::isfinite(v)) << name << " element " << e;
      EXPECT_LE(std::fabs(v), 1e-37f) << name;
    }
  }
}

TEST(QuantizeTest, Fp8TableRoundingMatchesTheReferenceEncoder) {
  // Every code's value and the midpoints between neighbours encode exactly as fp8.h's constexpr encoder does.
  std::vector<uint8_t> plain(kL.bytes(), 0);
  auto* h = reinterpret_cast<uint16_t*>(plain.data());
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> u(-448.f, 448.f);
  for (uint32_t t = 0; t < kL.block_tokens; ++t)
    for (uint32_t d = 0; d < kL.head_dim; ++d) h[kL.index(0, 0, 0, t, d)] = FloatToBf16(u(rng));
  h[kL.index(0, 0, 0, 0, 0)] = FloatToBf16(448.f);  // makes the scale exactly 1
  std::vector<uint8_t> q;
  ASSERT_TRUE(QuantizeBlock(kL, plain, {KvCodec::kFp8E4M3, ScaleMode::kPerHead}, &q).ok());
  for (uint32_t t = 0; t < kL.block_tokens; ++t)
    for (uint32_t d = 0; d < kL.head_dim; ++d) {
      const uint64_t i = kL.index(0, 0, 0, t, d);
      EXPECT_EQ(q[i], FloatToFp8E4M3(Bf16ToFloat(h[i]))) << i;
    }
}

TEST(QuantizeTest, ParsesEncodingNames) {
  KvEncoding e;
  ASSERT_TRUE(ParseKvEncoding("fp8/kivi", &e).ok());
  EXPECT_EQ(e.codec, KvCodec::kFp8E4M3);
  EXPECT_EQ(e.scales, ScaleMode::kKChannelVToken);
  ASSERT_TRUE(ParseKvEncoding("int8", &e).ok());
  EXPECT_EQ(e.scales, ScaleMode::kPerHead);
  ASSERT_TRUE(ParseKvEncoding("none", &e).ok());
  EXPECT_FALSE(e.quantized());
  EXPECT_FALSE(ParseKvEncoding("int4", &e).ok());
  EXPECT_FALSE(ParseKvEncoding("int8/per-galaxy", &e).ok());
  EXPECT_EQ(KvEncodingName({KvCodec::kInt8, ScaleMode::kPerToken}), "int8/per-token");
}

}  // namespace
}  // namespace kvring
