// EtcdMetadataStore: the coordinator's MetadataStore in etcd, so that any
// number of coordinators share one state and none holds it alone. Keys live
// under `prefix` (several clusters may share an etcd). A Write is one etcd
// transaction: atomic, committed by etcd's raft quorum before it returns, and
// fenced: it applies only while the fence key still has the create revision
// this coordinator's election won with (SetFence), so a leader that was
// paused past its lease and wakes up cannot write (FAILED_PRECONDITION).
// Without a fence every write is refused the same way: only the leader
// writes. Reads are linearizable (etcd's quorum reads). Thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "kvring/control/etcd_client.h"
#include "kvring/control/metadata_store.h"

namespace kvring {

class EtcdMetadataStore final : public MetadataStore {
 public:
  // `etcd` must outlive the store.
  EtcdMetadataStore(EtcdClient* etcd, std::string prefix) : etcd_(etcd), prefix_(std::move(prefix)) {}

  // Writes apply only while etcd's `key` has create revision `revision`
  // (revision 0: no fence, writes refused).
  void SetFence(const std::string& key, int64_t revision) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status Write(const MetadataWrite& w) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::string> Get(const std::string& key) override;
  absl::Status ScanPrefix(const std::string& prefix,
                          const std::function<void(const std::string&, const std::string&)>& fn) override;

 private:
  EtcdClient* const etcd_;
  const std::string prefix_;
  absl::Mutex mu_;
  std::string fence_key_ ABSL_GUARDED_BY(mu_);
  int64_t fence_revision_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvring
