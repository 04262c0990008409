// RenewableChannel: a gRPC channel to one address that is made anew after a
// call through it found the address unreachable (at most once a second).
// gRPC's own reconnection can keep a channel failing for its whole reconnect
// backoff (20 s by default), and a channel whose first attempts met a peer
// that was still starting (etcd listens before it serves) was seen failing
// for longer; a fresh channel connects at once. Used where a peer going away
// and coming back is part of the contract: coordinators and etcd members.
// Thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"

namespace kvring {

class RenewableChannel {
 public:
  RenewableChannel(std::string address, std::shared_ptr<grpc::ChannelCredentials> credentials);
  std::shared_ptr<grpc::Channel> Get() ABSL_LOCKS_EXCLUDED(mu_);
  // After a call through `used` failed as UNAVAILABLE: the next Get() has a
  // new channel (unless it was renewed less than a second ago).
  void Renew(const std::shared_ptr<grpc::Channel>& used) ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& address() const { return address_; }

 private:
  std::shared_ptr<grpc::Channel> Make() const;
  const std::string address_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  absl::Mutex mu_;
  std::shared_ptr<grpc::Channel> channel_ ABSL_GUARDED_BY(mu_);
  absl::Time made_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring
