// ColdTier: the store's last tier (local SSD), where evicted blocks are
// demoted instead of dropped. Implementations: RocksDbColdTier (the real one)
// and, for tests of failure paths, wrappers that fail on demand.
//
// Contract: Write is durable when it returns OK (the WAL is synced unless the
// implementation's options say otherwise); Read verifies the stored checksum
// and returns DATA_LOSS on a mismatch, NOT_FOUND when absent; Scan visits
// the metadata of every stored block (no payloads), for recovery at start.
// Implementations are thread-safe.
#pragma once

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvring/cache/block_meta.h"

namespace kvring {

struct ColdBlockInfo {
  ScopedKey key;
  BlockKey parent;
  BlockMeta meta;
};

struct ColdTierStats {
  uint64_t blocks = 0;
  uint64_t raw_bytes = 0;     // payload bytes before compression
  uint64_t stored_bytes = 0;  // bytes after compression
  uint64_t writes = 0, reads = 0, write_errors = 0, read_errors = 0;
};

class ColdTier {
 public:
  virtual ~ColdTier() = default;
  virtual absl::Status Write(const ColdBlockInfo& info, absl::Span<const uint8_t> payload) = 0;
  virtual absl::Status Read(const ScopedKey& key, ColdBlockInfo* info, std::vector<uint8_t>* payload) = 0;
  virtual absl::Status Erase(const ScopedKey& key) = 0;
  virtual absl::Status Scan(const std::function<void(const ColdBlockInfo&)>& visit) = 0;
  virtual ColdTierStats stats() const = 0;
};

}  // namespace kvring
