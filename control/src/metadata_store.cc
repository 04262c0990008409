#include "kvring/control/metadata_store.h"

#include "kvring/cache/rocksdb_logger.h"

#include "absl/strings/str_cat.h"
#include "rocksdb/db.h"

namespace kvring {

absl::StatusOr<std::unique_ptr<MetadataStore>> MetadataStore::Open(const std::string& path) {
  rocksdb::Options o;
  o.create_if_missing = true;
  o.info_log = MakeRocksDbLogger("metadata store");  // no LOG file on the data disk (rocksdb_logger.h says why)
  o.max_background_jobs = 1;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(o, path, &db);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("opening metadata store at ", path, ": ", s.ToString()));
  return std::unique_ptr<MetadataStore>(new MetadataStore(db));
}

MetadataStore::~MetadataStore() { delete db_; }

absl::Status MetadataStore::Put(const std::string& key, const std::string& value) {
  rocksdb::WriteOptions wo;
  wo.sync = true;
  rocksdb::Status s = db_->Put(wo, key, value);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("metadata write failed: ", s.ToString()));
  return absl::OkStatus();
}

absl::Status MetadataStore::Delete(const std::string& key) {
  rocksdb::WriteOptions wo;
  wo.sync = true;
  rocksdb::Status s = db_->Delete(wo, key);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("metadata delete failed: ", s.ToString()));
  return absl::OkStatus();
}

absl::StatusOr<std::string> MetadataStore::Get(const std::string& key) {
  std::string v;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), key, &v);
  if (s.IsNotFound()) return absl::NotFoundError(key);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("metadata read failed: ", s.ToString()));
  return v;
}

absl::Status MetadataStore::ScanPrefix(const std::string& prefix,
                                       const std::function<void(const std::string&, const std::string&)>& fn) {
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    fn(it->key().ToString(), it->value().ToString());
  }
  if (!it->status().ok())
    return absl::UnavailableError(absl::StrCat("metadata scan failed: ", it->status().ToString()));
  return absl::OkStatus();
}

}  // namespace kvring
