// LeaderElection: one of several coordinators leads, through an etcd lease.
// Each candidate holds a lease of `ttl` and keeps it alive every ttl/3; the
// one that creates `key` (bound to its lease, holding its advertised
// address) leads until its lease ends: it stops keeping it alive (a crash, a
// pause, a partition from etcd's quorum) or resigns (Stop()). The others
// read the key to learn the leader and try again when it is gone, so a
// standby leads within about one ttl of the leader's death.
//
// The key's create revision is the leadership's fence: on_lead receives it,
// and the leader's metadata writes apply only while the key still has it
// (etcd_metadata_store.h). A leader steps down by itself (on_follow) when a
// keep-alive fails for longer than the lease has left by its own clock, so it
// stops acting as leader before another can start.
//
// Callbacks run on the election's thread, one at a time: on_lead(fence) when
// this candidate starts leading (a non-OK status resigns at once), and
// on_follow(leader, why) when it stops leading or learns of another leader
// ("" while there is none). While there is none, `why` is the error of the
// last round that could not reach etcd (OK when etcd answered that no one
// leads); on_follow runs again when that error changes, so callers can say
// why no coordinator leads. Thread-safe.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kvring/control/etcd_client.h"

namespace kvring {

struct LeaderElectionOptions {
  // The key candidates race to create, e.g. "/kvring/leader".
  std::string key;
  // What this candidate writes there (what standbys tell callers).
  std::string candidate;
  // The lease. etcd refuses leases shorter than about 1.5 s of its election
  // timeout; 2 s is the shortest that is safe. Default: 5 s.
  absl::Duration ttl = absl::Seconds(5);
  std::function<absl::Status(int64_t fence)> on_lead;
  std::function<void(const std::string& leader, const absl::Status& why)> on_follow;
};

class LeaderElection {
 public:
  // `etcd` must outlive the election.
  LeaderElection(EtcdClient* etcd, LeaderElectionOptions options);
  // Stops; a leader resigns (revokes its lease, so a standby leads at once).
  ~LeaderElection();
  LeaderElection(const LeaderElection&) = delete;
  LeaderElection& operator=(const LeaderElection&) = delete;

  void Start();
  void Stop();
  bool leading() const { return leading_.load(); }
  // OK while leading with, by this clock, more than ttl/6 of the lease left:
  // what a leader checks before it acts (after a pause, or while a renewal is
  // unanswered, the election thread may not yet have noticed that the lease
  // is gone). Otherwise Unavailable, saying why: not leading, or the lease ran
  // out unrenewed; either with etcd's last renewal error when it gave one.
  absl::Status LeaseHeld() const;

 private:
  void Loop();
  // One round: keep the lease alive (or get one), then campaign or watch.
  void Round();
  void Lose(const char* why, const absl::Status& cause);
  // A round that could not reach etcd: while no leader is known, tells
  // on_follow the new cause.
  void Unanswered(const absl::Status& cause);
  void Follow(const std::string& leader, const absl::Status& why);
  void SetRenewError(std::string error) ABSL_LOCKS_EXCLUDED(renew_mu_);

  EtcdClient* const etcd_;
  const LeaderElectionOptions options_;
  std::atomic<bool> leading_{false};
  // The election thread's own state.
  int64_t lease_ = 0;
  absl::Time lease_deadline_ = absl::InfinitePast();  // by this clock, with the send time as its start
  std::atomic<int64_t> lease_deadline_ns_{0};         // the same, for LeaseHeld
  mutable absl::Mutex renew_mu_;
  std::string renew_error_ ABSL_GUARDED_BY(renew_mu_);  // the last failed renewal's error ("" once one succeeds)
  std::string leader_seen_ = "?";
  std::string cause_seen_;  // the message last given to on_follow with leader_seen_ ""
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace kvring
