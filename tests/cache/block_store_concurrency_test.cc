// Many threads put, read, look up, pin and unpin over a shared key space on a
// store small enough to evict constantly; every byte read must match the key
// it was read under, and the store's accounting must add up afterwards.
#include <atomic>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "kvring/cache/block_store.h"
#include "store_test_util.h"

namespace kvring {
namespace {

using testing::ArgsFor;
using testing::KeyOf;
using testing::PayloadFor;

constexpr size_t kBlock = 256;

void RunMixedLoad(BlockStore& store, int threads, int ops_per_thread, std::atomic<int>& corrupt,
                  std::atomic<int>& unexpected) {
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      const TenantId tenant = 1 + t % 3;
      const NamespaceId ns = 1 + t % 2;
      std::vector<uint64_t> my_pins;
      std::vector<uint8_t> buf(kBlock);
      for (int i = 0; i < ops_per_thread; ++i) {
        const uint64_t k = rng() % 200;
        switch (rng() % 6) {
          case 0:
          case 1: {
            PutArgs a = ArgsFor(k, ns, tenant);
            auto r = store.Put(a, PayloadFor(a.key, kBlock));
            if (!r.ok() && !absl::IsResourceExhausted(r.status())) ++unexpected;
            break;
          }
          case 2: {
            BlockMeta meta;
            absl::Status s = store.Read(ns, KeyOf(k), absl::MakeSpan(buf), &meta);
            if (s.ok() && buf != PayloadFor(KeyOf(k), kBlock)) ++corrupt;
            if (!s.ok() && !absl::IsNotFound(s)) ++unexpected;
            break;
          }
          case 3: {
            std::vector<BlockKey> keys;
            for (uint64_t j = 0; j < 32; ++j) keys.push_back(KeyOf(j));
            if (store.LookupPrefix(ns, keys) > keys.size()) ++unexpected;
            break;
          }
          case 4: {
            if (my_pins.size() < 4) {
              absl::Status s = store.Pin(tenant, ns, KeyOf(k));
              if (s.ok())
                my_pins.push_back(k);
              else if (!absl::IsNotFound(s))
                ++unexpected;
            }
            break;
          }
          case 5: {
            if (!my_pins.empty()) {
              absl::Status s = store.Unpin(tenant, ns, KeyOf(my_pins.back()));
              if (!s.ok()) ++unexpected;
              my_pins.pop_back();
            }
            break;
          }
        }
      }
      for (uint64_t k : my_pins) {
        if (!store.Unpin(tenant, ns, KeyOf(k)).ok()) ++unexpected;
      }
    });
  }
  for (auto& t : ts) t.join();
}

class BlockStoreConcurrencyTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BlockStoreConcurrencyTest, ManyThreadsKeepBytesAndAccountingIntact) {
  BlockStoreOptions o;
  o.page_bytes = kBlock;
  o.num_pages = 64;  // far fewer than the 400 distinct (ns, key) pairs
  o.eviction_policy = GetParam();
  auto store = BlockStore::Create(o);
  ASSERT_TRUE(store.ok());
  std::atomic<int> corrupt{0}, unexpected{0};
  RunMixedLoad(**store, 8, 20000, corrupt, unexpected);
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_EQ(unexpected.load(), 0);
  ASSERT_TRUE((*store)->CheckInvariants().ok()) << (*store)->CheckInvariants();
  const BlockStoreStats st = (*store)->stats();
  EXPECT_EQ(st.pinned_blocks, 0u);
  EXPECT_EQ(st.host_blocks + st.free_pages, st.num_pages);
  EXPECT_GT(st.evictions, 0u);
  for (TenantId t = 1; t <= 3; ++t) EXPECT_EQ((*store)->GetTenantUsage(t).pinned_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Policies, BlockStoreConcurrencyTest, ::testing::Values("lru", "s3fifo", "arc", "leaf-lru"));

}  // namespace
}  // namespace kvring
