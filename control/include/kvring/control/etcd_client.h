// EtcdClient: the calls of etcd's v3 gRPC API that the coordinator uses
// (Range, Txn; lease grant, keep-alive and revoke), over a list of members.
// A call goes to the member that answered last and moves on to the next when
// one is unreachable or has no quorum behind it (UNAVAILABLE,
// DEADLINE_EXCEEDED), so one dead member costs nothing and a lost quorum is
// an UNAVAILABLE that names every member tried. Each attempt has its own
// deadline (rpc_timeout). Thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "etcd_rpc.grpc.pb.h"
#include "grpcpp/security/credentials.h"
#include "kvring/protocol/renewable_channel.h"

namespace kvring {

struct EtcdOptions {
  // Members, "host:port" each (their client URLs without the scheme).
  std::vector<std::string> endpoints;
  // TLS towards etcd (null: plaintext).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  absl::Duration rpc_timeout = absl::Seconds(2);
};

class EtcdClient {
 public:
  // INVALID_ARGUMENT for an empty list or an endpoint that is not host:port
  // (a scheme such as http:// is accepted and dropped).
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(EtcdOptions options);
  // "a:1,b:2" -> {"a:1", "b:2"}; INVALID_ARGUMENT when empty.
  static absl::StatusOr<std::vector<std::string>> ParseEndpoints(const std::string& list);
  // The end of the range of keys that start with `prefix` (etcd's range_end).
  static std::string PrefixEnd(const std::string& prefix);

  absl::StatusOr<etcdserverpb::RangeResponse> Range(const etcdserverpb::RangeRequest& req);
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(const etcdserverpb::TxnRequest& req);
  // A lease of `ttl` (etcd may grant a longer one: the response says).
  absl::StatusOr<etcdserverpb::LeaseGrantResponse> LeaseGrant(absl::Duration ttl);
  absl::Status LeaseRevoke(int64_t id);
  // One keep-alive round trip: the seconds the lease has left (0: it expired
  // or was revoked; its keys are gone).
  absl::StatusOr<int64_t> LeaseKeepAlive(int64_t id);

  const std::vector<std::string>& endpoints() const { return options_.endpoints; }

 private:
  explicit EtcdClient(EtcdOptions o) : options_(std::move(o)) {}
  std::unique_ptr<grpc::ClientContext> Context() const;
  // Runs `rpc` against each member in turn, starting with the last one that
  // answered, until one answers (or fails with an error that is not about
  // reaching it).
  template <typename Rpc>
  absl::Status OnAnyMember(const char* what, Rpc&& rpc);

  EtcdOptions options_;
  std::vector<std::unique_ptr<RenewableChannel>> members_;
  std::atomic<size_t> preferred_{0};
};

}  // namespace kvring
