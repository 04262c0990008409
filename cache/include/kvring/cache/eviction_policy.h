// EvictionPolicy: chooses which resident block of a tier to evict.
//
// The tier (BlockStore) names each resident block by a dense SlotId (its page
// id) and tells the policy everything that happens to it:
//   Admit   - the block entered the tier (starts evictable: no pins);
//   Touch   - the block was read (a hit);
//   Pin / Unpin - it stops / starts being evictable (refcount 0 <-> 1);
//   Remove  - it left the tier (`evicted`: chosen by Victim(), else erased).
// Victim() returns an evictable slot without removing it, or nullopt when no
// slot is evictable; the policy must never return a pinned slot. Policies are
// not thread-safe: the tier calls them under its own mutex. All methods are
// O(1) amortized unless a policy's comment says otherwise.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvring {

using SlotId = uint32_t;

struct SlotInfo {
  uint64_t fingerprint = 0;  // a hash of the block's key (for ghost lists)
  uint32_t bytes = 0;
  // The slot of the block's parent when it is resident in the same tier,
  // else UINT32_MAX; and the slots of its children that are resident. Prefix-
  // aware policies use them.
  SlotId parent_slot = UINT32_MAX;
  std::vector<SlotId> child_slots;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual std::string_view name() const = 0;
  virtual void Admit(SlotId slot, const SlotInfo& info) = 0;
  virtual void Touch(SlotId slot) = 0;
  virtual void Pin(SlotId slot) = 0;
  virtual void Unpin(SlotId slot) = 0;
  virtual void Remove(SlotId slot, bool evicted) = 0;
  virtual std::optional<SlotId> Victim() = 0;
};

// Creates a policy by name for a tier of `num_slots` slots:
//   "lru"      least recently used (the baseline);
//   "s3fifo"   S3-FIFO (small probation FIFO, main FIFO with re-insertion, ghost FIFO);
//   "arc"      Adaptive Replacement Cache;
//   "leaf-lru" prefix-aware: the least recently used block with no resident
//              child (a child is useless without its parent).
// INVALID_ARGUMENT for an unknown name.
absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(std::string_view name, size_t num_slots);
std::vector<std::string> EvictionPolicyNames();

}  // namespace kvring
