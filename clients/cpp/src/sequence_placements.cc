#include "sequence_placements.h"

namespace kvring {

SequencePlacement SequencePlacements::Get(const std::string& id) const {
  absl::MutexLock l(&mu_);
  auto it = forks_.find(id);
  return it == forks_.end() ? SequencePlacement() : it->second;
}

void SequencePlacements::Set(const std::string& id, const SequencePlacement& placement) {
  absl::MutexLock l(&mu_);
  if (placement.empty()) {
    forks_.erase(id);
    return;
  }
  if (forks_.size() >= capacity_ && !forks_.contains(id)) forks_.clear();  // re-learned on demand
  forks_[id] = placement;
}

}  // namespace kvring
