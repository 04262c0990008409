#include "kvring/control/coordinator_service.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvring/cache/quantize.h"
#include "kvring/common/logging.h"
#include "kvring/common/quote.h"
#include "kvring/common/status_macros.h"

namespace kvring {
namespace {
constexpr uint32_t kVersion = 1;
// What one tenant may declare, and what one page of the tenant table holds:
// a page stays far below gRPC's default 4 MiB message limit.
constexpr int kMaxSharedNamespaces = 64;
constexpr size_t kTenantPageBytes = 1 << 20;
constexpr size_t kMinChosenTokenBytes = 32;

grpc::Status VersionCheck(uint32_t v) {
  if (v == kVersion) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      absl::StrCat("protocol version ", v, " not supported; this coordinator speaks version 1"));
}

bool ValidName(const std::string& s) {
  if (s.empty() || s.size() > 128) return false;
  for (char c : s) {
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' || c == ':' || c == '/'))
      return false;
  }
  return true;
}
}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorService>> CoordinatorService::Create(const CoordinatorOptions& o,
                                                                               std::unique_ptr<MetadataStore> store,
                                                                               const Clock* clock) {
  if (o.admin_token.empty() || o.cluster_token.empty()) {
    return absl::InvalidArgumentError("the coordinator needs an admin token and a cluster token");
  }
  if (o.replication == 0 || o.replication > 16) return absl::InvalidArgumentError("replication must be in [1, 16]");
  if (o.write_quorum > o.replication) return absl::InvalidArgumentError("write_quorum must be <= replication");
  if (o.heartbeat_timeout <= o.heartbeat_interval) {
    return absl::InvalidArgumentError("heartbeat_timeout must be longer than heartbeat_interval");
  }
  std::unique_ptr<CoordinatorService> c(new CoordinatorService(o, std::move(store), clock));
  KVRING_RETURN_IF_ERROR(c->Load());
  return c;
}

absl::Status CoordinatorService::Load() {
  absl::MutexLock l(&mu_);
  auto counter = [&](const std::string& name, uint64_t* out) -> absl::Status {
    auto v = store_->Get("meta/" + name);
    if (absl::IsNotFound(v.status())) return absl::OkStatus();
    if (!v.ok()) return v.status();
    if (!absl::SimpleAtoi(*v, out)) return absl::DataLossError("corrupt counter " + name);
    return absl::OkStatus();
  };
  KVRING_RETURN_IF_ERROR(counter("map_version", &map_version_));
  KVRING_RETURN_IF_ERROR(counter("tenants_version", &tenants_version_));
  KVRING_RETURN_IF_ERROR(counter("next_tenant_id", &next_tenant_id_));
  const absl::Time now = clock_->Now();
  absl::Status bad = absl::OkStatus();
  KVRING_RETURN_IF_ERROR(store_->ScanPrefix("node/", [&](const std::string&, const std::string& v) {
    v1::NodeInfo n;
    if (!n.ParseFromString(v)) {
      bad = absl::DataLossError("corrupt node record");
      return;
    }
    mu_.AssertHeld();                    // (Load holds it; the analysis does not see into the callback)
    nodes_[n.node_id()] = Node{n, now};  // one timeout of grace to heartbeat again
  }));
  KVRING_RETURN_IF_ERROR(store_->ScanPrefix("tenant/", [&](const std::string&, const std::string& v) {
    v1::TenantTable::Entry e;
    if (!e.ParseFromString(v)) {
      bad = absl::DataLossError("corrupt tenant record");
      return;
    }
    mu_.AssertHeld();
    tenants_[e.tenant().name()] = e;
  }));
  KVRING_RETURN_IF_ERROR(store_->ScanPrefix("deleted/", [&](const std::string& k, const std::string&) {
    uint32_t id = 0;
    if (!absl::SimpleAtoi(k.substr(8), &id)) {
      bad = absl::DataLossError("corrupt deleted-tenant record");
      return;
    }
    mu_.AssertHeld();
    deleted_ids_.push_back(id);
  }));
  KVRING_RETURN_IF_ERROR(bad);
  if (!nodes_.empty() || map_version_ > 0) KVRING_RETURN_IF_ERROR(BumpMapVersionLocked());
  KVRING_LOG(INFO) << "coordinator state: " << nodes_.size() << " nodes, " << tenants_.size()
                   << " tenants, map version " << map_version_;
  return absl::OkStatus();
}

absl::Status CoordinatorService::PersistCounterLocked(const std::string& name, uint64_t v) {
  return store_->Put("meta/" + name, absl::StrCat(v));
}

absl::Status CoordinatorService::BumpMapVersionLocked() {
  ++map_version_;
  return PersistCounterLocked("map_version", map_version_);
}

absl::Status CoordinatorService::PersistNodeLocked(const v1::NodeInfo& n) {
  return store_->Put("node/" + n.node_id(), n.SerializeAsString());
}

absl::Status CoordinatorService::CheckToken(const grpc::ServerContext& ctx, const std::string& expected,
                                            const char* what) {
  absl::StatusOr<std::string> tok = BearerToken(ctx);
  if (!tok.ok()) return tok.status();
  if (Sha256(*tok) != Sha256(expected))
    return absl::PermissionDeniedError(absl::StrCat("this call needs the ", what, " token"));
  return absl::OkStatus();
}

absl::Status CoordinatorService::CheckAnyToken(const grpc::ServerContext& ctx) {
  absl::StatusOr<std::string> tok = BearerToken(ctx);
  if (!tok.ok()) return tok.status();
  if (*tok == options_.admin_token || *tok == options_.cluster_token) return absl::OkStatus();
  const std::string d = Sha256(*tok);
  absl::MutexLock l(&mu_);
  for (const auto& [name, e] : tenants_) {
    if (e.token_sha256() == d) return absl::OkStatus();
  }
  return absl::UnauthenticatedError("unknown token");
}

grpc::Status CoordinatorService::RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                                              v1::RegisterNodeResponse* resp) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  if (absl::Status s = CheckToken(*ctx, options_.cluster_token, "cluster"); !s.ok()) return ToGrpc(s);
  const v1::NodeInfo& in = req->node();
  if (!ValidName(in.node_id()))
    return ToGrpc(absl::InvalidArgumentError("node_id must be 1-128 characters of [A-Za-z0-9-_.:/]"));
  if (in.grpc_address().empty() || in.grpc_address().find(':') == std::string::npos) {
    return ToGrpc(absl::InvalidArgumentError("grpc_address must be host:port"));
  }
  absl::MutexLock l(&mu_);
  Node& n = nodes_[in.node_id()];
  const uint64_t incarnation = n.info.incarnation() + 1;
  n.info = in;
  n.info.set_incarnation(incarnation);
  n.info.set_state(v1::NodeInfo::UP);
  n.last_heartbeat = clock_->Now();
  n.info.set_last_heartbeat_unix_ms(absl::ToUnixMillis(n.last_heartbeat));
  if (absl::Status s = PersistNodeLocked(n.info); !s.ok()) return ToGrpc(s);
  if (absl::Status s = BumpMapVersionLocked(); !s.ok()) return ToGrpc(s);
  KVRING_LOG(INFO) << "node " << in.node_id() << " registered at " << in.grpc_address() << " (incarnation "
                   << incarnation << "), map version " << map_version_;
  resp->set_map_version(map_version_);
  resp->set_incarnation(incarnation);
  resp->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                           v1::HeartbeatResponse* resp) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  if (absl::Status s = CheckToken(*ctx, options_.cluster_token, "cluster"); !s.ok()) return ToGrpc(s);
  absl::MutexLock l(&mu_);
  auto it = nodes_.find(req->node_id());
  resp->set_tenants_version(tenants_version_);
  if (it == nodes_.end() || it->second.info.incarnation() != req->incarnation()) {
    resp->set_reregister(true);
    resp->set_map_version(map_version_);
    return grpc::Status::OK;
  }
  Node& n = it->second;
  n.last_heartbeat = clock_->Now();
  n.info.set_last_heartbeat_unix_ms(absl::ToUnixMillis(n.last_heartbeat));
  if (n.info.state() != v1::NodeInfo::UP) {
    n.info.set_state(v1::NodeInfo::UP);
    if (absl::Status s = PersistNodeLocked(n.info); !s.ok()) return ToGrpc(s);
    if (absl::Status s = BumpMapVersionLocked(); !s.ok()) return ToGrpc(s);
    KVRING_LOG(INFO) << "node " << n.info.node_id() << " is UP again, map version " << map_version_;
  }
  resp->set_map_version(map_version_);
  return grpc::Status::OK;
}

void CoordinatorService::Tick() {
  absl::MutexLock l(&mu_);
  const absl::Time now = clock_->Now();
  for (auto& [id, n] : nodes_) {
    if (n.info.state() == v1::NodeInfo::UP && now - n.last_heartbeat > options_.heartbeat_timeout) {
      n.info.set_state(v1::NodeInfo::DOWN);
      absl::Status s = PersistNodeLocked(n.info);
      if (s.ok()) s = BumpMapVersionLocked();
      KVRING_LOG(WARNING) << "node " << id << " missed heartbeats for " << absl::FormatDuration(now - n.last_heartbeat)
                          << ": DOWN, map version " << map_version_ << (s.ok() ? "" : " (persist failed: ")
                          << (s.ok() ? "" : std::string(s.message()) + ")");
    }
  }
}

v1::ShardMap CoordinatorService::CurrentMap() {
  absl::MutexLock l(&mu_);
  v1::ShardMap m;
  m.set_version(map_version_);
  m.set_replication(options_.replication);
  m.set_virtual_nodes(options_.virtual_nodes);
  m.set_write_quorum(options_.write_quorum == 0 ? options_.replication : options_.write_quorum);
  m.set_sequence_chunk_blocks(options_.sequence_chunk_blocks);
  for (const auto& [id, n] : nodes_) *m.add_nodes() = n.info;
  return m;
}

grpc::Status CoordinatorService::GetShardMap(grpc::ServerContext* ctx, const v1::GetShardMapRequest* req,
                                             v1::ShardMap* resp) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  if (absl::Status s = CheckAnyToken(*ctx); !s.ok()) return ToGrpc(s);
  *resp = CurrentMap();
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::GetTenantTable(grpc::ServerContext* ctx, const v1::TenantTableRequest* req,
                                                v1::TenantTable* resp) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  if (absl::Status s = CheckToken(*ctx, options_.cluster_token, "cluster"); !s.ok()) return ToGrpc(s);
  absl::MutexLock l(&mu_);
  resp->set_tenants_version(tenants_version_);
  if (req->page_after().empty()) {
    for (uint32_t id : deleted_ids_) resp->add_deleted_tenant_ids(id);
  }
  size_t bytes = 0;
  for (auto it = tenants_.upper_bound(req->page_after()); it != tenants_.end(); ++it) {
    if (bytes > 0 && bytes + it->second.ByteSizeLong() > kTenantPageBytes) {
      resp->set_next_page_after(std::prev(it)->first);
      break;
    }
    bytes += it->second.ByteSizeLong();
    *resp->add_entries() = it->second;
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::WhoAmI(grpc::ServerContext* ctx, const v1::WhoAmIRequest* req, v1::Tenant* resp) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  absl::StatusOr<std::string> tok = BearerToken(*ctx);
  if (!tok.ok()) return ToGrpc(tok.status());
  const std::string d = Sha256(*tok);
  absl::MutexLock l(&mu_);
  for (const auto& [name, e] : tenants_) {
    if (e.token_sha256() == d) {
      *resp = e.tenant();
      return grpc::Status::OK;
    }
  }
  return ToGrpc(absl::UnauthenticatedError("unknown tenant token"));
}

grpc::Status CoordinatorService::CreateTenant(grpc::ServerContext* ctx, const v1::CreateTenantRequest* req,
                                              v1::CreateTenantResponse* resp) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  if (absl::Status s = CheckToken(*ctx, options_.admin_token, "admin"); !s.ok()) return ToGrpc(s);
  if (!ValidName(req->name()))
    return ToGrpc(absl::InvalidArgumentError("tenant name must be 1-128 characters of [A-Za-z0-9-_.:/]"));
  if (req->shared_namespaces_size() > kMaxSharedNamespaces) {
    return ToGrpc(
        absl::InvalidArgumentError(absl::StrCat("a tenant may belong to at most ", kMaxSharedNamespaces,
                                                " shared namespaces; ", req->shared_namespaces_size(), " given")));
  }
  for (const auto& s : req->shared_namespaces()) {
    if (!ValidName(s) || !absl::StartsWith(s, "shared/")) {
      return ToGrpc(absl::InvalidArgumentError("shared namespaces are named 'shared/<name>'"));
    }
  }
  if (KvEncoding enc; !ParseKvEncoding(req->kv_encoding(), &enc).ok()) {
    return ToGrpc(absl::InvalidArgumentError(
        absl::StrCat("kv_encoding ", Quote(req->kv_encoding()),
                     ": expected none, int8 or fp8, optionally /per-head, /per-token or /kivi")));
  }
  std::string token = req->token();
  if (token.empty()) {
    absl::StatusOr<std::string> t = GenerateToken();
    if (!t.ok()) return ToGrpc(t.status());
    token = *t;
  } else if (token == options_.admin_token || token == options_.cluster_token) {
    return ToGrpc(absl::InvalidArgumentError("a tenant's token may not be the admin or the cluster token"));
  } else if (token.size() < kMinChosenTokenBytes) {
    return ToGrpc(absl::InvalidArgumentError(absl::StrCat("a chosen token must have at least ", kMinChosenTokenBytes,
                                                          " characters (or let the coordinator generate one)")));
  }
  absl::MutexLock l(&mu_);
  if (tenants_.count(req->name()))
    return ToGrpc(absl::AlreadyExistsError(absl::StrCat("tenant ", Quote(req->name()), " exists")));
  const std::string digest = Sha256(token);
  for (const auto& [n, e] : tenants_) {
    if (e.token_sha256() == digest) return ToGrpc(absl::AlreadyExistsError("that token is already in use"));
  }
  v1::TenantTable::Entry e;
  e.mutable_tenant()->set_id(static_cast<uint32_t>(next_tenant_id_));
  e.mutable_tenant()->set_name(req->name());
  // The namespace is bound to the id, which is never reused: a name deleted
  // and created again is a new tenant that sees none of the old one's blocks.
  e.mutable_tenant()->set_namespace_(TenantNamespace(e.tenant().id()));
  for (const auto& s : req->shared_namespaces()) e.mutable_tenant()->add_shared_namespaces(s);
  e.mutable_tenant()->set_max_pinned_bytes(req->max_pinned_bytes());
  e.mutable_tenant()->set_kv_encoding(req->kv_encoding() == "none" ? "" : req->kv_encoding());
  e.mutable_tenant()->set_sequence_ttl_s(req->sequence_ttl_s());
  e.set_token_sha256(digest);
  if (absl::Status s = store_->Put("tenant/" + req->name(), e.SerializeAsString()); !s.ok()) return ToGrpc(s);
  ++next_tenant_id_;
  ++tenants_version_;
  if (absl::Status s = PersistCounterLocked("next_tenant_id", next_tenant_id_); !s.ok()) return ToGrpc(s);
  if (absl::Status s = PersistCounterLocked("tenants_version", tenants_version_); !s.ok()) return ToGrpc(s);
  tenants_[req->name()] = e;
  KVRING_LOG(INFO) << "tenant '" << req->name() << "' created (id " << e.tenant().id() << ")";
  *resp->mutable_tenant() = e.tenant();
  resp->set_token(token);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListTenants(grpc::ServerContext* ctx, const v1::ListTenantsRequest* req,
                                             v1::ListTenantsResponse* resp) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  if (absl::Status s = CheckToken(*ctx, options_.admin_token, "admin"); !s.ok()) return ToGrpc(s);
  absl::MutexLock l(&mu_);
  resp->set_tenants_version(tenants_version_);
  for (const auto& [n, e] : tenants_) *resp->add_tenants() = e.tenant();
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::DeleteTenant(grpc::ServerContext* ctx, const v1::DeleteTenantRequest* req,
                                              v1::DeleteTenantResponse*) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  if (absl::Status s = CheckToken(*ctx, options_.admin_token, "admin"); !s.ok()) return ToGrpc(s);
  absl::MutexLock l(&mu_);
  auto it = tenants_.find(req->name());
  if (it == tenants_.end()) return ToGrpc(absl::NotFoundError(absl::StrCat("no tenant ", Quote(req->name()))));
  const uint32_t id = it->second.tenant().id();
  // The tombstone first: daemons reclaim the namespace of every id listed.
  if (absl::Status s = store_->Put(absl::StrCat("deleted/", id), ""); !s.ok()) return ToGrpc(s);
  if (absl::Status s = store_->Delete("tenant/" + req->name()); !s.ok()) return ToGrpc(s);
  tenants_.erase(it);
  deleted_ids_.push_back(id);
  ++tenants_version_;
  if (absl::Status s = PersistCounterLocked("tenants_version", tenants_version_); !s.ok()) return ToGrpc(s);
  KVRING_LOG(INFO) << "tenant '" << req->name() << "' (id " << id << ") deleted; daemons reclaim its blocks";
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::SetTenantQuota(grpc::ServerContext* ctx, const v1::SetTenantQuotaRequest* req,
                                                v1::SetTenantQuotaResponse* resp) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  if (absl::Status s = CheckToken(*ctx, options_.admin_token, "admin"); !s.ok()) return ToGrpc(s);
  absl::MutexLock l(&mu_);
  auto it = tenants_.find(req->name());
  if (it == tenants_.end()) return ToGrpc(absl::NotFoundError(absl::StrCat("no tenant ", Quote(req->name()))));
  v1::TenantTable::Entry e = it->second;
  e.mutable_tenant()->set_max_pinned_bytes(req->max_pinned_bytes());
  if (absl::Status s = store_->Put("tenant/" + req->name(), e.SerializeAsString()); !s.ok()) return ToGrpc(s);
  it->second = e;
  ++tenants_version_;
  if (absl::Status s = PersistCounterLocked("tenants_version", tenants_version_); !s.ok()) return ToGrpc(s);
  *resp->mutable_tenant() = e.tenant();
  return grpc::Status::OK;
}

}  // namespace kvring
