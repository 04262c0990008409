#include "kvring/cache/block_key.h"

#include <numeric>
#include <set>

#include "gtest/gtest.h"
#include "xxhash.h"

namespace kvring {
namespace {

std::vector<uint32_t> Tokens(size_t n, uint32_t start = 1) {
  std::vector<uint32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

// Re-encodes docs/KEYS.md independently of block_key.cc.
void PutLe(std::string* s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

TEST(BlockKeyTest, MatchesTheCanonicalSpec) {
  const BlockLayout layout{4, 2, 8, 128, DType::kBF16};
  BlockKeyHasher h("llama-3-8b", "tenant-a", layout);
  std::string ctx;
  PutLe(&ctx, 10, 4);
  ctx += "llama-3-8b";
  PutLe(&ctx, 8, 4);
  ctx += "tenant-a";
  for (uint32_t v : {4u, 2u, 8u, 128u}) PutLe(&ctx, v, 4);
  ctx.push_back(static_cast<char>(DType::kBF16));
  std::string root = std::string("kvring/v1\0", 10) + ctx;
  XXH128_hash_t r = XXH3_128bits(root.data(), root.size());
  EXPECT_EQ(h.Root().lo, r.low64);
  EXPECT_EQ(h.Root().hi, r.high64);

  const std::vector<uint32_t> toks = {11, 22, 33, 44};
  std::string b;
  PutLe(&b, r.low64, 8);
  PutLe(&b, r.high64, 8);
  PutLe(&b, 4, 4);
  for (uint32_t t : toks) PutLe(&b, t, 4);
  b += ctx;
  XXH128_hash_t k = XXH3_128bits(b.data(), b.size());
  const BlockKey got = h.Next(h.Root(), toks);
  EXPECT_EQ(got.lo, k.low64);
  EXPECT_EQ(got.hi, k.high64);
}

TEST(BlockKeyTest, DeterministicAcrossHasherInstances) {
  const BlockLayout layout{16, 32, 8, 128, DType::kBF16};
  BlockKeyHasher a("m", "ns", layout), b("m", "ns", layout);
  EXPECT_EQ(a.Chain(Tokens(160)), b.Chain(Tokens(160)));
}

TEST(BlockKeyTest, SharedPrefixSharesKeysThenDiverges) {
  const BlockLayout layout{16, 1, 8, 64, DType::kF16};
  BlockKeyHasher h("m", "ns", layout);
  std::vector<uint32_t> x = Tokens(64), y = Tokens(64);
  y[40] = 999;  // in block 2
  auto kx = h.Chain(x), ky = h.Chain(y);
  ASSERT_EQ(kx.size(), 4u);
  EXPECT_EQ(kx[0], ky[0]);
  EXPECT_EQ(kx[1], ky[1]);
  EXPECT_NE(kx[2], ky[2]);
  EXPECT_NE(kx[3], ky[3]);  // a child differs when its parent does, even with equal tokens
}

TEST(BlockKeyTest, PartialTailBlockGetsNoKey) {
  BlockKeyHasher h("m", "ns", BlockLayout{16, 1, 1, 8, DType::kF32});
  EXPECT_EQ(h.Chain(Tokens(47)).size(), 2u);
  EXPECT_EQ(h.Chain(Tokens(15)).size(), 0u);
  auto full = h.Chain(Tokens(48));
  auto from = h.ChainFrom(full[0], absl::MakeConstSpan(Tokens(48)).subspan(16));
  EXPECT_EQ(from[0], full[1]);
  EXPECT_EQ(from[1], full[2]);
}

TEST(BlockKeyTest, TenantsModelsAndLayoutsSeparateKeys) {
  const BlockLayout l{16, 1, 8, 64, DType::kBF16};
  BlockLayout l2 = l;
  l2.dtype = DType::kF16;
  std::set<BlockKey> keys;
  for (const auto& h : {BlockKeyHasher("m", "a", l), BlockKeyHasher("m", "b", l), BlockKeyHasher("m2", "a", l),
                        BlockKeyHasher("m", "a", l2)}) {
    keys.insert(h.Chain(Tokens(16))[0]);
  }
  EXPECT_EQ(keys.size(), 4u);
  // Two tenants publishing into one shared namespace do share keys.
  EXPECT_EQ(BlockKeyHasher("m", "shared", l).Chain(Tokens(32)), BlockKeyHasher("m", "shared", l).Chain(Tokens(32)));
  EXPECT_NE(NamespaceIdOf("a"), NamespaceIdOf("b"));
}

TEST(BlockKeyTest, HexRoundTripsAndRejectsJunk) {
  BlockKey k{0x0123456789abcdefull, 0xfedcba9876543210ull};
  EXPECT_EQ(k.ToHex(), "fedcba98765432100123456789abcdef");
  auto back = BlockKey::FromHex(k.ToHex());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, k);
  EXPECT_FALSE(BlockKey::FromHex("xyz").ok());
  EXPECT_FALSE(BlockKey::FromHex(std::string(32, 'g')).ok());
}

}  // namespace
}  // namespace kvring
