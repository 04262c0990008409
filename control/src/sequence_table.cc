#include "kvring/control/sequence_table.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kvring/common/status_macros.h"

namespace kvring {
namespace {
std::string RecordKey(NamespaceId ns, const std::string& id, uint64_t index) {
  return absl::StrFormat("seq/%016x/%s/%016x", ns, id, index);
}
std::string PlacementKey(NamespaceId ns, const std::string& id) { return absl::StrFormat("seqp/%016x/%s", ns, id); }
}  // namespace

absl::StatusOr<std::unique_ptr<SequenceTable>> SequenceTable::Create(MetadataStore* store) {
  std::unique_ptr<SequenceTable> t(new SequenceTable(store));
  if (store == nullptr) return t;
  absl::Status bad = absl::OkStatus();
  absl::MutexLock l(&t->mu_);
  KVRING_RETURN_IF_ERROR(
      store->ScanPrefix("seq/", [&](const std::string& k, const std::string& v) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        std::vector<std::string> parts = absl::StrSplit(k, '/');
        uint64_t ns = 0, index = 0;
        // 16 bytes: the key (written before forks: owned unknown, NodeCore
        // tells its own keys by their derivation); 17: the key and `owned`.
        if (parts.size() != 4 || (v.size() != 16 && v.size() != 17) || !absl::SimpleHexAtoi(parts[1], &ns) ||
            !absl::SimpleHexAtoi(parts[3], &index)) {
          bad = absl::DataLossError(absl::StrCat("corrupt sequence record '", k, "'"));
          return;
        }
        BlockKey key;
        std::memcpy(&key.lo, v.data(), 8);
        std::memcpy(&key.hi, v.data() + 8, 8);
        SequenceState& st = t->FindOrAdd(ns, parts[2])->state;  // NOLINT: loaded before any lock is taken
        st.blocks[index] = key;
        st.runs.Insert(index);
        KeyRefs& r = t->refs_[key];
        ++r.records;
        r.owned |= v.size() == 17 && v[16] != 0;
      }));
  KVRING_RETURN_IF_ERROR(bad);
  KVRING_RETURN_IF_ERROR(
      store->ScanPrefix("seqp/", [&](const std::string& k, const std::string& v) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        std::vector<std::string> parts = absl::StrSplit(absl::string_view(k).substr(5), absl::MaxSplits('/', 1));
        uint64_t ns = 0;
        v1::SequencePlacement p;
        absl::StatusOr<SequencePlacement> placement = absl::DataLossError("");
        if (parts.size() == 2 && absl::SimpleHexAtoi(parts[0], &ns) && p.ParseFromString(v)) {
          placement = SequencePlacement::FromProto(p);
        }
        if (!placement.ok()) {
          bad = absl::DataLossError(absl::StrCat("corrupt sequence placement record '", k, "'"));
          return;
        }
        SequenceState& st = t->FindOrAdd(ns, parts[1])->state;  // NOLINT: loaded before any lock is taken
        st.placement_digest = placement->Digest();
        st.placement = *std::move(placement);
      }));
  KVRING_RETURN_IF_ERROR(bad);
  return t;
}

std::shared_ptr<SequenceTable::Entry> SequenceTable::FindOrAdd(NamespaceId ns, const std::string& id) {
  std::shared_ptr<Entry>& e = seqs_[Id{ns, id}];
  if (e == nullptr) {
    e = std::make_shared<Entry>();
    e->ns = ns;
    e->id = id;
  }
  return e;
}

void SequenceTable::DropIfEmpty(Entry* e) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const SequenceState& st = e->state;
  if (!st.blocks.empty() || !st.open.empty() || st.layout.has_value() || !st.placement.empty()) return;
  // Lock order: an entry's lock, then the table's (LockMany never holds the
  // table's while it waits for an entry).
  absl::MutexLock l(&mu_);
  auto it = seqs_.find(Id{e->ns, e->id});
  if (it != seqs_.end() && it->second.get() == e) seqs_.erase(it);
  e->dropped = true;
}

SequenceTable::Handle& SequenceTable::Handle::operator=(Handle&& o) noexcept {
  if (this != &o) {
    Release();
    table_ = o.table_;
    entry_ = o.entry_;
    open_at_lock_ = o.open_at_lock_;
    o.table_ = nullptr;
    o.entry_ = nullptr;
  }
  return *this;
}

void SequenceTable::Handle::Release() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (entry_ == nullptr) return;
  table_->open_blocks_.fetch_add(static_cast<int64_t>(entry_->state.open.size()) - static_cast<int64_t>(open_at_lock_),
                                 std::memory_order_relaxed);
  table_->DropIfEmpty(entry_.get());
  entry_->mu.Unlock();
  entry_ = nullptr;
  table_ = nullptr;
}

absl::Status SequenceTable::Handle::Record(uint64_t index, const BlockKey& key,
                                           bool owned) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto it = entry_->state.blocks.find(index);
  if (it != entry_->state.blocks.end() && it->second == key) return absl::OkStatus();
  if (table_->store_ != nullptr) {
    std::string v(17, '\0');
    std::memcpy(v.data(), &key.lo, 8);
    std::memcpy(v.data() + 8, &key.hi, 8);
    v[16] = owned ? 1 : 0;
    KVRING_RETURN_IF_ERROR(table_->store_->Put(RecordKey(entry_->ns, entry_->id, index), v));
  }
  if (it != entry_->state.blocks.end()) {
    bool unused;
    table_->ReleaseRef(it->second, &unused);  // replaced (a PutSequence under another key)
  }
  {
    absl::MutexLock l(&table_->mu_);
    KeyRefs& r = table_->refs_[key];
    ++r.records;
    r.owned |= owned;
  }
  entry_->state.blocks[index] = key;
  entry_->state.runs.Insert(index);
  return absl::OkStatus();
}

bool SequenceTable::ReleaseRef(const BlockKey& key, bool* owned) {
  absl::MutexLock l(&mu_);
  auto it = refs_.find(key);
  if (it == refs_.end()) return false;
  *owned = it->second.owned;
  if (--it->second.records > 0) return false;
  refs_.erase(it);
  return true;
}

SequenceTable::KeyRefs SequenceTable::References(const BlockKey& key) const {
  absl::MutexLock l(&mu_);
  auto it = refs_.find(key);
  return it == refs_.end() ? KeyRefs{} : it->second;
}

uint64_t SequenceTable::CountShared(absl::Span<const BlockKey> keys) const {
  absl::MutexLock l(&mu_);
  uint64_t n = 0;
  for (const BlockKey& key : keys) {
    auto it = refs_.find(key);
    n += it != refs_.end() && it->second.records > 1;
  }
  return n;
}

absl::StatusOr<std::vector<ReleasedBlock>> SequenceTable::Handle::UnrecordFrom(uint64_t first)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  SequenceState& st = entry_->state;
  std::vector<ReleasedBlock> released;
  const auto from = st.blocks.lower_bound(first);
  if (from == st.blocks.end()) return released;
  if (table_->store_ != nullptr) {
    for (auto it = from; it != st.blocks.end(); ++it) {
      KVRING_RETURN_IF_ERROR(table_->store_->Delete(RecordKey(entry_->ns, entry_->id, it->first)));
    }
  }
  for (auto it = from; it != st.blocks.end(); ++it) {
    bool owned = false;
    if (table_->ReleaseRef(it->second, &owned)) released.push_back(ReleasedBlock{it->first, it->second, owned});
  }
  st.blocks.erase(from, st.blocks.end());
  st.runs = BlockRuns();
  for (const auto& [i, key] : st.blocks) st.runs.Insert(i);
  return released;
}

absl::Status SequenceTable::Handle::SetPlacement(const SequencePlacement& placement) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  SequenceState& st = entry_->state;
  if (st.placement == placement) return absl::OkStatus();
  if (table_->store_ != nullptr) {
    if (placement.empty()) {
      KVRING_RETURN_IF_ERROR(table_->store_->Delete(PlacementKey(entry_->ns, entry_->id)));
    } else {
      v1::SequencePlacement p;
      placement.ToProto(&p);
      KVRING_RETURN_IF_ERROR(table_->store_->Put(PlacementKey(entry_->ns, entry_->id), p.SerializeAsString()));
    }
  }
  st.placement = placement;
  st.placement_digest = placement.Digest();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ReleasedBlock>> SequenceTable::Handle::Forget() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  KVRING_ASSIGN_OR_RETURN(std::vector<ReleasedBlock> released, UnrecordFrom(0));
  KVRING_RETURN_IF_ERROR(SetPlacement(SequencePlacement()));
  entry_->state = SequenceState{};
  return released;
}

std::vector<std::pair<NamespaceId, std::string>> SequenceTable::SequencesIn(
    const absl::flat_hash_set<NamespaceId>& namespaces) const {
  absl::MutexLock l(&mu_);
  std::vector<std::pair<NamespaceId, std::string>> out;
  for (const auto& [id, e] : seqs_) {
    if (namespaces.contains(id.first)) out.push_back(id);
  }
  return out;
}

SequenceTable::Handle SequenceTable::Lock(NamespaceId ns, const std::string& id) {
  std::vector<Handle> h = LockMany(ns, absl::MakeConstSpan(&id, 1));
  return std::move(h[0]);
}

std::vector<SequenceTable::Handle> SequenceTable::LockMany(NamespaceId ns, absl::Span<const std::string> ids)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  for (;;) {
    std::vector<std::shared_ptr<Entry>> entries(ids.size());
    {
      absl::MutexLock l(&mu_);
      for (size_t i = 0; i < ids.size(); ++i) entries[i] = FindOrAdd(ns, ids[i]);
    }
    // One global order: by entry address (a held entry is never freed).
    std::vector<size_t> order(ids.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return entries[a] < entries[b]; });
    std::vector<Handle> out(ids.size());
    bool dropped = false;
    for (size_t i : order) {
      entries[i]->mu.Lock();
      dropped |= entries[i]->dropped;
      out[i].table_ = this;
      out[i].entry_ = entries[i];
      out[i].open_at_lock_ = entries[i]->state.open.size();
    }
    if (!dropped) return out;
    // An entry was dropped between the lookup and the lock: look up again.
    for (Handle& h : out) {
      h.entry_->mu.Unlock();
      h.entry_ = nullptr;
    }
  }
}

size_t SequenceTable::num_sequences() const {
  absl::MutexLock l(&mu_);
  return seqs_.size();
}

}  // namespace kvring
