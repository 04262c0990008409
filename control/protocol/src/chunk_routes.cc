#include "kvring/protocol/chunk_routes.h"

#include <algorithm>

namespace kvring {

std::shared_ptr<const ChunkRoutes::Route> ChunkRoutes::Get(const std::shared_ptr<const ShardRing>& ring,
                                                           std::string_view ns, const std::string& id,
                                                           const SequencePlacement& placement, uint64_t chunks) {
  const uint64_t digest = placement.Digest();
  std::shared_ptr<const Route> have;
  {
    absl::MutexLock l(&mu_);
    auto it = routes_.find(id);
    if (it != routes_.end()) have = it->second;
  }
  const bool same = have != nullptr && have->ring == ring && have->placement_digest == digest;
  if (same && have->chunks >= chunks) return have;
  // Computed outside the lock (two callers may both compute one; either is right).
  auto route = std::make_shared<Route>();
  route->ring = ring;
  route->placement_digest = digest;
  const uint64_t from = same ? have->chunks : 0;
  route->chunks = std::max(chunks, from);
  const size_t n = static_cast<size_t>(ring->num_nodes());
  route->nodes.reserve(route->chunks * n);
  if (same) route->nodes = have->nodes;
  for (uint64_t c = from; c < route->chunks; ++c) {
    // (ReadCandidates names every node once: n a chunk.)
    const std::vector<int> cands = ring->ReadCandidates(ShardRing::ChunkPosition(ns, placement.PlacedAs(id, c), c));
    route->nodes.insert(route->nodes.end(), cands.begin(), cands.end());
  }
  absl::MutexLock l(&mu_);
  if (routes_.size() >= capacity_ && !routes_.contains(id)) routes_.clear();
  auto& slot = routes_[id];
  // Keep the longer of two concurrent computations of the same key.
  if (slot == nullptr || slot->ring != ring || slot->placement_digest != digest || slot->chunks < route->chunks) {
    slot = route;
  }
  return route;
}

void ChunkRoutes::Forget(const std::string& id) {
  absl::MutexLock l(&mu_);
  routes_.erase(id);
}

size_t ChunkRoutes::size() const {
  absl::MutexLock l(&mu_);
  return routes_.size();
}

}  // namespace kvring
