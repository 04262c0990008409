// MetadataStore: small durable key/value records (coordinator membership and
// tenants, a daemon's identity and sequence table). Two implementations:
//   - RocksDB (MetadataStore::Open): a local directory; every write is synced
//     to the WAL before it returns, so acknowledged metadata survives a crash
//     or kill -9. The daemons' store and the coordinator's default.
//   - etcd (etcd_metadata_store.h): an etcd cluster; a write returns once
//     etcd's raft quorum committed it, and only while the writer holds the
//     coordinators' leadership (fenced). The coordinator's --etcd mode.
// A Write applies all of its puts and deletes atomically, or none of them.
// Thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace kvring {

// Puts and deletes applied together (deletes first, then puts).
struct MetadataWrite {
  std::vector<std::pair<std::string, std::string>> puts;
  std::vector<std::string> deletes;

  MetadataWrite& Put(std::string key, std::string value) {
    puts.emplace_back(std::move(key), std::move(value));
    return *this;
  }
  MetadataWrite& Delete(std::string key) {
    deletes.push_back(std::move(key));
    return *this;
  }
};

class MetadataStore {
 public:
  // The RocksDB store in directory `path` (created when missing).
  static absl::StatusOr<std::unique_ptr<MetadataStore>> Open(const std::string& path);
  virtual ~MetadataStore() = default;

  // All of `w` or none of it; UNAVAILABLE (or, for a fenced store,
  // FAILED_PRECONDITION) when nothing was written.
  virtual absl::Status Write(const MetadataWrite& w) = 0;
  // NOT_FOUND when absent.
  virtual absl::StatusOr<std::string> Get(const std::string& key) = 0;
  // Visits every record whose key starts with `prefix`, in key order.
  virtual absl::Status ScanPrefix(const std::string& prefix,
                                  const std::function<void(const std::string&, const std::string&)>& fn) = 0;

  absl::Status Put(const std::string& key, const std::string& value) { return Write(MetadataWrite().Put(key, value)); }
  absl::Status Delete(const std::string& key) { return Write(MetadataWrite().Delete(key)); }
};

}  // namespace kvring
