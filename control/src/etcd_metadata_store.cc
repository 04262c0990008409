#include "kvring/control/etcd_metadata_store.h"

#include "absl/strings/str_cat.h"

namespace kvring {
namespace {
// Keys a page of a scan holds (etcd's responses stay far below gRPC's 4 MiB).
constexpr int64_t kScanPage = 512;
}  // namespace

void EtcdMetadataStore::SetFence(const std::string& key, int64_t revision) {
  absl::MutexLock l(&mu_);
  fence_key_ = key;
  fence_revision_ = revision;
}

absl::Status EtcdMetadataStore::Write(const MetadataWrite& w) {
  etcdserverpb::TxnRequest txn;
  {
    absl::MutexLock l(&mu_);
    if (fence_revision_ == 0) {
      return absl::FailedPreconditionError("this coordinator does not lead: it may not write the metadata");
    }
    etcdserverpb::Compare* c = txn.add_compare();
    c->set_result(etcdserverpb::Compare::EQUAL);
    c->set_target(etcdserverpb::Compare::CREATE);
    c->set_key(fence_key_);
    c->set_create_revision(fence_revision_);
  }
  for (const auto& k : w.deletes) txn.add_success()->mutable_request_delete_range()->set_key(prefix_ + k);
  for (const auto& [k, v] : w.puts) {
    etcdserverpb::PutRequest* p = txn.add_success()->mutable_request_put();
    p->set_key(prefix_ + k);
    p->set_value(v);
  }
  absl::StatusOr<etcdserverpb::TxnResponse> r = etcd_->Txn(txn);
  if (!r.ok()) return absl::UnavailableError(absl::StrCat("metadata write failed: ", r.status().message()));
  if (!r->succeeded()) {
    return absl::FailedPreconditionError(
        "metadata write fenced: this coordinator's leadership ended (its lease expired); another leads now");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> EtcdMetadataStore::Get(const std::string& key) {
  etcdserverpb::RangeRequest req;
  req.set_key(prefix_ + key);
  absl::StatusOr<etcdserverpb::RangeResponse> r = etcd_->Range(req);
  if (!r.ok()) return absl::UnavailableError(absl::StrCat("metadata read failed: ", r.status().message()));
  if (r->kvs_size() == 0) return absl::NotFoundError(key);
  return r->kvs(0).value();
}

absl::Status EtcdMetadataStore::ScanPrefix(const std::string& prefix,
                                           const std::function<void(const std::string&, const std::string&)>& fn) {
  const std::string end = EtcdClient::PrefixEnd(prefix_ + prefix);
  std::string from = prefix_ + prefix;
  int64_t revision = 0;  // every page at the first page's revision: one consistent view
  for (;;) {
    etcdserverpb::RangeRequest req;
    req.set_key(from);
    req.set_range_end(end);
    req.set_limit(kScanPage);
    req.set_revision(revision);
    absl::StatusOr<etcdserverpb::RangeResponse> r = etcd_->Range(req);
    if (!r.ok()) return absl::UnavailableError(absl::StrCat("metadata scan failed: ", r.status().message()));
    if (revision == 0) revision = r->header().revision();
    for (const auto& kv : r->kvs()) fn(kv.key().substr(prefix_.size()), kv.value());
    if (!r->more() || r->kvs_size() == 0) return absl::OkStatus();
    from = r->kvs(r->kvs_size() - 1).key() + std::string(1, '\0');
  }
}

}  // namespace kvring
