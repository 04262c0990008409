// MetadataStore: small durable key/value records (coordinator membership and
// tenants, a daemon's identity and sequence table) in a RocksDB database.
// Every write is synced to the WAL before it returns, so acknowledged
// metadata survives a crash or kill -9. Thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace rocksdb {
class DB;
}

namespace kvring {

class MetadataStore {
 public:
  static absl::StatusOr<std::unique_ptr<MetadataStore>> Open(const std::string& path);
  ~MetadataStore();
  MetadataStore(const MetadataStore&) = delete;
  MetadataStore& operator=(const MetadataStore&) = delete;

  absl::Status Put(const std::string& key, const std::string& value);
  absl::Status Delete(const std::string& key);
  // NOT_FOUND when absent.
  absl::StatusOr<std::string> Get(const std::string& key);
  // Visits every record whose key starts with `prefix`, in key order.
  absl::Status ScanPrefix(const std::string& prefix,
                          const std::function<void(const std::string&, const std::string&)>& fn);

 private:
  explicit MetadataStore(rocksdb::DB* db) : db_(db) {}
  rocksdb::DB* db_;
};

}  // namespace kvring
