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
//   the MetadataStore (RocksDB, synced writes). After a restart the map
//   version moves forward, known nodes keep their state for one timeout of
//   grace, and nodes with an unknown incarnation are told to re-register.
//
// Thread-safe: gRPC calls and Tick() may run concurrently; `mu_` guards all
// state. The clock is injected (FakeClock in tests).
#pragma once

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
  void Tick() ABSL_LOCKS_EXCLUDED(mu_);
  v1::ShardMap CurrentMap() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  CoordinatorService(const CoordinatorOptions& o, std::unique_ptr<MetadataStore> store, const Clock* clock)
      : options_(o), store_(std::move(store)), clock_(clock) {}
  absl::Status Load() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status BumpMapVersionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistNodeLocked(const v1::NodeInfo& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistCounterLocked(const std::string& name, uint64_t v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckToken(const grpc::ServerContext& ctx, const std::string& expected, const char* what);
  // Admin, cluster, or any tenant token.
  absl::Status CheckAnyToken(const grpc::ServerContext& ctx) ABSL_LOCKS_EXCLUDED(mu_);

  struct Node {
    v1::NodeInfo info;
    absl::Time last_heartbeat;
  };
  const CoordinatorOptions options_;
  std::unique_ptr<MetadataStore> store_;
  const Clock* clock_;
  absl::Mutex mu_;
  uint64_t map_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tenants_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_tenant_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, Node> nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::TenantTable::Entry> tenants_ ABSL_GUARDED_BY(mu_);  // by name
  std::vector<uint32_t> deleted_ids_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring
