// ShardRing: where blocks live, computed identically by clients, daemons and
// the coordinator from one versioned ShardMap.
//
// Consistent hashing with virtual nodes: every node owns `virtual_nodes`
// points on a 64-bit ring at XXH3-64("<node_id>#<i>"); a block key sits at
// key.hi (already uniform); its preference list is the distinct nodes met
// walking clockwise. Writes go to the first `replication` UP nodes of the
// list; reads try the list in order, UP nodes first. A node joining or
// leaving moves only the keys next to its points.
//
// Attention sequences are placed by sequence, in contiguous chunks of
// `sequence_chunk_blocks` blocks; chunk c of sequence s sits at
// XXH3-64("<namespace>/<s>/<c>") on the same ring.
//
// Immutable after construction; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvring.pb.h"
#include "kvring/cache/block_key.h"

namespace kvring {

class ShardRing {
 public:
  ShardRing() = default;
  explicit ShardRing(const v1::ShardMap& map);

  uint64_t version() const { return map_.version(); }
  const v1::ShardMap& map() const { return map_; }
  int num_nodes() const { return map_.nodes_size(); }
  const v1::NodeInfo& node(int i) const { return map_.nodes(i); }
  bool up(int i) const { return map_.nodes(i).state() == v1::NodeInfo::UP; }
  int replication() const { return static_cast<int>(std::max<uint32_t>(1, map_.replication())); }
  int write_quorum() const;
  uint32_t chunk_blocks() const { return std::max<uint32_t>(1, map_.sequence_chunk_blocks()); }

  // All nodes in preference order for a ring position (each once).
  std::vector<int> PreferenceList(uint64_t position) const;
  // The first replication() UP nodes for the position.
  std::vector<int> WriteTargets(uint64_t position) const;
  // Every node, UP ones first, both in preference order.
  std::vector<int> ReadCandidates(uint64_t position) const;

  // Whether `map` places and routes every position as this ring does: the
  // same nodes (ids, addresses, incarnations, states) in the same order and
  // the same replication, write quorum, virtual nodes and chunk size. What
  // only reports (capacities, heartbeat times) is not compared.
  bool RoutesLike(const v1::ShardMap& map) const;

  static uint64_t KeyPosition(const BlockKey& key) { return key.hi; }
  static uint64_t ChunkPosition(std::string_view ns, std::string_view sequence_id, uint64_t chunk);

 private:
  v1::ShardMap map_;
  std::vector<std::pair<uint64_t, int>> points_;  // sorted by position
};

}  // namespace kvring
