#include "kvring/cache/rocksdb_cold_tier.h"

#include <filesystem>

#include "gtest/gtest.h"
#include "kvring/cache/block_store.h"
#include "store_test_util.h"

namespace kvring {
namespace {

using testing::ArgsFor;
using testing::KeyOf;
using testing::PayloadFor;
using testing::SmallLayout;

std::string FreshDir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/kvring_" + name + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(d);
  return d;
}

ColdBlockInfo InfoFor(uint64_t i, const std::vector<uint8_t>& p) {
  ColdBlockInfo info;
  info.key = ScopedKey{3, KeyOf(i)};
  info.parent = i ? KeyOf(i - 1) : BlockKey{};
  info.meta.layout = SmallLayout();
  info.meta.payload_bytes = static_cast<uint32_t>(p.size());
  info.meta.checksum = PayloadChecksum(p.data(), p.size());
  info.meta.owner = 9;
  return info;
}

TEST(RocksDbColdTierTest, WriteReadEraseAndScanSurviveReopen) {
  const std::string dir = FreshDir("cold_rt");
  for (ColdCodec codec : {ColdCodec::kZstd, ColdCodec::kLz4, ColdCodec::kNone}) {
    std::filesystem::remove_all(dir);
    {
      auto t = RocksDbColdTier::Open({.path = dir, .codec = codec});
      ASSERT_TRUE(t.ok()) << t.status();
      for (uint64_t i = 0; i < 10; ++i) {
        auto p = PayloadFor(KeyOf(i), 256);
        ASSERT_TRUE((*t)->Write(InfoFor(i, p), p).ok());
      }
      ASSERT_TRUE((*t)->Erase(ScopedKey{3, KeyOf(4)}).ok());
      EXPECT_EQ((*t)->stats().blocks, 9u);
    }
    auto t = RocksDbColdTier::Open({.path = dir, .codec = codec});
    ASSERT_TRUE(t.ok());
    EXPECT_EQ((*t)->stats().blocks, 9u);
    size_t seen = 0;
    ASSERT_TRUE((*t)->Scan([&](const ColdBlockInfo& info) {
                      ++seen;
                      EXPECT_EQ(info.meta.owner, 9u);
                      EXPECT_EQ(info.key.ns, 3u);
                    })
                    .ok());
    EXPECT_EQ(seen, 9u);
    ColdBlockInfo info;
    std::vector<uint8_t> out;
    ASSERT_TRUE((*t)->Read(ScopedKey{3, KeyOf(7)}, &info, &out).ok());
    EXPECT_EQ(out, PayloadFor(KeyOf(7), 256));
    EXPECT_EQ(info.parent, KeyOf(6));
    EXPECT_EQ((*t)->Read(ScopedKey{3, KeyOf(4)}, &info, &out).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*t)->Read(ScopedKey{4, KeyOf(7)}, &info, &out).code(), absl::StatusCode::kNotFound);
  }
  std::filesystem::remove_all(dir);
}

TEST(RocksDbColdTierTest, CompressesRedundantPayloadsAndDetectsCorruption) {
  std::vector<uint8_t> zeros(1 << 16, 0);
  for (ColdCodec c : {ColdCodec::kZstd, ColdCodec::kLz4}) {
    std::string blob;
    ASSERT_TRUE(RocksDbColdTier::Compress(c, 1, zeros, &blob).ok());
    EXPECT_LT(blob.size(), zeros.size() / 10);
    std::vector<uint8_t> back;
    ASSERT_TRUE(RocksDbColdTier::Decompress(
                    absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(blob.data()), blob.size()), &back)
                    .ok());
    EXPECT_EQ(back, zeros);
    blob[blob.size() / 2] ^= 0x77;
    blob.resize(blob.size() - 3);
    EXPECT_EQ(RocksDbColdTier::Decompress(
                  absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(blob.data()), blob.size()), &back)
                  .code(),
              absl::StatusCode::kDataLoss);
  }
  EXPECT_FALSE(ParseColdCodec("gzip").ok());
}

TEST(RocksDbColdTierTest, AStoreRestartedOnTheSameDirectoryRecoversEveryDemotedBlock) {
  const std::string dir = FreshDir("cold_restart");
  BlockStoreOptions o;
  o.page_bytes = 256;
  o.num_pages = 4;
  std::vector<BlockKey> keys;
  {
    auto cold = RocksDbColdTier::Open({.path = dir});
    ASSERT_TRUE(cold.ok());
    auto store = BlockStore::Create(o, std::move(*cold));
    ASSERT_TRUE(store.ok());
    for (uint64_t i = 0; i < 20; ++i) {
      PutArgs a = ArgsFor(i);
      ASSERT_TRUE((*store)->Put(a, PayloadFor(a.key, 256)).ok());
      keys.push_back(a.key);
    }
    EXPECT_EQ((*store)->stats().demotions, 16u);
  }  // "crash": the host tier is gone
  auto cold = RocksDbColdTier::Open({.path = dir});
  ASSERT_TRUE(cold.ok());
  auto store = BlockStore::Create(o, std::move(*cold));
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->LookupPrefix(1, keys), 16u);  // the 16 demoted blocks; 4 were only in host memory
  std::vector<uint8_t> out(256);
  for (uint64_t i = 0; i < 16; ++i) {
    ASSERT_TRUE((*store)->Read(1, keys[i], absl::MakeSpan(out), nullptr).ok()) << i;
    EXPECT_EQ(out, PayloadFor(keys[i], 256));
  }
  std::filesystem::remove_all(dir);
}

TEST(RocksDbColdTierTest, WriteThroughMakesEveryAcknowledgedPutDurable) {
  const std::string dir = FreshDir("cold_wt");
  BlockStoreOptions o;
  o.page_bytes = 256;
  o.num_pages = 64;
  o.cold_write_through = true;
  {
    auto store = BlockStore::Create(o, std::move(*RocksDbColdTier::Open({.path = dir})));
    ASSERT_TRUE(store.ok());
    for (uint64_t i = 0; i < 10; ++i) {
      PutArgs a = ArgsFor(i);
      ASSERT_TRUE((*store)->Put(a, PayloadFor(a.key, 256)).ok());
    }
    EXPECT_EQ((*store)->stats().evictions, 0u);
  }
  auto store = BlockStore::Create(o, std::move(*RocksDbColdTier::Open({.path = dir})));
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->stats().blocks, 10u);
  std::vector<uint8_t> out(256);
  ASSERT_TRUE((*store)->Read(1, KeyOf(9), absl::MakeSpan(out), nullptr).ok());
  EXPECT_EQ(out, PayloadFor(KeyOf(9), 256));
  std::filesystem::remove_all(dir);
}

TEST(RocksDbColdTierTest, SecondOpenOfALockedDirectoryFailsClearly) {
  const std::string dir = FreshDir("cold_lock");
  auto a = RocksDbColdTier::Open({.path = dir});
  ASSERT_TRUE(a.ok());
  auto b = RocksDbColdTier::Open({.path = dir});
  EXPECT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find(dir), std::string::npos) << b.status();
}

}  // namespace
}  // namespace kvring

namespace kvring {
namespace {

// A real full disk (a tmpfs with a filler file; needs root to mount,
// skipped without):
// writes fail cleanly, reads go on, and once space returns writes resume by
// themselves, with no restart (the probe found writes failing until one).
TEST(RocksDbColdTierTest, WritesResumeByThemselvesAfterTheDiskFillsAndFreesUp) {
  const std::string dir = FreshDir("cold_full");
  std::filesystem::create_directories(dir);
  if (std::system(("mount -t tmpfs -o size=400m tmpfs " + dir + " 2>/dev/null").c_str()) != 0) {
    std::filesystem::remove_all(dir);
    GTEST_SKIP() << "needs root to mount a small tmpfs";
  }
  struct Unmount {
    std::string d;
    ~Unmount() {
      (void)std::system(("umount " + d).c_str());
      std::filesystem::remove_all(d);
    }
  } unmount{dir};
  // A filler to free later.
  {
    FILE* f = std::fopen((dir + "/filler").c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::vector<char> mb(1 << 20, 'x');
    // RocksDB resumes once the free space exceeds its write buffer (64 MiB);
    // a flush cut short by the full disk may hold some of the space freed.
    for (int i = 0; i < 300; ++i) ASSERT_EQ(std::fwrite(mb.data(), 1, mb.size(), f), mb.size());
    std::fclose(f);
  }
  RocksDbColdTierOptions o;
  o.path = dir + "/db";
  o.codec = ColdCodec::kNone;
  o.resume_interval = absl::Milliseconds(1);
  auto t = RocksDbColdTier::Open(o);
  ASSERT_TRUE(t.ok()) << t.status();
  const size_t kBlock = 256 << 10;
  auto info = [&](uint64_t i, const std::vector<uint8_t>& p) {
    ColdBlockInfo in = InfoFor(i, p);
    in.meta.layout = BlockLayout{16, 16, 8, 64, DType::kF16};  // 256 KiB
    return in;
  };
  uint64_t written = 0;
  absl::Status full;
  for (uint64_t i = 0; i < 2000; ++i) {
    const std::vector<uint8_t> p = PayloadFor(KeyOf(i), kBlock);
    full = (*t)->Write(info(i, p), p);
    if (!full.ok()) break;
    ++written;
  }
  ASSERT_FALSE(full.ok()) << "the tmpfs never filled";
  ASSERT_GT(written, 0u);
  EXPECT_TRUE(full.code() == absl::StatusCode::kResourceExhausted || full.code() == absl::StatusCode::kUnavailable)
      << full;
  // Reads go on.
  ColdBlockInfo got;
  std::vector<uint8_t> payload;
  ASSERT_TRUE((*t)->Read(ScopedKey{3, KeyOf(0)}, &got, &payload).ok());
  EXPECT_EQ(payload, PayloadFor(KeyOf(0), kBlock));
  // Still full: still refused.
  {
    const std::vector<uint8_t> p = PayloadFor(KeyOf(500), kBlock);
    EXPECT_FALSE((*t)->Write(info(500, p), p).ok());
  }
  // Space returns: writes resume without a restart.
  std::filesystem::remove(dir + "/filler");
  absl::SleepFor(absl::Milliseconds(5));
  // (RocksDB's own recovery watches the free space every few seconds.)
  absl::Status again;
  for (int attempt = 0; attempt < 300; ++attempt) {
    const std::vector<uint8_t> p = PayloadFor(KeyOf(600), kBlock);
    again = (*t)->Write(info(600, p), p);
    if (again.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(again.ok()) << again;
  ASSERT_TRUE((*t)->Read(ScopedKey{3, KeyOf(600)}, &got, &payload).ok());
  EXPECT_EQ(payload, PayloadFor(KeyOf(600), kBlock));
}

}  // namespace
}  // namespace kvring
