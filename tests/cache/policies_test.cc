#include "kvring/cache/policies.h"

#include <random>
#include <set>

#include "gtest/gtest.h"
#include "kvring/cache/block_store.h"
#include "store_test_util.h"

namespace kvring {
namespace {

using testing::ArgsFor;
using testing::KeyOf;
using testing::PayloadFor;

std::unique_ptr<BlockStore> Store(const std::string& policy, size_t pages) {
  BlockStoreOptions o;
  o.page_bytes = 256;
  o.num_pages = pages;
  o.eviction_policy = policy;
  return std::move(BlockStore::Create(o).value());
}

class EveryPolicyTest : public ::testing::TestWithParam<std::string> {};

// Pinned blocks are never evicted, whatever the traffic.
TEST_P(EveryPolicyTest, PinnedBlocksAreNeverEvicted) {
  auto s = Store(GetParam(), 16);
  std::mt19937_64 rng(7);
  std::set<uint64_t> pinned;
  for (uint64_t i = 0; i < 6; ++i) {
    PutArgs a = ArgsFor(1000 + i, 1, 1, true);
    a.pin = true;
    ASSERT_TRUE(s->Put(a, PayloadFor(a.key, 256)).ok());
    pinned.insert(1000 + i);
  }
  for (int step = 0; step < 3000; ++step) {
    const uint64_t k = rng() % 200;
    PutArgs a = ArgsFor(k);
    if (rng() % 3 == 0) {
      (void)s->Acquire(1, KeyOf(k));
    } else {
      auto r = s->Put(a, PayloadFor(a.key, 256));
      ASSERT_TRUE(r.ok() || absl::IsResourceExhausted(r.status())) << r.status();
    }
    if (step % 500 == 0) {
      for (uint64_t p : pinned)
        ASSERT_TRUE(s->Acquire(1, KeyOf(p)).ok()) << GetParam() << " evicted pinned block " << p;
    }
  }
  for (uint64_t p : pinned) EXPECT_TRUE(s->Acquire(1, KeyOf(p)).ok());
  EXPECT_GT(s->stats().evictions, 0u);
  ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
}

// A tier whose every block is pinned or read-held reports itself full
// instead of evicting one.
TEST_P(EveryPolicyTest, AFullyHeldTierRefusesNewBlocks) {
  auto s = Store(GetParam(), 4);
  for (uint64_t i = 0; i < 4; ++i) {
    PutArgs a = ArgsFor(i, 1, 1, true);
    a.pin = true;
    ASSERT_TRUE(s->Put(a, PayloadFor(a.key, 256)).ok());
  }
  PutArgs a = ArgsFor(99);
  EXPECT_EQ(s->Put(a, PayloadFor(a.key, 256)).status().code(), absl::StatusCode::kResourceExhausted);
}

INSTANTIATE_TEST_SUITE_P(Policies, EveryPolicyTest, ::testing::Values("lru", "s3fifo", "arc", "leaf-lru"));

// A block read twice survives a long scan of one-time blocks under the
// scan-resistant policies; plain LRU loses it.
TEST(PoliciesTest, S3FifoAndArcResistScansThatFlushLru) {
  for (const std::string policy : {"lru", "s3fifo", "arc"}) {
    auto s = Store(policy, 20);
    for (uint64_t hot = 0; hot < 5; ++hot) {
      PutArgs a = ArgsFor(hot, 1, 1, true);
      ASSERT_TRUE(s->Put(a, PayloadFor(a.key, 256)).ok());
    }
    for (int round = 0; round < 3; ++round) {
      for (uint64_t hot = 0; hot < 5; ++hot) ASSERT_TRUE(s->Acquire(1, KeyOf(hot)).ok());
    }
    for (uint64_t scan = 100; scan < 160; ++scan) {  // 60 blocks, each used once
      PutArgs a = ArgsFor(scan, 1, 1, true);
      ASSERT_TRUE(s->Put(a, PayloadFor(a.key, 256)).ok());
    }
    int survived = 0;
    for (uint64_t hot = 0; hot < 5; ++hot) survived += s->Acquire(1, KeyOf(hot)).ok();
    if (policy == "lru") {
      EXPECT_EQ(survived, 0) << "LRU keeps the most recent blocks only";
    } else {
      EXPECT_EQ(survived, 5) << policy << " should keep the frequently used blocks";
    }
  }
}

// leaf-lru never evicts a block while one of its children is resident.
TEST(PoliciesTest, LeafLruEvictsChildrenBeforeParents) {
  auto s = Store("leaf-lru", 32);
  std::mt19937_64 rng(3);
  // Chains: blocks c*100 + 0..19, each the parent of the next.
  for (int step = 0; step < 2000; ++step) {
    const uint64_t chain = rng() % 6, len = 1 + rng() % 20;
    for (uint64_t i = 0; i < len; ++i) {
      PutArgs a;
      a.tenant = 1;
      a.ns = 1;
      a.key = KeyOf(chain * 100 + i);
      a.parent = i == 0 ? BlockKey{} : KeyOf(chain * 100 + i - 1);
      a.meta.layout = testing::SmallLayout();
      ASSERT_TRUE(s->Put(a, PayloadFor(a.key, 256)).ok());
    }
    // Invariant: for every resident block, its parent is resident.
    for (uint64_t c = 0; c < 6; ++c) {
      bool missing = false;
      for (uint64_t i = 0; i < 20; ++i) {
        const bool held = s->Contains(1, std::vector<BlockKey>{KeyOf(c * 100 + i)})[0];
        if (!held) missing = true;
        ASSERT_FALSE(held && missing) << "step " << step << ": block " << i << " of chain " << c
                                      << " is resident without its parent";
      }
    }
  }
  EXPECT_GT(s->stats().evictions, 0u);
}

TEST(PoliciesTest, FactoryListsEveryPolicy) {
  for (const auto& n : EvictionPolicyNames()) EXPECT_TRUE(MakeEvictionPolicy(n, 8).ok()) << n;
  EXPECT_EQ(EvictionPolicyNames().size(), 4u);
}

}  // namespace
}  // namespace kvring
