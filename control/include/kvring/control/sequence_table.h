// SequenceTable: the attention sequences a daemon holds blocks of.
//
// Per sequence (namespace, id): the full blocks held here (block index ->
// store key, written through to the daemon's MetadataStore when given and
// reloaded at start, so Attend keeps working after a restart for every block
// the cold tier recovered), its placement when it is a fork (persisted the
// same way), and, in memory only, the sequence's layout and encoding and its
// open blocks: blocks being filled by appends, with the tokens filled so far
// on each layer. An open block's bytes live in the attention backend; a
// daemon that dies loses its open blocks (their replicas keep them).
//
// A store key may be recorded by several sequences (a fork shares its
// source's full blocks): the table counts each key's records, and says when
// the last one goes (ReleasedBlock), so that a block leaves the store only
// when no sequence holds it. A key is *owned* when the node made it (sealed
// from appends; forks inherit it): an owned key whose last record goes is
// erased; a key PutSequence named (a prefix-cache chain's) is not.
//
// Access to a sequence's state goes through a Handle, which holds the
// sequence's lock: calls on one sequence are serialized, calls on different
// sequences run in parallel. Lock() and LockMany() (several sequences, taken
// in one global order, so two batches never deadlock) may be called from any
// thread. A sequence left with no blocks, no open blocks and no layout when
// its handle is released is dropped (a request naming ids that do not exist
// leaves nothing behind).
#pragma once

#include <atomic>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvring/cache/block_meta.h"
#include "kvring/control/metadata_store.h"
#include "kvring/protocol/sequence_placement.h"

namespace kvring {

// Disjoint runs [begin, end) of block indices, merged where they touch: the
// full blocks a node holds of a sequence, so that a step checks a block
// range in O(log n) instead of block by block.
class BlockRuns {
 public:
  void Insert(uint64_t i) {
    auto next = runs_.upper_bound(i);  // first run starting after i
    if (next != runs_.begin()) {
      auto prev = std::prev(next);
      if (prev->second > i) return;  // already in
      if (prev->second == i) {
        prev->second = i + 1;
        if (next != runs_.end() && next->first == i + 1) {
          prev->second = next->second;
          runs_.erase(next);
        }
        return;
      }
    }
    if (next != runs_.end() && next->first == i + 1) {
      const uint64_t end = next->second;
      runs_.erase(next);
      runs_[i] = end;
      return;
    }
    runs_[i] = i + 1;
  }
  // Whether every index in [begin, end) is in.
  bool Covers(uint64_t begin, uint64_t end) const {
    if (begin >= end) return true;
    auto it = runs_.upper_bound(begin);
    if (it == runs_.begin()) return false;
    --it;
    return it->first <= begin && it->second >= end;
  }
  // The first index in [begin, end) that is not in (end if none).
  uint64_t FirstMissing(uint64_t begin, uint64_t end) const {
    for (uint64_t i = begin; i < end;) {
      auto it = runs_.upper_bound(i);
      if (it == runs_.begin()) return i;
      --it;
      if (it->second <= i) return i;
      i = it->second;
    }
    return end;
  }
  size_t num_runs() const { return runs_.size(); }

 private:
  std::map<uint64_t, uint64_t> runs_;  // begin -> end
};

struct OpenBlockState {
  std::vector<uint32_t> filled;  // tokens filled, per layer
  bool Complete(uint32_t block_tokens) const {
    for (uint32_t f : filled) {
      if (f != block_tokens) return false;
    }
    return true;
  }
};

struct SequenceState {
  std::optional<BlockLayout> layout;    // known once a block was put, appended or read here
  KvEncoding encoding;                  // of its full blocks
  std::map<uint64_t, BlockKey> blocks;  // full blocks held here
  BlockRuns runs;                       // the same indices, as runs
  std::map<uint64_t, OpenBlockState> open;
  // When a call last named the sequence here (NodeCore; idle expiry).
  // InfinitePast: not since this process started.
  absl::Time last_use = absl::InfinitePast();
  // A fork's placement (empty otherwise) and its digest.
  SequencePlacement placement;
  uint64_t placement_digest = 0;
};

// A full block whose last record went: no sequence here holds `key` now.
struct ReleasedBlock {
  uint64_t index = 0;
  BlockKey key;
  bool owned = false;
};

class SequenceTable {
 private:
  struct Entry {
    NamespaceId ns = 0;
    std::string id;
    absl::Mutex mu;
    SequenceState state ABSL_GUARDED_BY(mu);
    bool dropped ABSL_GUARDED_BY(mu) = false;  // removed from the table: lookups start again
  };

 public:
  // `store` may be null (nothing persisted); it must outlive the table.
  static absl::StatusOr<std::unique_ptr<SequenceTable>> Create(MetadataStore* store);

  // Exclusive access to one sequence; movable. Releases the lock when
  // destroyed.
  class Handle {
   public:
    Handle() = default;
    Handle(Handle&& o) noexcept { *this = std::move(o); }
    Handle& operator=(Handle&& o) noexcept;
    Handle(const Handle&) = delete;
    ~Handle() { Release(); }
    NamespaceId ns() const { return entry_->ns; }
    const std::string& id() const { return entry_->id; }
    SequenceState& state() ABSL_NO_THREAD_SAFETY_ANALYSIS { return entry_->state; }
    // Block `index` is full block `key` here: persisted, then in state().blocks.
    // `owned`: the node made the key (see above).
    absl::Status Record(uint64_t index, const BlockKey& key, bool owned);
    // Blocks from index `first` on are no longer held here (their records
    // deleted, then gone from state().blocks and its runs). Returns the
    // blocks no sequence here holds any more.
    absl::StatusOr<std::vector<ReleasedBlock>> UnrecordFrom(uint64_t first);
    // Records the sequence's placement (a fork's): persisted, then in state().
    absl::Status SetPlacement(const SequencePlacement& placement);
    // Ends the sequence here: its persisted records (blocks, placement) are
    // deleted and its state cleared (the caller gave its open blocks back to
    // the backend); it leaves the table when the handle is released. Returns
    // the blocks no sequence here holds any more.
    absl::StatusOr<std::vector<ReleasedBlock>> Forget();
    void Release();

   private:
    friend class SequenceTable;
    SequenceTable* table_ = nullptr;
    std::shared_ptr<Entry> entry_;
    size_t open_at_lock_ = 0;
  };

  Handle Lock(NamespaceId ns, const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Handles in the order of `ids` (which must be distinct), locked in a
  // global order.
  std::vector<Handle> LockMany(NamespaceId ns, absl::Span<const std::string> ids) ABSL_LOCKS_EXCLUDED(mu_);

  size_t num_sequences() const ABSL_LOCKS_EXCLUDED(mu_);
  // The ids of the sequences in the given namespaces (a snapshot).
  std::vector<std::pair<NamespaceId, std::string>> SequencesIn(const absl::flat_hash_set<NamespaceId>& namespaces) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Open blocks over all sequences (as of the last handle released).
  uint64_t open_blocks() const { return open_blocks_.load(std::memory_order_relaxed); }
  // How many records name `key` (over all sequences), and whether the node
  // owns it.
  struct KeyRefs {
    uint32_t records = 0;
    bool owned = false;
  };
  KeyRefs References(const BlockKey& key) const ABSL_LOCKS_EXCLUDED(mu_);
  // How many of `keys` more than one record names (blocks sequences share).
  uint64_t CountShared(absl::Span<const BlockKey> keys) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit SequenceTable(MetadataStore* store) : store_(store) {}
  using Id = std::pair<NamespaceId, std::string>;
  std::shared_ptr<Entry> FindOrAdd(NamespaceId ns, const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops an empty entry (its lock held by the caller).
  void DropIfEmpty(Entry* e) ABSL_LOCKS_EXCLUDED(mu_);
  // One record of `key` fewer; true when it was the last.
  bool ReleaseRef(const BlockKey& key, bool* owned) ABSL_LOCKS_EXCLUDED(mu_);
  MetadataStore* store_;
  mutable absl::Mutex mu_;
  std::map<Id, std::shared_ptr<Entry>> seqs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<BlockKey, KeyRefs> refs_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> open_blocks_{0};
};

}  // namespace kvring
