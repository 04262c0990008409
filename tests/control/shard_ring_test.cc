#include "kvring/protocol/shard_ring.h"

#include <map>
#include <random>
#include <set>

#include "gtest/gtest.h"

namespace kvring {
namespace {

v1::ShardMap MapOf(int nodes, int r, std::set<int> down = {}) {
  v1::ShardMap m;
  m.set_version(1);
  m.set_replication(r);
  m.set_virtual_nodes(64);
  for (int i = 0; i < nodes; ++i) {
    auto* n = m.add_nodes();
    n->set_node_id("node" + std::to_string(i));
    n->set_state(down.count(i) ? v1::NodeInfo::DOWN : v1::NodeInfo::UP);
  }
  return m;
}

TEST(ShardRingTest, ReplicasAreDistinctAndDeterministic) {
  ShardRing a(MapOf(5, 3)), b(MapOf(5, 3));
  std::mt19937_64 rng(1);
  for (int i = 0; i < 1000; ++i) {
    const uint64_t pos = rng();
    auto t = a.WriteTargets(pos);
    ASSERT_EQ(t.size(), 3u);
    EXPECT_EQ(std::set<int>(t.begin(), t.end()).size(), 3u);
    EXPECT_EQ(t, b.WriteTargets(pos));
    EXPECT_EQ(a.PreferenceList(pos).size(), 5u);
  }
}

TEST(ShardRingTest, LoadIsSpreadEvenly) {
  ShardRing ring(MapOf(4, 1));
  std::map<int, int> count;
  std::mt19937_64 rng(2);
  for (int i = 0; i < 40000; ++i) ++count[ring.WriteTargets(rng())[0]];
  for (auto& [n, c] : count) EXPECT_NEAR(c, 10000, 2500) << "node " << n;
}

TEST(ShardRingTest, DownNodesAreSkippedForWritesAndTriedLastForReads) {
  ShardRing ring(MapOf(4, 2, {1}));
  std::mt19937_64 rng(3);
  for (int i = 0; i < 1000; ++i) {
    const uint64_t pos = rng();
    for (int n : ring.WriteTargets(pos)) EXPECT_NE(n, 1);
    auto rc = ring.ReadCandidates(pos);
    ASSERT_EQ(rc.size(), 4u);
    EXPECT_EQ(rc.back(), 1);
  }
}

TEST(ShardRingTest, AddingANodeMovesOnlyItsShareOfKeys) {
  ShardRing four(MapOf(4, 1)), five(MapOf(5, 1));
  std::mt19937_64 rng(4);
  int moved = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const uint64_t pos = rng();
    const int a = four.WriteTargets(pos)[0], b = five.WriteTargets(pos)[0];
    if (a != b) {
      ++moved;
      EXPECT_EQ(b, 4) << "a key moved between two old nodes";
    }
  }
  EXPECT_NEAR(moved, n / 5, n / 20);
}

TEST(ShardRingTest, WriteQuorumDefaultsToReplication) {
  v1::ShardMap m = MapOf(3, 2);
  EXPECT_EQ(ShardRing(m).write_quorum(), 2);
  m.set_write_quorum(1);
  EXPECT_EQ(ShardRing(m).write_quorum(), 1);
}

}  // namespace
}  // namespace kvring
