// LruPolicy: least-recently-used, the baseline every other policy is measured
// against. An intrusive doubly-linked list over slot arrays holds only the
// evictable slots (most recent at the head); pinning unlinks a slot and
// unpinning relinks it at the head. No allocation after construction.
#pragma once

#include "kvring/cache/eviction_policy.h"

namespace kvring {

// A doubly-linked list of slots over preallocated arrays (shared by the
// queue-based policies).
class SlotList {
 public:
  explicit SlotList(size_t num_slots);
  void PushFront(SlotId s);
  void PushBack(SlotId s);
  void Unlink(SlotId s);
  bool Contains(SlotId s) const { return in_[s]; }
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  SlotId front() const { return head_; }
  SlotId back() const { return tail_; }
  SlotId next(SlotId s) const { return next_[s]; }  // towards the back
  SlotId prev(SlotId s) const { return prev_[s]; }  // towards the front

 private:
  std::vector<SlotId> prev_, next_;
  std::vector<bool> in_;
  SlotId head_ = UINT32_MAX, tail_ = UINT32_MAX;
  size_t size_ = 0;
};

class LruPolicy final : public EvictionPolicy {
 public:
  explicit LruPolicy(size_t num_slots) : list_(num_slots), pinned_(num_slots, false) {}
  std::string_view name() const override { return "lru"; }
  void Admit(SlotId slot, const SlotInfo&) override;
  void Touch(SlotId slot) override;
  void Pin(SlotId slot) override;
  void Unpin(SlotId slot) override;
  void Remove(SlotId slot, bool evicted) override;
  std::optional<SlotId> Victim() override;

 private:
  SlotList list_;
  std::vector<bool> pinned_;
};

}  // namespace kvring
