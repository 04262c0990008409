#include "kvring/cache/policies.h"

#include <algorithm>

namespace kvring {

void GhostList::Add(uint64_t fp) {
  if (capacity_ == 0) return;
  if (set_.insert(fp).second) fifo_.push_back(fp);
  while (set_.size() > capacity_ && !fifo_.empty()) {
    set_.erase(fifo_.front());
    fifo_.pop_front();
  }
  // Drop FIFO entries already erased from the set (lazy deletion), bounded.
  while (fifo_.size() > 2 * capacity_ + 16) {
    if (!set_.contains(fifo_.front())) {
      fifo_.pop_front();
    } else {
      break;
    }
  }
}

// ------------------------------------------------------------------ S3-FIFO

S3FifoPolicy::S3FifoPolicy(size_t n)
    : small_(n),
      main_(n),
      freq_(n, 0),
      where_(n, kNone),
      home_(n, kNone),
      fp_(n, 0),
      ghost_(n),
      small_target_(std::max<size_t>(1, n / 10)) {}

void S3FifoPolicy::Admit(SlotId s, const SlotInfo& info) {
  fp_[s] = info.fingerprint;
  freq_[s] = 0;
  if (ghost_.Contains(info.fingerprint)) {
    ghost_.Erase(info.fingerprint);
    main_.PushFront(s);
    where_[s] = home_[s] = kMain;
  } else {
    small_.PushFront(s);
    where_[s] = home_[s] = kSmall;
  }
}

void S3FifoPolicy::Touch(SlotId s) { freq_[s] = static_cast<uint8_t>(std::min(3, freq_[s] + 1)); }

void S3FifoPolicy::Pin(SlotId s) {
  if (where_[s] == kSmall) small_.Unlink(s);
  if (where_[s] == kMain) main_.Unlink(s);
  where_[s] = kNone;
}

void S3FifoPolicy::Unpin(SlotId s) {
  if (where_[s] != kNone) return;
  if (home_[s] == kMain) {
    main_.PushFront(s);
    where_[s] = kMain;
  } else {
    small_.PushFront(s);
    where_[s] = kSmall;
  }
}

void S3FifoPolicy::Remove(SlotId s, bool evicted) {
  if (where_[s] == kSmall) small_.Unlink(s);
  if (where_[s] == kMain) main_.Unlink(s);
  // Blocks that leave small without a second use go to the ghost list.
  if (evicted && home_[s] == kSmall) ghost_.Add(fp_[s]);
  where_[s] = home_[s] = kNone;
  freq_[s] = 0;
}

std::optional<SlotId> S3FifoPolicy::Victim() {
  // Bounded work: every step either returns or moves a block one queue on.
  for (size_t guard = 0; guard < 4 * (small_.size() + main_.size()) + 4; ++guard) {
    if (!small_.empty() && (small_.size() >= small_target_ || main_.empty())) {
      const SlotId s = small_.back();
      if (freq_[s] > 0) {  // read again while on probation: promote
        small_.Unlink(s);
        freq_[s] = 0;
        main_.PushFront(s);
        where_[s] = home_[s] = kMain;
        continue;
      }
      return s;
    }
    if (main_.empty()) return std::nullopt;
    const SlotId s = main_.back();
    if (freq_[s] > 0) {  // used since its last pass: once more around
      --freq_[s];
      main_.Unlink(s);
      main_.PushFront(s);
      continue;
    }
    return s;
  }
  return small_.empty() ? (main_.empty() ? std::nullopt : std::optional<SlotId>(main_.back()))
                        : std::optional<SlotId>(small_.back());
}

// ---------------------------------------------------------------------- ARC

ArcPolicy::ArcPolicy(size_t n)
    : t1_(n), t2_(n), in_t2_(n, 0), pinned_(n, false), fp_(n, 0), b1_(n), b2_(n), capacity_(n) {}

void ArcPolicy::Admit(SlotId s, const SlotInfo& info) {
  fp_[s] = info.fingerprint;
  pinned_[s] = false;
  const double c = static_cast<double>(capacity_);
  if (b1_.Contains(info.fingerprint)) {  // recency was undervalued: grow T1's target
    p_ = std::min(c, p_ + std::max(1.0, static_cast<double>(b2_.size()) / std::max<size_t>(1, b1_.size())));
    b1_.Erase(info.fingerprint);
    in_t2_[s] = 1;
  } else if (b2_.Contains(info.fingerprint)) {  // frequency was undervalued: shrink it
    p_ = std::max(0.0, p_ - std::max(1.0, static_cast<double>(b1_.size()) / std::max<size_t>(1, b2_.size())));
    b2_.Erase(info.fingerprint);
    in_t2_[s] = 1;
  } else {
    in_t2_[s] = 0;
  }
  (in_t2_[s] ? t2_ : t1_).PushFront(s);
}

void ArcPolicy::Touch(SlotId s) {
  if (pinned_[s]) {
    in_t2_[s] = 1;  // rejoins T2 on unpin
    return;
  }
  if (in_t2_[s]) {
    t2_.Unlink(s);
  } else {
    t1_.Unlink(s);
    in_t2_[s] = 1;
  }
  t2_.PushFront(s);
}

void ArcPolicy::Pin(SlotId s) {
  pinned_[s] = true;
  t1_.Unlink(s);
  t2_.Unlink(s);
}

void ArcPolicy::Unpin(SlotId s) {
  pinned_[s] = false;
  if (!t1_.Contains(s) && !t2_.Contains(s)) (in_t2_[s] ? t2_ : t1_).PushFront(s);
}

void ArcPolicy::Remove(SlotId s, bool evicted) {
  const bool was_t2 = in_t2_[s];
  t1_.Unlink(s);
  t2_.Unlink(s);
  pinned_[s] = false;
  if (evicted) (was_t2 ? b2_ : b1_).Add(fp_[s]);
}

std::optional<SlotId> ArcPolicy::Victim() {
  const bool from_t1 = !t1_.empty() && (static_cast<double>(t1_.size()) > p_ || t2_.empty());
  if (from_t1) return t1_.back();
  if (!t2_.empty()) return t2_.back();
  if (!t1_.empty()) return t1_.back();
  return std::nullopt;
}

// ----------------------------------------------------------------- leaf-LRU

LeafLruPolicy::LeafLruPolicy(size_t n)
    : stamp_(n, 0), children_(n, 0), parent_(n, UINT32_MAX), resident_(n, false), pinned_(n, false) {}

void LeafLruPolicy::Refresh(SlotId s) {
  leaves_.erase({stamp_[s], s});
  others_.erase({stamp_[s], s});
  if (!Candidate(s)) return;
  (children_[s] == 0 ? leaves_ : others_).insert({stamp_[s], s});
}

void LeafLruPolicy::Admit(SlotId s, const SlotInfo& info) {
  resident_[s] = true;
  pinned_[s] = false;
  stamp_[s] = ++clock_;
  children_[s] = 0;
  parent_[s] = info.parent_slot;
  for (SlotId c : info.child_slots) {  // children that arrived first
    if (c < resident_.size() && resident_[c] && parent_[c] != s) {
      parent_[c] = s;
      ++children_[s];
    }
  }
  Refresh(s);
  if (info.parent_slot != UINT32_MAX && info.parent_slot < resident_.size() && resident_[info.parent_slot]) {
    ++children_[info.parent_slot];
    Refresh(info.parent_slot);
  } else {
    parent_[s] = UINT32_MAX;
  }
}

void LeafLruPolicy::Touch(SlotId s) {
  if (!resident_[s]) return;
  leaves_.erase({stamp_[s], s});
  others_.erase({stamp_[s], s});
  stamp_[s] = ++clock_;
  Refresh(s);
}

void LeafLruPolicy::Pin(SlotId s) {
  pinned_[s] = true;
  Refresh(s);
}

void LeafLruPolicy::Unpin(SlotId s) {
  pinned_[s] = false;
  stamp_[s] = ++clock_;
  Refresh(s);
}

void LeafLruPolicy::Remove(SlotId s, bool) {
  leaves_.erase({stamp_[s], s});
  others_.erase({stamp_[s], s});
  resident_[s] = false;
  pinned_[s] = false;
  const SlotId p = parent_[s];
  if (p != UINT32_MAX && resident_[p] && children_[p] > 0) {
    --children_[p];
    Refresh(p);
  }
  parent_[s] = UINT32_MAX;
  // Children of a removed block (erased, not evicted) lose their parent link.
  children_[s] = 0;
}

std::optional<SlotId> LeafLruPolicy::Victim() {
  if (!leaves_.empty()) return leaves_.begin()->second;
  if (!others_.empty()) return others_.begin()->second;  // every leaf pinned
  return std::nullopt;
}

}  // namespace kvring
