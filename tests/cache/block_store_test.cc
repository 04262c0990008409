#include "kvring/cache/block_store.h"

#include <map>

#include "gtest/gtest.h"
#include "store_test_util.h"

namespace kvring {
namespace {

using testing::ArgsFor;
using testing::KeyOf;
using testing::PayloadFor;
using testing::SmallLayout;

constexpr size_t kBlock = 256;

std::unique_ptr<BlockStore> MakeStore(size_t pages, std::unique_ptr<ColdTier> cold = nullptr) {
  BlockStoreOptions o;
  o.page_bytes = kBlock;
  o.num_pages = pages;
  auto s = BlockStore::Create(o, std::move(cold));
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

absl::Status PutBlock(BlockStore& s, uint64_t i, NamespaceId ns = 1, TenantId t = 1, bool pin = false) {
  PutArgs a = ArgsFor(i, ns, t);
  a.pin = pin;
  auto r = s.Put(a, PayloadFor(a.key, kBlock));
  return r.status();
}

TEST(BlockStoreTest, PutThenReadReturnsTheSameBytes) {
  auto s = MakeStore(8);
  ASSERT_TRUE(PutBlock(*s, 0).ok());
  std::vector<uint8_t> out(kBlock);
  BlockMeta meta;
  ASSERT_TRUE(s->Read(1, KeyOf(0), absl::MakeSpan(out), &meta).ok());
  EXPECT_EQ(out, PayloadFor(KeyOf(0), kBlock));
  EXPECT_EQ(meta.payload_bytes, kBlock);
  EXPECT_EQ(meta.checksum, PayloadChecksum(out.data(), out.size()));
  EXPECT_EQ(meta.owner, 1u);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

TEST(BlockStoreTest, SecondPutOfAKeyIsDeduplicated) {
  auto s = MakeStore(8);
  PutArgs a = ArgsFor(0);
  auto r1 = s->Put(a, PayloadFor(a.key, kBlock));
  auto r2 = s->Put(a, PayloadFor(a.key, kBlock));
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_TRUE(r1->inserted);
  EXPECT_FALSE(r2->inserted);
  EXPECT_EQ(s->stats().blocks, 1u);
  EXPECT_EQ(s->stats().free_pages, 7u);
}

TEST(BlockStoreTest, LookupPrefixCountsTheHeldChain) {
  auto s = MakeStore(64);
  for (uint64_t i = 0; i < 20; ++i) ASSERT_TRUE(PutBlock(*s, i).ok());
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < 30; ++i) keys.push_back(KeyOf(i));
  EXPECT_EQ(s->LookupPrefix(1, keys), 20u);
  ASSERT_TRUE(s->Erase(1, KeyOf(12)).ok());
  EXPECT_EQ(s->LookupPrefix(1, keys), 12u);
}

TEST(BlockStoreTest, EvictsInLruOrderWhenFull) {
  auto s = MakeStore(4);
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(PutBlock(*s, i, 1, 1).ok());
  // Touch 0 and 1: 2 becomes least recent.
  for (uint64_t i : {0, 1}) ASSERT_TRUE(s->Acquire(1, KeyOf(i)).ok());
  ASSERT_TRUE(PutBlock(*s, 100).ok());
  EXPECT_EQ(s->Acquire(1, KeyOf(2)).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(PutBlock(*s, 101).ok());
  EXPECT_EQ(s->Acquire(1, KeyOf(3)).status().code(), absl::StatusCode::kNotFound);
  for (uint64_t i : {0, 1, 100, 101}) EXPECT_TRUE(s->Acquire(1, KeyOf(i)).ok()) << i;
  EXPECT_EQ(s->stats().drops, 2u);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

TEST(BlockStoreTest, PinnedAndReadHeldBlocksAreNeverEvicted) {
  auto s = MakeStore(3);
  ASSERT_TRUE(PutBlock(*s, 0, 1, 1, /*pin=*/true).ok());
  ASSERT_TRUE(PutBlock(*s, 1).ok());
  auto held = s->Acquire(1, KeyOf(1));  // a reader holds block 1
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(PutBlock(*s, 2).ok());
  // Only block 2 is evictable; each new put replaces the previous newcomer.
  for (uint64_t i = 3; i < 10; ++i) ASSERT_TRUE(PutBlock(*s, i).ok());
  EXPECT_TRUE(s->Acquire(1, KeyOf(0)).ok());
  EXPECT_EQ(held->payload()[0], PayloadFor(KeyOf(1), kBlock)[0]);
  EXPECT_TRUE(s->Acquire(1, KeyOf(1)).ok());
  // Pin the third page as well: now nothing can be evicted.
  ASSERT_TRUE(s->Pin(1, 1, KeyOf(9)).ok());
  absl::Status full = PutBlock(*s, 50);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("pinned"), std::string::npos) << full;
  EXPECT_TRUE(s->CheckInvariants().ok());
}

TEST(BlockStoreTest, PinnedQuotaIsEnforcedPerTenant) {
  auto s = MakeStore(16);
  s->SetTenantQuota(1, TenantQuota{.max_pinned_bytes = 2 * kBlock});
  ASSERT_TRUE(PutBlock(*s, 0, 1, 1, true).ok());
  ASSERT_TRUE(PutBlock(*s, 1, 1, 1, true).ok());
  absl::Status over = PutBlock(*s, 2, 1, 1, true);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("quota"), std::string::npos);
  EXPECT_EQ(s->Acquire(1, KeyOf(2)).status().code(), absl::StatusCode::kNotFound);  // nothing stored
  // Pinning an existing block counts too; another tenant is unaffected.
  ASSERT_TRUE(PutBlock(*s, 3).ok());
  EXPECT_EQ(s->Pin(1, 1, KeyOf(3)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(s->Pin(2, 1, KeyOf(3)).ok());
  EXPECT_EQ(s->GetTenantUsage(1).pinned_bytes, 2 * kBlock);
  ASSERT_TRUE(s->Unpin(1, 1, KeyOf(0)).ok());
  EXPECT_TRUE(s->Pin(1, 1, KeyOf(3)).ok());
}

TEST(BlockStoreTest, DoubleUnpinAndUnknownKeysAreErrors) {
  auto s = MakeStore(4);
  ASSERT_TRUE(PutBlock(*s, 0, 1, 1, true).ok());
  ASSERT_TRUE(s->Unpin(1, 1, KeyOf(0)).ok());
  EXPECT_EQ(s->Unpin(1, 1, KeyOf(0)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s->Unpin(1, 1, KeyOf(77)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s->Pin(1, 1, KeyOf(77)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s->Erase(1, KeyOf(77)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s->GetTenantUsage(1).pinned_bytes, 0u);
}

TEST(BlockStoreTest, NamespacesAreSeparate) {
  auto s = MakeStore(8);
  ASSERT_TRUE(PutBlock(*s, 0, /*ns=*/10, /*tenant=*/1).ok());
  // Same key, other namespace: a miss, and it can be stored independently.
  EXPECT_EQ(s->Acquire(20, KeyOf(0)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s->LookupPrefix(20, std::vector<BlockKey>{KeyOf(0)}), 0u);
  ASSERT_TRUE(PutBlock(*s, 0, 20, 2).ok());
  EXPECT_EQ(s->stats().blocks, 2u);
  auto a = s->Acquire(10, KeyOf(0));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->meta().owner, 1u);
}

TEST(BlockStoreTest, MalformedPutsAreRejectedAndChangeNothing) {
  auto s = MakeStore(4);
  PutArgs a = ArgsFor(0);
  EXPECT_EQ(s->Put(a, std::vector<uint8_t>(100)).status().code(), absl::StatusCode::kInvalidArgument);
  PutArgs zero = a;
  zero.key = BlockKey{};
  EXPECT_EQ(s->Put(zero, PayloadFor(a.key, kBlock)).status().code(), absl::StatusCode::kInvalidArgument);
  PutArgs bad_layout = a;
  bad_layout.meta.layout.head_dim = 0;
  EXPECT_EQ(s->Put(bad_layout, PayloadFor(a.key, kBlock)).status().code(), absl::StatusCode::kInvalidArgument);
  PutArgs big = a;
  big.meta.layout.block_tokens = 8;  // 512 bytes > 256-byte pages
  EXPECT_EQ(s->Put(big, std::vector<uint8_t>(512)).status().code(), absl::StatusCode::kInvalidArgument);
  PutArgs corrupt = a;
  auto payload = PayloadFor(a.key, kBlock);
  corrupt.meta.checksum = PayloadChecksum(payload.data(), payload.size()) ^ 1;
  EXPECT_EQ(s->Put(corrupt, payload).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s->stats().blocks, 0u);
  EXPECT_EQ(s->stats().free_pages, 4u);
  std::vector<uint8_t> small(10);
  ASSERT_TRUE(PutBlock(*s, 0).ok());
  EXPECT_EQ(s->Read(1, KeyOf(0), absl::MakeSpan(small), nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST(BlockStoreTest, EraseWhileReadHeldFreesThePageAtRelease) {
  auto s = MakeStore(2);
  ASSERT_TRUE(PutBlock(*s, 0).ok());
  auto h = s->Acquire(1, KeyOf(0));
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(s->Erase(1, KeyOf(0)).ok());
  EXPECT_EQ(s->stats().free_pages, 1u);  // still held by the reader
  EXPECT_EQ(h->payload()[3], PayloadFor(KeyOf(0), kBlock)[3]);
  h->Release();
  EXPECT_EQ(s->stats().free_pages, 2u);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

TEST(BlockStoreTest, PinnedBlocksCannotBeErased) {
  auto s = MakeStore(2);
  ASSERT_TRUE(PutBlock(*s, 0, 1, 1, true).ok());
  EXPECT_EQ(s->Erase(1, KeyOf(0)).code(), absl::StatusCode::kFailedPrecondition);
}

// An in-memory cold tier, to test the demotion paths of the store alone
// (the RocksDB tier has its own tests).
class MapColdTier : public ColdTier {
 public:
  absl::Status Write(const ColdBlockInfo& info, absl::Span<const uint8_t> payload) override {
    if (fail_writes) return absl::ResourceExhaustedError("disk full");
    data[info.key.key] = {info, std::vector<uint8_t>(payload.begin(), payload.end())};
    return absl::OkStatus();
  }
  absl::Status Read(const ScopedKey& key, ColdBlockInfo* info, std::vector<uint8_t>* payload) override {
    auto it = data.find(key.key);
    if (it == data.end()) return absl::NotFoundError("absent");
    *info = it->second.first;
    *payload = it->second.second;
    if (corrupt_reads) (*payload)[0] ^= 0xff;
    return absl::OkStatus();
  }
  absl::Status Erase(const ScopedKey& key) override {
    data.erase(key.key);
    return absl::OkStatus();
  }
  absl::Status Scan(const std::function<void(const ColdBlockInfo&)>& visit) override {
    for (auto& [k, v] : data) visit(v.first);
    return absl::OkStatus();
  }
  ColdTierStats stats() const override { return {}; }
  std::map<BlockKey, std::pair<ColdBlockInfo, std::vector<uint8_t>>> data;
  bool fail_writes = false;
  bool corrupt_reads = false;
};

TEST(BlockStoreTest, EvictionDemotesToTheColdTierAndHitsPromote) {
  auto cold = std::make_unique<MapColdTier>();
  MapColdTier* c = cold.get();
  auto s = MakeStore(2, std::move(cold));
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(PutBlock(*s, i).ok());
  EXPECT_EQ(c->data.size(), 3u);  // 0, 1, 2 demoted
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < 5; ++i) keys.push_back(KeyOf(i));
  EXPECT_EQ(s->LookupPrefix(1, keys), 5u);  // cold blocks count as held
  std::vector<uint8_t> out(kBlock);
  ASSERT_TRUE(s->Read(1, KeyOf(0), absl::MakeSpan(out), nullptr).ok());
  EXPECT_EQ(out, PayloadFor(KeyOf(0), kBlock));
  EXPECT_EQ(s->stats().promotions, 1u);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

// A read of more cold blocks than there are host pages, all held at once
// (as a zero-copy reply holds them): the blocks past the last free page come
// as copies of their own, and every payload is right.
TEST(BlockStoreTest, HoldingMoreColdBlocksThanHostPagesWorks) {
  auto s = MakeStore(2, std::make_unique<MapColdTier>());
  for (uint64_t i = 0; i < 12; ++i) ASSERT_TRUE(PutBlock(*s, i).ok());  // 0..9 cold
  std::vector<PinnedBlock> held;
  for (uint64_t i = 0; i < 12; ++i) {
    absl::StatusOr<PinnedBlock> b = s->Acquire(1, KeyOf(i));
    ASSERT_TRUE(b.ok()) << "block " << i << ": " << b.status();
    held.push_back(std::move(*b));
  }
  for (uint64_t i = 0; i < 12; ++i) {
    ASSERT_TRUE(held[i].valid());
    EXPECT_EQ(std::vector<uint8_t>(held[i].payload().begin(), held[i].payload().end()), PayloadFor(KeyOf(i), kBlock))
        << "block " << i;
  }
  EXPECT_GT(s->stats().unpromoted_reads, 0u);
  std::vector<PinnedBlock> moved = std::move(held);  // payload views survive moves
  EXPECT_EQ(std::vector<uint8_t>(moved[0].payload().begin(), moved[0].payload().end()), PayloadFor(KeyOf(0), kBlock));
  moved.clear();
  EXPECT_EQ(s->stats().free_pages + s->stats().host_blocks, 2u);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

// InMemoryOrAbsent: what lets the UCX data plane serve a Get on its own
// thread (no disk read there).
TEST(BlockStoreTest, InMemoryOrAbsentSeesColdBlocks) {
  auto s = MakeStore(2, std::make_unique<MapColdTier>());
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(PutBlock(*s, i).ok());  // 0 demoted; 1, 2 in memory
  const BlockKey cold = KeyOf(0), hot = KeyOf(2), absent = KeyOf(99);
  EXPECT_TRUE(s->InMemoryOrAbsent(1, {hot}));
  EXPECT_TRUE(s->InMemoryOrAbsent(1, {hot, absent}));
  EXPECT_FALSE(s->InMemoryOrAbsent(1, {cold}));
  EXPECT_FALSE(s->InMemoryOrAbsent(1, {hot, cold}));
  EXPECT_TRUE(s->InMemoryOrAbsent(2, {cold}));  // another namespace does not hold it
  std::vector<uint8_t> out(kBlock);
  ASSERT_TRUE(s->Read(1, cold, absl::MakeSpan(out), nullptr).ok());  // promoted (1 demoted in its place)
  EXPECT_TRUE(s->InMemoryOrAbsent(1, {cold}));
  EXPECT_FALSE(s->InMemoryOrAbsent(1, {KeyOf(1)}));
}

// A cold tier that cannot take a demotion (disk full) must not stop the
// host tier: the victim is dropped as it would be without a cold tier, puts
// go on, and demotions resume by themselves when the cold tier takes writes
// again.
TEST(BlockStoreTest, ColdWriteFailureDropsTheVictimAndPutsGoOn) {
  auto cold = std::make_unique<MapColdTier>();
  MapColdTier* c = cold.get();
  auto s = MakeStore(2, std::move(cold));
  ASSERT_TRUE(PutBlock(*s, 0).ok());
  ASSERT_TRUE(PutBlock(*s, 1).ok());
  c->fail_writes = true;
  for (uint64_t i = 2; i < 6; ++i) ASSERT_TRUE(PutBlock(*s, i).ok()) << i;
  EXPECT_EQ(s->stats().demotion_errors, 4u);
  EXPECT_EQ(s->stats().drops, 4u);
  EXPECT_TRUE(c->data.empty());
  std::vector<uint8_t> out(kBlock);
  for (uint64_t i : {4, 5}) {  // the newest stay, intact
    ASSERT_TRUE(s->Read(1, KeyOf(i), absl::MakeSpan(out), nullptr).ok());
    EXPECT_EQ(out, PayloadFor(KeyOf(i), kBlock));
  }
  EXPECT_EQ(s->Acquire(1, KeyOf(0)).status().code(), absl::StatusCode::kNotFound);  // dropped, never wrong
  c->fail_writes = false;
  ASSERT_TRUE(PutBlock(*s, 6).ok());
  EXPECT_EQ(s->stats().demotions, 1u);  // space is back: demoted again
  EXPECT_EQ(c->data.size(), 1u);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

TEST(BlockStoreTest, CorruptColdBlockIsDataLossNeverServed) {
  auto cold = std::make_unique<MapColdTier>();
  MapColdTier* c = cold.get();
  auto s = MakeStore(1, std::move(cold));
  ASSERT_TRUE(PutBlock(*s, 0).ok());
  ASSERT_TRUE(PutBlock(*s, 1).ok());  // demotes 0
  c->corrupt_reads = true;
  EXPECT_EQ(s->Acquire(1, KeyOf(0)).status().code(), absl::StatusCode::kDataLoss);
}

TEST(BlockStoreTest, RecoversTheColdTierIndexAtCreate) {
  auto cold = std::make_unique<MapColdTier>();
  for (uint64_t i = 0; i < 3; ++i) {
    ColdBlockInfo info;
    info.key = ScopedKey{1, KeyOf(i)};
    info.parent = i == 0 ? BlockKey{} : KeyOf(i - 1);
    info.meta.layout = SmallLayout();
    auto p = PayloadFor(KeyOf(i), kBlock);
    info.meta.payload_bytes = kBlock;
    info.meta.checksum = PayloadChecksum(p.data(), p.size());
    ASSERT_TRUE(cold->Write(info, p).ok());
  }
  auto s = MakeStore(4, std::move(cold));
  EXPECT_EQ(s->stats().cold_only_blocks, 3u);
  EXPECT_EQ(s->LookupPrefix(1, std::vector<BlockKey>{KeyOf(0), KeyOf(1), KeyOf(2)}), 3u);
  std::vector<uint8_t> out(kBlock);
  ASSERT_TRUE(s->Read(1, KeyOf(2), absl::MakeSpan(out), nullptr).ok());
  EXPECT_EQ(out, PayloadFor(KeyOf(2), kBlock));
}

}  // namespace
}  // namespace kvring
