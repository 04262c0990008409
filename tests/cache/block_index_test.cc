#include "kvring/cache/block_index.h"

#include <map>
#include <random>
#include <set>

#include "gtest/gtest.h"

namespace kvring {
namespace {

constexpr NamespaceId kNs = 7;

BlockKey K(uint64_t i) { return BlockKey{i * 0x9E3779B97F4A7C15ull + 1, i + 1}; }
ScopedKey S(uint64_t i, NamespaceId ns = kNs) { return ScopedKey{ns, K(i)}; }

std::vector<BlockKey> ChainKeys(uint64_t first, uint64_t n) {
  std::vector<BlockKey> v;
  for (uint64_t i = 0; i < n; ++i) v.push_back(K(first + i));
  return v;
}

// Inserts a chain first..first+n-1 whose first block is a sequence start.
void InsertChain(BlockIndex& idx, uint64_t first, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(idx.Insert(S(first + i), i == 0 ? BlockKey{} : K(first + i - 1), {}).ok());
  }
}

TEST(BlockIndexTest, LookupPrefixStopsAtTheFirstMissingBlock) {
  BlockIndex idx;
  InsertChain(idx, 0, 10);
  const auto keys = ChainKeys(0, 10);
  EXPECT_EQ(idx.LookupPrefix(kNs, keys), 10u);
  ASSERT_TRUE(idx.Erase(S(6)).ok());
  EXPECT_EQ(idx.LookupPrefix(kNs, keys), 6u);
  EXPECT_EQ(idx.LookupPrefixLinear(kNs, keys), 6u);
  ASSERT_TRUE(idx.Erase(S(0)).ok());
  EXPECT_EQ(idx.LookupPrefix(kNs, keys), 0u);
  EXPECT_TRUE(idx.CheckInvariants().ok());
}

TEST(BlockIndexTest, OutOfOrderInsertsAnchorWhenTheGapFills) {
  BlockIndex idx;
  for (uint64_t i : {3, 1, 4, 2}) ASSERT_TRUE(idx.Insert(S(i), K(i - 1), {}).ok());
  EXPECT_FALSE(idx.Find(S(4))->anchored);
  EXPECT_EQ(idx.LookupPrefix(kNs, ChainKeys(0, 5)), 0u);
  ASSERT_TRUE(idx.Insert(S(0), BlockKey{}, {}).ok());
  EXPECT_TRUE(idx.Find(S(4))->anchored);
  EXPECT_EQ(idx.LookupPrefix(kNs, ChainKeys(0, 6)), 5u);
  EXPECT_TRUE(idx.CheckInvariants().ok());
}

TEST(BlockIndexTest, HeldButUnanchoredTailStillCounts) {
  // A query that starts mid-chain, on a node that holds only that range.
  BlockIndex idx;
  for (uint64_t i = 5; i < 9; ++i) ASSERT_TRUE(idx.Insert(S(i), K(i - 1), {}).ok());
  EXPECT_EQ(idx.LookupPrefix(kNs, ChainKeys(5, 4)), 4u);
  EXPECT_EQ(idx.LookupPrefix(kNs, ChainKeys(5, 6)), 4u);
}

TEST(BlockIndexTest, NamespacesNeverMatch) {
  BlockIndex idx;
  InsertChain(idx, 0, 4);
  EXPECT_EQ(idx.LookupPrefix(kNs + 1, ChainKeys(0, 4)), 0u);
  EXPECT_EQ(idx.Find(S(0, kNs + 1)), nullptr);
}

TEST(BlockIndexTest, PinsAreCountedPerTenant) {
  BlockIndex idx;
  InsertChain(idx, 0, 1);
  EXPECT_TRUE(*idx.Pin(S(0), 1));   // first pin
  EXPECT_FALSE(*idx.Pin(S(0), 2));  // second tenant
  EXPECT_EQ(idx.Erase(S(0)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(idx.Unpin(S(0), 3).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(*idx.Unpin(S(0), 1));
  EXPECT_EQ(idx.Unpin(S(0), 1).status().code(), absl::StatusCode::kFailedPrecondition);  // double unpin
  EXPECT_TRUE(*idx.Unpin(S(0), 2));
  EXPECT_TRUE(idx.Erase(S(0)).ok());
  EXPECT_EQ(idx.Pin(S(0), 1).status().code(), absl::StatusCode::kNotFound);
}

TEST(BlockIndexTest, RejectsZeroKeysSelfParentsAndDuplicates) {
  BlockIndex idx;
  EXPECT_EQ(idx.Insert(ScopedKey{kNs, BlockKey{}}, {}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(idx.Insert(S(1), K(1), {}).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(idx.Insert(S(1), {}, {}).ok());
  EXPECT_EQ(idx.Insert(S(1), {}, {}).status().code(), absl::StatusCode::kAlreadyExists);
}

// Randomized model test: the index against a std::set and a linear scan, on
// a forest of chains that share prefixes (a radix tree of sessions).
TEST(BlockIndexTest, RefusesParentLinksThatCloseACycle) {
  BlockIndex idx;
  // Two blocks naming each other.
  ASSERT_TRUE(idx.Insert(S(1), K(2), {}).ok());
  absl::StatusOr<BlockIndex::Entry*> two = idx.Insert(S(2), K(1), {});
  EXPECT_EQ(two.status().code(), absl::StatusCode::kInvalidArgument) << two.status();
  EXPECT_NE(two.status().message().find("cycle"), std::string::npos) << two.status();
  // A longer loop: 10 -> 11 -> 12 -> 10 (child -> parent), put child first.
  ASSERT_TRUE(idx.Insert(S(10), K(11), {}).ok());
  ASSERT_TRUE(idx.Insert(S(11), K(12), {}).ok());
  EXPECT_EQ(idx.Insert(S(12), K(10), {}).status().code(), absl::StatusCode::kInvalidArgument);
  // The same shape without the loop is fine, and so is the same key in
  // another namespace.
  EXPECT_TRUE(idx.Insert(S(12), BlockKey{}, {}).ok());
  EXPECT_TRUE(idx.Insert(S(2, kNs + 1), K(1), {}).ok());
  EXPECT_TRUE(idx.CheckInvariants().ok());
  EXPECT_EQ(idx.size(), 5u);
}

TEST(BlockIndexTest, RandomizedAgainstReferenceModel) {
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    std::mt19937_64 rng(seed);
    // Tree: node i has parent[i] (or -1 for a root).
    const int n = 400;
    std::vector<int> parent(n, -1);
    for (int i = 1; i < n; ++i) {
      parent[i] = (rng() % 10 == 0) ? -1 : static_cast<int>(rng() % i);
    }
    auto path_to = [&](int node) {
      std::vector<int> p;
      for (int x = node; x >= 0; x = parent[x]) p.push_back(x);
      return std::vector<int>(p.rbegin(), p.rend());
    };
    BlockIndex idx;
    std::set<int> held;
    std::map<int, int> pins;
    for (int step = 0; step < 6000; ++step) {
      const int op = static_cast<int>(rng() % 10);
      const int x = static_cast<int>(rng() % n);
      const BlockKey pk = parent[x] < 0 ? BlockKey{} : K(parent[x]);
      if (op < 5) {
        auto r = idx.Insert(S(x), pk, {});
        EXPECT_EQ(r.ok(), held.insert(x).second);
      } else if (op < 8) {
        absl::Status s = idx.Erase(S(x));
        if (!held.count(x))
          EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
        else if (pins[x] > 0)
          EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
        else {
          EXPECT_TRUE(s.ok());
          held.erase(x);
        }
      } else if (op == 8) {
        if (held.count(x)) {
          ASSERT_TRUE(idx.Pin(S(x), 1).ok());
          ++pins[x];
        }
      } else {
        auto r = idx.Unpin(S(x), 1);
        EXPECT_EQ(r.ok(), held.count(x) && pins[x] > 0);
        if (r.ok()) --pins[x];
      }
      // Query: the path to a random node, or an ordered random subsequence.
      std::vector<int> path = path_to(static_cast<int>(rng() % n));
      if (rng() % 3 == 0) {
        std::vector<int> sub;
        for (int v : path) {
          if (rng() % 2) sub.push_back(v);
        }
        path = sub;
      }
      std::vector<BlockKey> q;
      for (int v : path) q.push_back(K(v));
      size_t expect = 0;
      while (expect < path.size() && held.count(path[expect])) ++expect;
      ASSERT_EQ(idx.LookupPrefix(kNs, q), expect) << "seed " << seed << " step " << step;
      ASSERT_EQ(idx.LookupPrefixLinear(kNs, q), expect);
      if (step % 500 == 0) {
        ASSERT_TRUE(idx.CheckInvariants().ok()) << idx.CheckInvariants();
      }
    }
    EXPECT_EQ(idx.size(), held.size());
    ASSERT_TRUE(idx.CheckInvariants().ok()) << idx.CheckInvariants();
  }
}

}  // namespace
}  // namespace kvring
