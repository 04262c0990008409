// CoordinatorService: membership, the versioned shard map, and tenants.
//
// - Nodes RegisterNode (cluster token) and Heartbeat every
//   heartbeat_interval; a node silent for heartbeat_timeout is marked DOWN.
//   Every change of membership or state bumps the map version.
// - Tenants are created by the admin; each gets an id that is never reused,
//   its own namespace "tenant/<id>" (a name is a label: a tenant deleted and
//   created again under the same name sees none of the old one's blocks), and
//   a bearer token (generated, 256 bits) of which only the SHA-256 is kept.
//   A deleted tenant's id is kept as a tombstone in the tenant table, and
//   every daemon reclaims that namespace's blocks in the background.
// - Daemons read the tenant table in pages of at most 1 MiB.
// - Everything the coordinator must not lose (nodes, tenants, versions) is in
//   the MetadataStore (RocksDB with synced writes, or etcd), written before
//   the call that changed it is answered, in one atomic write, and only then
//   applied in memory. After a restart the map version moves forward, known
//   nodes keep their state for one timeout of grace, and nodes with an
//   unknown incarnation are told to re-register.
// - Leadership (the etcd mode, docs/CONTROL-PLANE.md): several coordinators
//   share one etcd store and one leads (leader_election.h). A service created
//   with options.standby serves reads (the shard map, the tenant table,
//   WhoAmI, ListTenants) from the store's state, reloaded whenever the
//   store's versions move (Tick), and refuses every write (node registration
//   and heartbeats, tenant changes) with UNAVAILABLE naming the leader (also
//   in the trailing metadata "kvring-leader"), so callers move on to it.
//   BecomeLeader reloads everything, gives every known node one heartbeat
//   timeout of grace (a new leader does not declare live nodes dead because
//   it has not heard from them yet) and moves the map version forward.
//
// Thread-safe: gRPC calls, Tick() and the leadership calls may run
// concurrently; `mu_` guards all state. The clock is injected (FakeClock in
// tests).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvring.grpc.pb.h"
#include "kvring/common/clock.h"
#include "kvring/control/auth.h"
#include "kvring/control/metadata_store.h"

namespace kvring {

struct CoordinatorOptions {
  // Replicas per block (R). Default: 2.
  uint32_t replication = 2;
  // Replica acknowledgements a write needs (W <= R). Default: 0 = R.
  uint32_t write_quorum = 0;
  // Points per node on the hash ring. Default: 64.
  uint32_t virtual_nodes = 64;
  // Blocks per contiguous chunk of an attention sequence. Default: 64.
  uint32_t sequence_chunk_blocks = 64;
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  // Silence after which a node is DOWN. Default: 3 s.
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // Bearer token for tenant administration. Required.
  std::string admin_token;
  // Bearer token nodes present to register and heartbeat. Required.
  std::string cluster_token;
  // Starts as a standby (the etcd mode): reads only, until BecomeLeader.
  bool standby = false;
};

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorService>> Create(const CoordinatorOptions& options,
                                                                    std::unique_ptr<MetadataStore> store,
                                                                    const Clock* clock);

  grpc::Status RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                            v1::RegisterNodeResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override;
  grpc::Status GetTenantTable(grpc::ServerContext* ctx, const v1::TenantTableRequest* req,
                              v1::TenantTable* resp) override;
  grpc::Status GetShardMap(grpc::ServerContext* ctx, const v1::GetShardMapRequest* req, v1::ShardMap* resp) override;
  grpc::Status WhoAmI(grpc::ServerContext* ctx, const v1::WhoAmIRequest* req, v1::Tenant* resp) override;
  grpc::Status CreateTenant(grpc::ServerContext* ctx, const v1::CreateTenantRequest* req,
                            v1::CreateTenantResponse* resp) override;
  grpc::Status ListTenants(grpc::ServerContext* ctx, const v1::ListTenantsRequest* req,
                           v1::ListTenantsResponse* resp) override;
  grpc::Status DeleteTenant(grpc::ServerContext* ctx, const v1::DeleteTenantRequest* req,
                            v1::DeleteTenantResponse* resp) override;
  grpc::Status SetTenantQuota(grpc::ServerContext* ctx, const v1::SetTenantQuotaRequest* req,
                              v1::SetTenantQuotaResponse* resp) override;

  // Marks silent nodes DOWN. Called by the server's monitor thread (and by
  // tests, after advancing a FakeClock).
  // A standby reloads the state when the store's versions moved.
  void Tick() ABSL_LOCKS_EXCLUDED(mu_);
  v1::ShardMap CurrentMap() ABSL_LOCKS_EXCLUDED(mu_);

  // Starts leading: reloads the state, grants the grace, moves the map
  // version forward. Writes are accepted while `lease_held()` is OK (null:
  // always); when it is not, callers are told its reason. An error leaves it
  // a standby.
  absl::Status BecomeLeader(std::function<absl::Status()> lease_held) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops leading; `leader` ("" when unknown) is named to callers of writes.
  // While none is known, `why_none` (the election's error reaching the
  // metadata store, OK if it answered) is told them too.
  void BecomeStandby(const std::string& leader, const absl::Status& why_none = absl::OkStatus())
      ABSL_LOCKS_EXCLUDED(mu_);
  bool leading() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  CoordinatorService(const CoordinatorOptions& o, std::unique_ptr<MetadataStore> store, const Clock* clock)
      : options_(o), store_(std::move(store)), clock_(clock) {}
  struct Node {
    v1::NodeInfo info;
    absl::Time last_heartbeat;
  };
  struct State {
    uint64_t map_version = 0, tenants_version = 0, next_tenant_id = 1;
    std::map<std::string, Node> nodes;
    std::map<std::string, v1::TenantTable::Entry> tenants;
    std::vector<uint32_t> deleted_ids;
  };
  // The store's state; known nodes get one timeout of grace. No lock: the
  // store is read without holding mu_, so reads of the state go on while
  // the store is slow or away.
  absl::StatusOr<State> ReadState();
  // Replaces the state with the store's (write_mu_ keeps writers out).
  absl::Status LoadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_, mu_);
  // Writes `w` plus the map version moved by one, then applies the version.
  absl::Status WriteWithNewMapVersionLocked(MetadataWrite w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_, mu_);
  // Writes `w`, releasing mu_ meanwhile (write_mu_ keeps the state the
  // writer read in place); a fenced write (another coordinator leads now)
  // makes this one a standby.
  absl::Status WriteLocked(const MetadataWrite& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_, mu_);
  // Reloads the state when a write failed since the last load.
  absl::Status FreshLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_, mu_);
  // A standby reloads the state if the store's versions moved (true); a
  // leader does nothing (false).
  bool FollowStore() ABSL_LOCKS_EXCLUDED(write_mu_, mu_);
  bool FollowStoreLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // The same for a read on a standby, so it sees every write the leader
  // acknowledged before the read began: it waits for a refresh under way
  // (up to 500 ms) and then checks the store itself. Only when the store
  // answered the last time (etcd away: the cached state serves at once).
  void CatchUpWithStore() ABSL_LOCKS_EXCLUDED(write_mu_, mu_);
  // OK while this coordinator may write; else UNAVAILABLE naming the leader
  // (and the leader in ctx's trailing metadata).
  absl::Status CheckLeadingLocked(grpc::ServerContext* ctx) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same, checked before a write takes write_mu_: a standby refuses at
  // once, never behind a refresh or a write stuck on an unreachable store.
  absl::Status CheckLeading(grpc::ServerContext* ctx) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CheckToken(const grpc::ServerContext& ctx, const std::string& expected, const char* what);
  // Admin, cluster, or any tenant token.
  absl::Status CheckAnyToken(const grpc::ServerContext& ctx) ABSL_LOCKS_EXCLUDED(mu_);

  const CoordinatorOptions options_;
  std::unique_ptr<MetadataStore> store_;
  const Clock* clock_;
  // Writers of the store take write_mu_ first, then mu_ (which they drop
  // while the store writes).
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  uint64_t map_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tenants_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_tenant_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, Node> nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::TenantTable::Entry> tenants_ ABSL_GUARDED_BY(mu_);  // by name
  std::vector<uint32_t> deleted_ids_ ABSL_GUARDED_BY(mu_);
  bool leading_ ABSL_GUARDED_BY(mu_) = true;
  std::function<absl::Status()> lease_held_ ABSL_GUARDED_BY(mu_);
  std::string leader_ ABSL_GUARDED_BY(mu_);
  std::string why_no_leader_ ABSL_GUARDED_BY(mu_);
  // The state must be reloaded before it is used for a write (a standby's
  // after the leader wrote; anyone's after a failed write).
  bool stale_ ABSL_GUARDED_BY(mu_) = false;
  bool store_readable_ ABSL_GUARDED_BY(mu_) = true;  // the last standby refresh reached the store
};

}  // namespace kvring
