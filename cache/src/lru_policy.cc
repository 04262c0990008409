#include "kvring/cache/lru_policy.h"

namespace kvring {

SlotList::SlotList(size_t n) : prev_(n, UINT32_MAX), next_(n, UINT32_MAX), in_(n, false) {}

void SlotList::PushFront(SlotId s) {
  prev_[s] = UINT32_MAX;
  next_[s] = head_;
  if (head_ != UINT32_MAX)
    prev_[head_] = s;
  else
    tail_ = s;
  head_ = s;
  in_[s] = true;
  ++size_;
}

void SlotList::PushBack(SlotId s) {
  next_[s] = UINT32_MAX;
  prev_[s] = tail_;
  if (tail_ != UINT32_MAX)
    next_[tail_] = s;
  else
    head_ = s;
  tail_ = s;
  in_[s] = true;
  ++size_;
}

void SlotList::Unlink(SlotId s) {
  if (!in_[s]) return;
  if (prev_[s] != UINT32_MAX)
    next_[prev_[s]] = next_[s];
  else
    head_ = next_[s];
  if (next_[s] != UINT32_MAX)
    prev_[next_[s]] = prev_[s];
  else
    tail_ = prev_[s];
  prev_[s] = next_[s] = UINT32_MAX;
  in_[s] = false;
  --size_;
}

void LruPolicy::Admit(SlotId slot, const SlotInfo&) {
  pinned_[slot] = false;
  list_.Unlink(slot);
  list_.PushFront(slot);
}

void LruPolicy::Touch(SlotId slot) {
  if (list_.Contains(slot)) {
    list_.Unlink(slot);
    list_.PushFront(slot);
  }
}

void LruPolicy::Pin(SlotId slot) {
  pinned_[slot] = true;
  list_.Unlink(slot);
}

void LruPolicy::Unpin(SlotId slot) {
  pinned_[slot] = false;
  if (!list_.Contains(slot)) list_.PushFront(slot);
}

void LruPolicy::Remove(SlotId slot, bool) {
  pinned_[slot] = false;
  list_.Unlink(slot);
}

std::optional<SlotId> LruPolicy::Victim() {
  if (list_.empty()) return std::nullopt;
  return list_.back();
}

}  // namespace kvring
