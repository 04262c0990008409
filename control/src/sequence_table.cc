#include "kvring/control/sequence_table.h"

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
}  // namespace

absl::StatusOr<std::unique_ptr<SequenceTable>> SequenceTable::Create(MetadataStore* store) {
  std::unique_ptr<SequenceTable> t(new SequenceTable(store));
  if (store == nullptr) return t;
  absl::Status bad = absl::OkStatus();
  absl::MutexLock l(&t->mu_);
  KVRING_RETURN_IF_ERROR(store->ScanPrefix("seq/", [&](const std::string& k, const std::string& v) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    std::vector<std::string> parts = absl::StrSplit(k, '/');
    uint64_t ns = 0, index = 0;
    if (parts.size() != 4 || v.size() != 16 || !absl::SimpleHexAtoi(parts[1], &ns) || !absl::SimpleHexAtoi(parts[3], &index)) {
      bad = absl::DataLossError(absl::StrCat("corrupt sequence record '", k, "'"));
      return;
    }
    BlockKey key;
    std::memcpy(&key.lo, v.data(), 8);
    std::memcpy(&key.hi, v.data() + 8, 8);
    t->seqs_[Id{ns, parts[2]}][index] = key;
  }));
  KVRING_RETURN_IF_ERROR(bad);
  return t;
}

absl::Status SequenceTable::Record(NamespaceId ns, const std::string& id, uint64_t index, const BlockKey& key) {
  absl::MutexLock l(&mu_);
  auto& m = seqs_[Id{ns, id}];
  auto it = m.find(index);
  if (it != m.end() && it->second == key) return absl::OkStatus();
  if (store_ != nullptr) {
    std::string v(16, '\0');
    std::memcpy(v.data(), &key.lo, 8);
    std::memcpy(v.data() + 8, &key.hi, 8);
    KVRING_RETURN_IF_ERROR(store_->Put(RecordKey(ns, id, index), v));
  }
  m[index] = key;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<BlockKey>> SequenceTable::Resolve(NamespaceId ns, const std::string& id,
                                                             absl::Span<const uint64_t> indices) {
  absl::MutexLock l(&mu_);
  auto it = seqs_.find(Id{ns, id});
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence '", id, "' has no blocks on this node"));
  std::vector<BlockKey> out;
  out.reserve(indices.size());
  for (uint64_t i : indices) {
    auto b = it->second.find(i);
    if (b == it->second.end()) {
      return absl::NotFoundError(absl::StrCat("sequence '", id, "' block ", i, " is not on this node"));
    }
    out.push_back(b->second);
  }
  return out;
}

size_t SequenceTable::num_sequences() const {
  absl::MutexLock l(&mu_);
  return seqs_.size();
}

}  // namespace kvring
