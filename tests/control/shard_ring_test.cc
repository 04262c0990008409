#include "kvring/protocol/shard_ring.h"

#include <map>
#include <memory>
#include <random>
#include <set>

#include "gtest/gtest.h"
#include "kvring/protocol/chunk_routes.h"

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

// What a client's map refresh may keep its ring (and its cached routes)
// across: a map that differs only in what reports, not in how it routes.
TEST(ShardRingTest, RoutesLikeComparesWhatRoutesAndIgnoresWhatOnlyReports) {
  const ShardRing ring(MapOf(4, 2));
  v1::ShardMap same = MapOf(4, 2);
  same.set_version(9);
  same.mutable_nodes(1)->set_last_heartbeat_unix_ms(123456);
  same.mutable_nodes(2)->set_capacity_bytes(1 << 30);
  EXPECT_TRUE(ring.RoutesLike(same));
  EXPECT_FALSE(ring.RoutesLike(MapOf(4, 2, {3})));  // a node down
  EXPECT_FALSE(ring.RoutesLike(MapOf(5, 2)));       // a node more
  EXPECT_FALSE(ring.RoutesLike(MapOf(4, 3)));       // replication
  v1::ShardMap m = MapOf(4, 2);
  m.mutable_nodes(0)->set_incarnation(2);  // re-registered
  EXPECT_FALSE(ring.RoutesLike(m));
  m = MapOf(4, 2);
  m.mutable_nodes(0)->set_ucx_address("10.0.0.9:7000");
  EXPECT_FALSE(ring.RoutesLike(m));
  m = MapOf(4, 2);
  m.set_sequence_chunk_blocks(32);
  EXPECT_FALSE(ring.RoutesLike(m));
  m = MapOf(4, 2);
  m.set_write_quorum(1);
  EXPECT_FALSE(ring.RoutesLike(m));
}

// ChunkRoutes against computing every chunk's candidates afresh: the same
// nodes for growing sequences, forks (a placement) and a changed map, and
// what it returned earlier is not changed by later calls.
TEST(ChunkRoutesTest, RoutesAreTheRingsCandidatesAcrossGrowthForksAndMapChanges) {
  auto fresh = [](const ShardRing& ring, const std::string& id, const SequencePlacement& p, uint64_t c) {
    return ring.ReadCandidates(ShardRing::ChunkPosition("tenant/7", p.PlacedAs(id, c), c));
  };
  auto check = [&](const ChunkRoutes::Route& r, const ShardRing& ring, const std::string& id,
                   const SequencePlacement& p, uint64_t chunks) {
    ASSERT_GE(r.chunks, chunks);
    for (uint64_t c = 0; c < chunks; ++c) {
      const auto want = fresh(ring, id, p, c);
      const auto got = r.candidates(c);
      ASSERT_EQ(std::vector<int>(got.begin(), got.end()), want) << id << " chunk " << c;
    }
  };
  ChunkRoutes routes(/*capacity=*/3);
  auto ring = std::make_shared<const ShardRing>(MapOf(5, 2));
  const SequencePlacement own;
  auto a4 = routes.Get(ring, "tenant/7", "a", own, 4);
  check(*a4, *ring, "a", own, 4);
  // Held: the same object while it covers the chunks asked for.
  EXPECT_EQ(routes.Get(ring, "tenant/7", "a", own, 3), a4);
  auto a9 = routes.Get(ring, "tenant/7", "a", own, 9);
  check(*a9, *ring, "a", own, 9);
  check(*a4, *ring, "a", own, 4);  // an earlier route is unchanged
  EXPECT_EQ(a4->chunks, 4u);
  // A fork sharing a's first 3 chunks is routed by a there, by its own id after.
  auto forked = own.Fork("a", 3);
  ASSERT_TRUE(forked.ok()) << forked.status();
  auto b = routes.Get(ring, "tenant/7", "b", *forked, 6);
  check(*b, *ring, "b", *forked, 6);
  for (uint64_t c = 0; c < 3; ++c) EXPECT_EQ(b->candidates(c), a9->candidates(c));
  // The same id with another placement (b forked again from elsewhere) is recomputed.
  auto refork = own.Fork("c", 1);
  ASSERT_TRUE(refork.ok());
  auto b2 = routes.Get(ring, "tenant/7", "b", *refork, 6);
  EXPECT_NE(b2, b);
  check(*b2, *ring, "b", *refork, 6);
  // A new map (a node down) recomputes: the down node goes last.
  auto ring2 = std::make_shared<const ShardRing>(MapOf(5, 2, {fresh(*ring, "a", own, 0)[0]}));
  auto a_new = routes.Get(ring2, "tenant/7", "a", own, 2);
  EXPECT_NE(a_new->ring, ring);
  check(*a_new, *ring2, "a", own, 2);
  EXPECT_EQ(a_new->candidates(0).back(), fresh(*ring, "a", own, 0)[0]);
  // Bounded: a fourth sequence in a cache of 3 starts it over; routes are still right.
  auto d = routes.Get(ring2, "tenant/7", "d", own, 2);
  routes.Get(ring2, "tenant/7", "e", own, 1);
  EXPECT_LE(routes.size(), 3u);
  check(*routes.Get(ring2, "tenant/7", "a", own, 5), *ring2, "a", own, 5);
  check(*d, *ring2, "d", own, 2);
  routes.Forget("a");
  routes.Forget("a");  // idempotent
  EXPECT_LE(routes.size(), 2u);
}

}  // namespace
}  // namespace kvring
