// The eviction policies beyond LRU (see eviction_policy.h for the contract).
// Each keeps only slot-indexed arrays and fingerprint sets; O(1) per call
// except LeafLruPolicy (O(log n): an ordered set of leaves by recency).
#pragma once

#include <cstdint>
#include <deque>
#include <set>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "kvring/cache/lru_policy.h"

namespace kvring {

// Ghost list: the fingerprints of recently evicted blocks, FIFO, bounded.
class GhostList {
 public:
  explicit GhostList(size_t capacity) : capacity_(capacity) {}
  void Add(uint64_t fp);
  bool Contains(uint64_t fp) const { return set_.contains(fp); }
  void Erase(uint64_t fp) { set_.erase(fp); }  // lazy in the FIFO
  size_t size() const { return set_.size(); }

 private:
  size_t capacity_;
  std::deque<uint64_t> fifo_;
  absl::flat_hash_set<uint64_t> set_;
};

// S3-FIFO (Yang et al., SOSP'23): new blocks enter a small FIFO (10% of the
// slots); those read again before reaching its end move to the main FIFO,
// the others leave (to the ghost list). Blocks found in the ghost list on
// admission go straight to main. Main is a FIFO with re-insertion for blocks
// read since their last pass (2-bit frequency). Pinned blocks leave the
// queues and rejoin at the head on unpin.
class S3FifoPolicy final : public EvictionPolicy {
 public:
  explicit S3FifoPolicy(size_t num_slots);
  std::string_view name() const override { return "s3fifo"; }
  void Admit(SlotId slot, const SlotInfo& info) override;
  void Touch(SlotId slot) override;
  void Pin(SlotId slot) override;
  void Unpin(SlotId slot) override;
  void Remove(SlotId slot, bool evicted) override;
  std::optional<SlotId> Victim() override;

 private:
  enum Where : uint8_t { kNone, kSmall, kMain };
  SlotList small_, main_;
  std::vector<uint8_t> freq_, where_, home_;  // home_: queue to rejoin on unpin
  std::vector<uint64_t> fp_;
  GhostList ghost_;
  size_t small_target_;
};

// ARC (Megiddo & Modha, FAST'03): T1 (seen once) and T2 (seen again) LRU
// lists of resident blocks, ghost lists B1/B2, and an adaptive target p for
// |T1| moved by ghost hits. Pinned blocks leave T1/T2 while pinned.
class ArcPolicy final : public EvictionPolicy {
 public:
  explicit ArcPolicy(size_t num_slots);
  std::string_view name() const override { return "arc"; }
  void Admit(SlotId slot, const SlotInfo& info) override;
  void Touch(SlotId slot) override;
  void Pin(SlotId slot) override;
  void Unpin(SlotId slot) override;
  void Remove(SlotId slot, bool evicted) override;
  std::optional<SlotId> Victim() override;

 private:
  SlotList t1_, t2_;
  std::vector<uint8_t> in_t2_;
  std::vector<bool> pinned_;
  std::vector<uint64_t> fp_;
  GhostList b1_, b2_;
  size_t capacity_;
  double p_ = 0;
};

// Prefix-aware LRU: only leaves (blocks none of whose children are resident)
// are candidates, least recently used first; a block's parent therefore
// never leaves before it (when every leaf is pinned it falls back to the
// least recently used block, so the tier never jams).
class LeafLruPolicy final : public EvictionPolicy {
 public:
  explicit LeafLruPolicy(size_t num_slots);
  std::string_view name() const override { return "leaf-lru"; }
  void Admit(SlotId slot, const SlotInfo& info) override;
  void Touch(SlotId slot) override;
  void Pin(SlotId slot) override;
  void Unpin(SlotId slot) override;
  void Remove(SlotId slot, bool evicted) override;
  std::optional<SlotId> Victim() override;
  // For tests: resident children of `slot`.
  uint32_t children(SlotId slot) const { return children_[slot]; }

 private:
  bool Candidate(SlotId s) const { return resident_[s] && !pinned_[s]; }
  void Refresh(SlotId s);  // re-files s in leaves_/others_ after a change
  std::vector<uint64_t> stamp_;
  std::vector<uint32_t> children_;
  std::vector<SlotId> parent_;
  std::vector<bool> resident_, pinned_;
  std::set<std::pair<uint64_t, SlotId>> leaves_, others_;  // by last use
  uint64_t clock_ = 0;
};

}  // namespace kvring
