#include "kvring/control/metadata_store.h"

#include "absl/strings/str_cat.h"
#include "kvring/cache/rocksdb_logger.h"
#include "rocksdb/db.h"
#include "rocksdb/write_batch.h"

namespace kvring {
namespace {

class RocksDbMetadataStore final : public MetadataStore {
 public:
  explicit RocksDbMetadataStore(rocksdb::DB* db) : db_(db) {}

  absl::Status Write(const MetadataWrite& w) override {
    rocksdb::WriteBatch batch;
    for (const auto& k : w.deletes) batch.Delete(k);
    for (const auto& [k, v] : w.puts) batch.Put(k, v);
    rocksdb::WriteOptions wo;
    wo.sync = true;
    rocksdb::Status s = db_->Write(wo, &batch);
    if (!s.ok()) return absl::UnavailableError(absl::StrCat("metadata write failed: ", s.ToString()));
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Get(const std::string& key) override {
    std::string v;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), key, &v);
    if (s.IsNotFound()) return absl::NotFoundError(key);
    if (!s.ok()) return absl::UnavailableError(absl::StrCat("metadata read failed: ", s.ToString()));
    return v;
  }

  absl::Status ScanPrefix(const std::string& prefix,
                          const std::function<void(const std::string&, const std::string&)>& fn) override {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
      fn(it->key().ToString(), it->value().ToString());
    }
    if (!it->status().ok())
      return absl::UnavailableError(absl::StrCat("metadata scan failed: ", it->status().ToString()));
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<rocksdb::DB> db_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetadataStore>> MetadataStore::Open(const std::string& path) {
  rocksdb::Options o;
  o.create_if_missing = true;
  o.info_log = MakeRocksDbLogger("metadata store");  // no LOG file on the data disk (rocksdb_logger.h says why)
  o.max_background_jobs = 1;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(o, path, &db);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("opening metadata store at ", path, ": ", s.ToString()));
  return std::unique_ptr<MetadataStore>(new RocksDbMetadataStore(db));
}

}  // namespace kvring
