#include "kvring/control/leader_election.h"

#include "absl/strings/str_cat.h"
#include "kvring/common/logging.h"

namespace kvring {

LeaderElection::LeaderElection(EtcdClient* etcd, LeaderElectionOptions options)
    : etcd_(etcd), options_(std::move(options)) {}

LeaderElection::~LeaderElection() { Stop(); }

void LeaderElection::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void LeaderElection::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
  if (lease_ != 0) {
    // Resign: the key goes with the lease, and a standby leads at its next round.
    if (absl::Status s = etcd_->LeaseRevoke(lease_); !s.ok())
      KVRING_LOG(WARNING) << "could not revoke the leadership lease: " << s.message();
    lease_ = 0;
  }
  leading_ = false;
}

absl::Status LeaderElection::LeaseHeld() const {
  const bool leading = leading_.load();
  if (leading && absl::Now() < absl::FromUnixNanos(lease_deadline_ns_.load()) - options_.ttl / 6) {
    return absl::OkStatus();
  }
  absl::MutexLock l(&renew_mu_);
  if (!leading) {
    // (Lost since: when a renewal failed, that is why.)
    return absl::UnavailableError(absl::StrCat(
        "this coordinator does not hold the leadership lease",
        renew_error_.empty() ? std::string()
                             : absl::StrCat(": the metadata store (etcd) did not renew it: ", renew_error_)));
  }
  return absl::UnavailableError(absl::StrCat(
      "this coordinator's leadership lease ran out before the metadata store (etcd) renewed it",
      renew_error_.empty() ? std::string(" (the renewal is unanswered)") : absl::StrCat(": ", renew_error_)));
}

void LeaderElection::SetRenewError(std::string error) {
  absl::MutexLock l(&renew_mu_);
  renew_error_ = std::move(error);
}

void LeaderElection::Follow(const std::string& leader, const absl::Status& why) {
  leader_seen_ = leader;
  cause_seen_ = leader.empty() ? std::string(why.message()) : std::string();
  if (options_.on_follow) options_.on_follow(leader, leader.empty() ? why : absl::OkStatus());
}

void LeaderElection::Lose(const char* why, const absl::Status& cause) {
  lease_ = 0;
  if (leading_.exchange(false)) {
    KVRING_LOG(WARNING) << "stepping down as leader: " << why << (cause.ok() ? "" : ": ") << cause.message();
    leader_seen_ = "?";
  }
  if (leader_seen_ != "" || cause_seen_ != cause.message()) Follow("", cause);
}

void LeaderElection::Unanswered(const absl::Status& cause) {
  if (!leading_ && leader_seen_ == "" && cause_seen_ != cause.message()) Follow("", cause);
  // (A standby that knows a leader keeps naming it: etcd may be out of this
  // one's reach only.)
}

void LeaderElection::Loop() {
  do {
    Round();
  } while (!stop_.WaitForNotificationWithTimeout(leading_ ? options_.ttl / 3 : options_.ttl / 6));
}

void LeaderElection::Round() {
  const absl::Time now = absl::Now();
  if (lease_ == 0) {
    absl::StatusOr<etcdserverpb::LeaseGrantResponse> g = etcd_->LeaseGrant(options_.ttl);
    if (!g.ok()) {
      KVRING_LOG(WARNING) << "election: no lease: " << g.status().message();
      Unanswered(g.status());
      return;
    }
    lease_ = g->id();
    lease_deadline_ = now + absl::Seconds(g->ttl());
    lease_deadline_ns_ = absl::ToUnixNanos(lease_deadline_);
    SetRenewError("");
  } else {
    absl::StatusOr<int64_t> left = etcd_->LeaseKeepAlive(lease_);
    SetRenewError(left.ok() ? std::string() : std::string(left.status().message()));
    if (left.ok() && *left > 0) {
      lease_deadline_ = now + absl::Seconds(*left);
      lease_deadline_ns_ = absl::ToUnixNanos(lease_deadline_);
    } else if (left.ok()) {
      Lose("the lease expired", absl::OkStatus());
      return;
    } else if (absl::Now() >= lease_deadline_ - options_.ttl / 6) {
      // Not renewed, and by this clock the lease is (nearly) over: another
      // may lead soon, so this one stops first.
      Lose("the lease could not be renewed in time", left.status());
      return;
    } else {
      Unanswered(left.status());
    }
  }
  if (leading_) return;
  // Campaign: create the key if nobody holds it, else read who does.
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* c = txn.add_compare();
  c->set_result(etcdserverpb::Compare::EQUAL);
  c->set_target(etcdserverpb::Compare::CREATE);
  c->set_key(options_.key);
  c->set_create_revision(0);
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(options_.key);
  put->set_value(options_.candidate);
  put->set_lease(lease_);
  txn.add_failure()->mutable_request_range()->set_key(options_.key);
  absl::StatusOr<etcdserverpb::TxnResponse> r = etcd_->Txn(txn);
  if (!r.ok()) {
    KVRING_LOG(WARNING) << "election: " << r.status().message();
    Unanswered(r.status());
    return;
  }
  if (r->succeeded()) {
    const int64_t fence = r->header().revision();
    leading_ = true;
    leader_seen_ = options_.candidate;
    KVRING_LOG(INFO) << "leading the coordinators (" << options_.candidate << ", fence revision " << fence << ")";
    absl::Status s = options_.on_lead ? options_.on_lead(fence) : absl::OkStatus();
    if (!s.ok()) {
      KVRING_LOG(ERROR) << "could not take the lead: " << s.message() << "; resigning";
      leading_ = false;
      if (absl::Status rv = etcd_->LeaseRevoke(lease_); !rv.ok())
        KVRING_LOG(WARNING) << "could not revoke the lease: " << rv.message();
      lease_ = 0;
      leader_seen_ = "?";
    }
    return;
  }
  std::string leader;
  if (r->responses_size() > 0 && r->responses(0).response_range().kvs_size() > 0)
    leader = r->responses(0).response_range().kvs(0).value();
  if (leader != leader_seen_ || (leader.empty() && !cause_seen_.empty())) {
    if (leader != leader_seen_)
      KVRING_LOG(INFO) << "standing by; the leader is " << (leader.empty() ? "(none)" : leader);
    Follow(leader, absl::OkStatus());
  }
}

}  // namespace kvring
