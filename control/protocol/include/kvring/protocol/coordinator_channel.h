// CoordinatorChannel: a cluster's coordinators as callers reach them. The
// address is one host:port or a list "a:7000,b:7000,...". A call goes first to
// the coordinator that last answered it, and moves on to the next when one is
// unreachable (UNAVAILABLE, DEADLINE_EXCEEDED) or is a standby refusing a
// write (UNAVAILABLE, with the leader in its trailing metadata
// "kvring-leader": tried next, also when it is not on the list, so one
// address in front of every coordinator, such as a Kubernetes Service, is
// enough). So a client or daemon
// given every coordinator carries on through a leader's death without a
// restart (docs/CONTROL-PLANE.md). The error of a call that no coordinator
// answered names each one and what it said. Thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/security/credentials.h"
#include "kvring.grpc.pb.h"
#include "kvring/protocol/renewable_channel.h"

namespace kvring {

class CoordinatorChannel {
 public:
  // INVALID_ARGUMENT when `addresses` holds no host:port.
  static absl::StatusOr<std::unique_ptr<CoordinatorChannel>> Create(
      const std::string& addresses, std::shared_ptr<grpc::ChannelCredentials> credentials);

  // Runs `rpc` with a fresh context from `context` on each coordinator in
  // turn (see above) and returns the first answer, or the last refusal.
  using Rpc = std::function<grpc::Status(v1::Coordinator::Stub&, grpc::ClientContext*)>;
  absl::Status Call(const std::function<std::unique_ptr<grpc::ClientContext>()>& context, const Rpc& rpc);

  const std::string& addresses() const { return addresses_; }
  // The coordinator that answered last.
  std::string current() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  CoordinatorChannel() = default;
  std::shared_ptr<RenewableChannel> Learned(const std::string& leader) ABSL_LOCKS_EXCLUDED(mu_);

  std::string addresses_;
  std::shared_ptr<grpc::ChannelCredentials> creds_;
  std::vector<std::shared_ptr<RenewableChannel>> channels_;  // the list (fixed after Create)
  absl::Mutex mu_;
  std::string preferred_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<RenewableChannel> learned_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring
