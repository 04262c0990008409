#include "kvring/layout/block_layout.h"

#include "gtest/gtest.h"
#include "kvring/layout/kv_encoding.h"

namespace kvring {
namespace {

TEST(BlockLayoutTest, ByteSizesFollowTheShape) {
  BlockLayout l{16, 32, 8, 128, DType::kBF16};
  EXPECT_EQ(l.plane_elems(), 16u * 128);
  EXPECT_EQ(l.elements(), 32ull * 2 * 8 * 16 * 128);
  EXPECT_EQ(l.bytes(), l.elements() * 2);  // 2 MiB: a Llama-3-8B block of 16 tokens
  EXPECT_EQ(l.bytes(), 2ull << 20);
  l.dtype = DType::kF32;
  EXPECT_EQ(l.bytes(), 4ull << 20);
}

TEST(BlockLayoutTest, IndexIsRowMajorLayerKvHeadTokenDim) {
  BlockLayout l{4, 3, 2, 8, DType::kF16};
  EXPECT_EQ(l.index(0, 0, 0, 0, 0), 0u);
  EXPECT_EQ(l.index(0, 0, 0, 0, 7), 7u);
  EXPECT_EQ(l.index(0, 0, 0, 1, 0), 8u);
  EXPECT_EQ(l.index(0, 0, 1, 0, 0), 32u);
  EXPECT_EQ(l.index(0, 1, 0, 0, 0), 64u);
  EXPECT_EQ(l.index(1, 0, 0, 0, 0), 128u);
  EXPECT_EQ(l.index(2, 1, 1, 3, 7), l.elements() - 1);
  EXPECT_EQ(l.plane_index(1, 1, 1), l.index(1, 1, 1, 0, 0));
}

TEST(BlockLayoutTest, ValidationNamesTheBadField) {
  const char* why = nullptr;
  BlockLayout ok{16, 1, 8, 128, DType::kBF16};
  EXPECT_TRUE(ok.IsValid(&why));
  EXPECT_EQ(why, nullptr);
  BlockLayout l = ok;
  l.block_tokens = 0;
  EXPECT_FALSE(l.IsValid(&why));
  EXPECT_NE(std::string(why).find("block_tokens"), std::string::npos);
  l = ok;
  l.head_dim = 100;
  EXPECT_FALSE(l.IsValid(&why));
  EXPECT_NE(std::string(why).find("head_dim"), std::string::npos);
  l = ok;
  l.dtype = DType::kINT8;
  EXPECT_FALSE(l.IsValid(&why));
  l = ok;
  l.layers = 256;
  l.kv_heads = 256;
  l.block_tokens = 256;
  EXPECT_FALSE(l.IsValid(&why));
  EXPECT_NE(std::string(why).find("64 MiB"), std::string::npos);
}

TEST(KvEncodingTest, QuantizedBytesCountCodesAndScales) {
  BlockLayout l{16, 2, 4, 64, DType::kBF16};
  EXPECT_EQ(EncodedBytes(l, {}), l.bytes());
  EXPECT_EQ(EncodedBytes(l, {KvCodec::kInt8, ScaleMode::kPerHead}), l.elements() + 4 * 2 * 2 * 4);
  EXPECT_EQ(EncodedBytes(l, {KvCodec::kFp8E4M3, ScaleMode::kPerToken}), l.elements() + 4 * 2 * 2 * 4 * 16);
  EXPECT_EQ(EncodedBytes(l, {KvCodec::kInt8, ScaleMode::kKChannelVToken}), l.elements() + 4 * 2 * 4 * (64 + 16));
  KvEncoding e;
  EXPECT_TRUE(KvEncoding::Unpack(KvEncoding{KvCodec::kFp8E4M3, ScaleMode::kKChannelVToken}.Pack(), &e));
  EXPECT_EQ(e.codec, KvCodec::kFp8E4M3);
  EXPECT_EQ(e.scales, ScaleMode::kKChannelVToken);
  EXPECT_FALSE(KvEncoding::Unpack(0x33, &e));
}

TEST(KvEncodingTest, ScaleIndicesCoverTheScaleRegionExactlyOnce) {
  BlockLayout l{4, 2, 3, 8, DType::kBF16};
  for (ScaleMode m : {ScaleMode::kPerHead, ScaleMode::kPerToken, ScaleMode::kKChannelVToken}) {
    std::vector<int> seen(ScaleCount(l, m), 0);
    for (uint32_t layer = 0; layer < l.layers; ++layer)
      for (uint32_t kv = 0; kv < 2; ++kv)
        for (uint32_t h = 0; h < l.kv_heads; ++h)
          for (uint32_t t = 0; t < l.block_tokens; ++t)
            for (uint32_t d = 0; d < l.head_dim; ++d) {
              const uint64_t i = ScaleIndex(l, m, layer, kv, h, t, d);
              ASSERT_LT(i, seen.size());
              seen[i] = 1;
            }
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << "mode " << int(m) << " index " << i;
  }
}

// The kernels' 32-bit form of the index (ScaleIndexAs<int>) is the same
// index, on the largest layout a kernel takes (128 layers, 32 kv heads,
// head_dim 256, 64-token blocks: scale region under 2^31).
TEST(KvEncodingTest, TheKernelsThirtyTwoBitScaleIndexIsTheSameIndex) {
  const BlockLayout l{64, 128, 32, 256, DType::kBF16};
  for (ScaleMode m : {ScaleMode::kPerHead, ScaleMode::kPerToken, ScaleMode::kKChannelVToken}) {
    ASSERT_LT(ScaleCount(l, m), uint64_t{1} << 31);
    for (uint32_t layer : {0u, 1u, 63u, 127u})
      for (uint32_t kv = 0; kv < 2; ++kv)
        for (uint32_t h : {0u, 5u, 31u})
          for (uint32_t t : {0u, 17u, 63u})
            for (uint32_t d : {0u, 100u, 255u}) {
              const int i32 = ScaleIndexAs<int>(32, 64, 256, m, static_cast<int>(layer), static_cast<int>(kv),
                                                static_cast<int>(h), static_cast<int>(t), static_cast<int>(d));
              ASSERT_EQ(static_cast<uint64_t>(i32), ScaleIndex(l, m, layer, kv, h, t, d)) << int(m);
            }
  }
}

}  // namespace
}  // namespace kvring
