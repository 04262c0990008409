// SequencePlacements: the placements of the forks a client knows, by
// sequence id (kvring/protocol/sequence_placement.h). A sequence not in it
// is routed by its own id; a wrong or missing entry costs one round (the
// node answers ABORTED, the client resolves and routes again), so the cache
// may forget entries: it holds at most `capacity` and starts over when full.
// Thread-safe.
#pragma once

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kvring/protocol/sequence_placement.h"

namespace kvring {

class SequencePlacements {
 public:
  explicit SequencePlacements(size_t capacity = 1 << 20) : capacity_(capacity) {}
  // The placement of `id` (empty when it is not a known fork).
  SequencePlacement Get(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Records what `id`'s placement is (an empty one: forgets it).
  void Set(const std::string& id, const SequencePlacement& placement) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, SequencePlacement> forks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring
