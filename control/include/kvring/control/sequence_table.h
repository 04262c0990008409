// SequenceTable: the attention sequences a daemon holds blocks of:
// (namespace, sequence id) -> block index -> block key. Entries are written
// through to the daemon's MetadataStore (when given) and reloaded at start,
// so Attend keeps working after a restart for every block the cold tier
// recovered. Thread-safe.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kvring/cache/block_key.h"
#include "kvring/control/metadata_store.h"

namespace kvring {

class SequenceTable {
 public:
  // `store` may be null (nothing persisted); it must outlive the table.
  static absl::StatusOr<std::unique_ptr<SequenceTable>> Create(MetadataStore* store);

  absl::Status Record(NamespaceId ns, const std::string& sequence_id, uint64_t block_index, const BlockKey& key)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Keys of the given blocks; NOT_FOUND naming the first block this node
  // does not hold.
  absl::StatusOr<std::vector<BlockKey>> Resolve(NamespaceId ns, const std::string& sequence_id,
                                                absl::Span<const uint64_t> block_indices) ABSL_LOCKS_EXCLUDED(mu_);
  size_t num_sequences() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit SequenceTable(MetadataStore* store) : store_(store) {}
  using Id = std::pair<NamespaceId, std::string>;
  MetadataStore* store_;
  mutable absl::Mutex mu_;
  std::map<Id, absl::flat_hash_map<uint64_t, BlockKey>> seqs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring
