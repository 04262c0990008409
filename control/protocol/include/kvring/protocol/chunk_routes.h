// ChunkRoutes: the replicas of each chunk of attention sequences under one
// shard map, computed once and kept while the map and the sequence's
// placement stay, so a decode step routes by a lookup instead of hashing
// and walking the ring for every chunk of every sequence on every layer.
//
// Get(ring, ns, id, placement, chunks) returns a route holding at least
// `chunks` chunks, chunk c's nodes in ShardRing::ReadCandidates order for
// ShardRing::ChunkPosition(ns, placement.PlacedAs(id, c), c). An entry is
// keyed by its ring object (held: a freed map's address can never match a
// new one) and the placement's digest; another ring or placement recomputes
// it, and a grown sequence computes only its new chunks. What the route does
// not know is which nodes the caller suspects: it orders by the map's UP
// state alone.
//
// At most `capacity` sequences are held; when full it starts over (a
// forgotten entry costs one recompute, never a wrong route). Thread-safe;
// a returned route is immutable and stays valid after the cache changes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kvring/protocol/sequence_placement.h"
#include "kvring/protocol/shard_ring.h"

namespace kvring {

class ChunkRoutes {
 public:
  struct Route {
    std::shared_ptr<const ShardRing> ring;
    uint64_t placement_digest = 0;
    uint64_t chunks = 0;
    std::vector<int> nodes;  // chunks x ring->num_nodes(), row c = chunk c's candidates

    absl::Span<const int> candidates(uint64_t chunk) const {
      const size_t n = static_cast<size_t>(ring->num_nodes());
      return absl::MakeConstSpan(nodes).subspan(chunk * n, n);
    }
  };

  explicit ChunkRoutes(size_t capacity = size_t{1} << 16) : capacity_(capacity) {}
  ChunkRoutes(const ChunkRoutes&) = delete;
  ChunkRoutes& operator=(const ChunkRoutes&) = delete;

  // The route of `id` under `ring` (not null) and `placement`, with at least
  // `chunks` chunks.
  std::shared_ptr<const Route> Get(const std::shared_ptr<const ShardRing>& ring, std::string_view ns,
                                   const std::string& id, const SequencePlacement& placement, uint64_t chunks)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops `id`'s entry (a deleted sequence).
  void Forget(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Route>> routes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring
