// CoordinatorLink: a daemon's session with the coordinators (one, or a list
// of which one leads: coordinator_channel.h moves its calls on to the leader
// when one dies or is a standby). Registers the
// node (retrying with backoff until the coordinator answers), heartbeats
// every interval on its own thread, re-registers when the coordinator asks
// (it restarted or declared this node dead), and refreshes the tenant
// directory whenever the coordinator's tenants version moves (reading the
// table page by page, as the coordinator serves it).
//
// Start() returns once the first registration and tenant fetch succeeded or
// `start_timeout` passed (UNAVAILABLE). The destructor stops the thread.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/security/credentials.h"
#include "kvring.grpc.pb.h"
#include "kvring/control/auth.h"
#include "kvring/protocol/coordinator_channel.h"

namespace kvring {

struct CoordinatorLinkOptions {
  std::string coordinator;  // host:port, or host:port,host:port,... (every coordinator)
  // Channel credentials towards the coordinator (null: plaintext).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string cluster_token;
  v1::NodeInfo node;  // node_id, addresses, capacity
  absl::Duration start_timeout = absl::Seconds(30);
  absl::Duration rpc_timeout = absl::Seconds(2);
  // Called after the tenant directory changed.
  std::function<void()> on_tenants_changed;
  // Returns the node's current load for heartbeats.
  std::function<void(v1::HeartbeatRequest*)> fill_load;
};

class CoordinatorLink {
 public:
  CoordinatorLink(CoordinatorLinkOptions options, TenantDirectory* tenants);
  ~CoordinatorLink();
  CoordinatorLink(const CoordinatorLink&) = delete;
  CoordinatorLink& operator=(const CoordinatorLink&) = delete;

  absl::Status Start();
  // Fetches the tenant table now (also done on every heartbeat that shows a
  // newer version). Thread-safe.
  absl::Status RefreshTenants();
  uint64_t incarnation() const { return incarnation_.load(); }
  uint64_t map_version() const { return map_version_.load(); }

 private:
  absl::Status Register();
  // The whole table, read page by page at one version.
  absl::StatusOr<v1::TenantTable> FetchTenantTable();
  void Loop();
  std::unique_ptr<grpc::ClientContext> Context() const;

  CoordinatorLinkOptions options_;
  TenantDirectory* tenants_;
  std::unique_ptr<CoordinatorChannel> channel_;
  absl::Status bad_address_;
  absl::Time last_tenant_read_ =
      absl::InfinitePast();  // (the heartbeat thread's)  // what Start() reports for an unusable address
  std::atomic<uint64_t> incarnation_{0}, map_version_{0};
  std::atomic<uint64_t> interval_ms_{500};
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace kvring
