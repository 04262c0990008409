#include "kvring/control/coordinator_service.h"

#include <optional>

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
  absl::MutexLock w(&c->write_mu_);
  absl::MutexLock l(&c->mu_);
  if (o.standby) {
    c->leading_ = false;
    // A store that cannot be read yet is read again by Tick.
    if (absl::Status s = c->LoadLocked(); !s.ok()) {
      KVRING_LOG(WARNING) << "standby: the metadata is not readable yet: " << s.message();
      c->stale_ = true;
    }
    return c;
  }
  KVRING_RETURN_IF_ERROR(c->LoadLocked());
  if (!c->nodes_.empty() || c->map_version_ > 0) KVRING_RETURN_IF_ERROR(c->WriteWithNewMapVersionLocked({}));
  return c;
}

absl::StatusOr<CoordinatorService::State> CoordinatorService::ReadState() {
  State st;
  auto counter = [&](const std::string& name, uint64_t* out) -> absl::Status {
    auto v = store_->Get("meta/" + name);
    if (absl::IsNotFound(v.status())) return absl::OkStatus();
    if (!v.ok()) return v.status();
    if (!absl::SimpleAtoi(*v, out)) return absl::DataLossError("corrupt counter " + name);
    return absl::OkStatus();
  };
  KVRING_RETURN_IF_ERROR(counter("map_version", &st.map_version));
  KVRING_RETURN_IF_ERROR(counter("tenants_version", &st.tenants_version));
  KVRING_RETURN_IF_ERROR(counter("next_tenant_id", &st.next_tenant_id));
  const absl::Time now = clock_->Now();
  absl::Status bad = absl::OkStatus();
  KVRING_RETURN_IF_ERROR(store_->ScanPrefix("node/", [&](const std::string&, const std::string& v) {
    v1::NodeInfo n;
    if (!n.ParseFromString(v)) {
      bad = absl::DataLossError("corrupt node record");
      return;
    }
    st.nodes[n.node_id()] = Node{n, now};  // one timeout of grace to heartbeat again
  }));
  KVRING_RETURN_IF_ERROR(store_->ScanPrefix("tenant/", [&](const std::string&, const std::string& v) {
    v1::TenantTable::Entry e;
    if (!e.ParseFromString(v)) {
      bad = absl::DataLossError("corrupt tenant record");
      return;
    }
    st.tenants[e.tenant().name()] = e;
  }));
  KVRING_RETURN_IF_ERROR(store_->ScanPrefix("deleted/", [&](const std::string& k, const std::string&) {
    uint32_t id = 0;
    if (!absl::SimpleAtoi(k.substr(8), &id)) {
      bad = absl::DataLossError("corrupt deleted-tenant record");
      return;
    }
    st.deleted_ids.push_back(id);
  }));
  KVRING_RETURN_IF_ERROR(bad);
  return st;
}

absl::Status CoordinatorService::LoadLocked() {
  mu_.Unlock();
  absl::StatusOr<State> st = ReadState();
  mu_.Lock();
  if (!st.ok()) return st.status();
  map_version_ = st->map_version;
  tenants_version_ = st->tenants_version;
  next_tenant_id_ = st->next_tenant_id;
  nodes_ = std::move(st->nodes);
  tenants_ = std::move(st->tenants);
  deleted_ids_ = std::move(st->deleted_ids);
  stale_ = false;
  KVRING_LOG(INFO) << "coordinator state: " << nodes_.size() << " nodes, " << tenants_.size()
                   << " tenants, map version " << map_version_;
  return absl::OkStatus();
}

absl::Status CoordinatorService::FreshLocked() {
  if (!stale_) return absl::OkStatus();
  return LoadLocked();
}

absl::Status CoordinatorService::WriteLocked(const MetadataWrite& w) {
  mu_.Unlock();
  absl::Status s = store_->Write(w);
  mu_.Lock();
  // A write that failed may still land (etcd can commit a request that timed
  // out): the next write starts from the store's state, not from memory.
  if (!s.ok()) stale_ = true;
  if (absl::IsFailedPrecondition(s) && leading_) {
    KVRING_LOG(WARNING) << "a metadata write was fenced (" << s.message() << "): standing by";
    leading_ = false;
    leader_.clear();
    stale_ = true;
  }
  return s;
}

absl::Status CoordinatorService::WriteWithNewMapVersionLocked(MetadataWrite w) {
  w.Put("meta/map_version", absl::StrCat(map_version_ + 1));
  KVRING_RETURN_IF_ERROR(WriteLocked(w));
  ++map_version_;
  return absl::OkStatus();
}

absl::Status CoordinatorService::CheckLeadingLocked(grpc::ServerContext* ctx) {
  if (leading_) {
    absl::Status held = lease_held_ ? lease_held_() : absl::OkStatus();
    if (held.ok()) return absl::OkStatus();
    // (The election thread steps down once its renewal is answered; until
    // then, the lease's own reason is the caller's.)
    return absl::UnavailableError(absl::StrCat("no coordinator leads right now: ", held.message(), "; retry shortly"));
  }
  if (!leader_.empty() && ctx != nullptr) ctx->AddTrailingMetadata("kvring-leader", leader_);
  if (!leader_.empty())
    return absl::UnavailableError(absl::StrCat("this coordinator is a standby; the leader is ", leader_));
  return absl::UnavailableError(absl::StrCat(
      "this coordinator is a standby and no coordinator leads right now",
      why_no_leader_.empty() ? std::string()
                             : absl::StrCat(" (the election cannot reach the metadata store: ", why_no_leader_, ")"),
      "; retry shortly"));
}

absl::Status CoordinatorService::CheckLeading(grpc::ServerContext* ctx) {
  absl::MutexLock l(&mu_);
  return CheckLeadingLocked(ctx);
}

absl::Status CoordinatorService::BecomeLeader(std::function<absl::Status()> lease_held) {
  absl::MutexLock w(&write_mu_);
  absl::MutexLock l(&mu_);
  leading_ = true;  // (the fence guards the store: a write that is not ours fails)
  lease_held_ = std::move(lease_held);
  absl::Status s = LoadLocked();
  if (s.ok()) s = WriteWithNewMapVersionLocked({});
  if (!s.ok()) {
    leading_ = false;
    stale_ = true;
    return s;
  }
  KVRING_LOG(INFO) << "leading: " << nodes_.size() << " nodes have " << absl::FormatDuration(options_.heartbeat_timeout)
                   << " to heartbeat; map version " << map_version_;
  return absl::OkStatus();
}

void CoordinatorService::BecomeStandby(const std::string& leader, const absl::Status& why_none) {
  absl::MutexLock l(&mu_);
  if (leading_) {
    KVRING_LOG(WARNING) << "standing by" << (leader.empty() ? std::string() : " for " + leader);
    stale_ = true;  // what the leader wrote from now on is read back from the store
  }
  leading_ = false;
  leader_ = leader;
  why_no_leader_ = leader.empty() ? std::string(why_none.message()) : std::string();
}

bool CoordinatorService::leading() {
  absl::MutexLock l(&mu_);
  return leading_ && (!lease_held_ || lease_held_().ok());
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
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      absl::MutexLock l(&mu_);
      for (const auto& [name, e] : tenants_) {
        if (e.token_sha256() == d) return absl::OkStatus();
      }
    }
    if (attempt == 0) CatchUpWithStore();
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
  if (absl::Status s = CheckLeading(ctx); !s.ok()) return ToGrpc(s);
  absl::MutexLock w(&write_mu_);
  absl::MutexLock l(&mu_);
  if (absl::Status s = CheckLeadingLocked(ctx); !s.ok()) return ToGrpc(s);
  if (absl::Status s = FreshLocked(); !s.ok()) return ToGrpc(s);
  auto known = nodes_.find(in.node_id());
  const uint64_t incarnation = (known == nodes_.end() ? 0 : known->second.info.incarnation()) + 1;
  Node n;
  n.info = in;
  n.info.set_incarnation(incarnation);
  n.info.set_state(v1::NodeInfo::UP);
  n.last_heartbeat = clock_->Now();
  n.info.set_last_heartbeat_unix_ms(absl::ToUnixMillis(n.last_heartbeat));
  if (absl::Status s =
          WriteWithNewMapVersionLocked(MetadataWrite().Put("node/" + in.node_id(), n.info.SerializeAsString()));
      !s.ok())
    return ToGrpc(s);
  nodes_[in.node_id()] = n;
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
  // A node that is UP only refreshes its time (mu_ alone); one coming back
  // is written first (write_mu_, then mu_).
  for (bool writer : {false, true}) {
    std::optional<absl::MutexLock> w;
    if (writer) {
      if (absl::Status s = CheckLeading(ctx); !s.ok()) return ToGrpc(s);
      w.emplace(&write_mu_);
    }
    absl::MutexLock l(&mu_);
    if (absl::Status s = CheckLeadingLocked(ctx); !s.ok()) return ToGrpc(s);
    auto it = nodes_.find(req->node_id());
    resp->set_tenants_version(tenants_version_);
    resp->set_map_version(map_version_);
    if (it == nodes_.end() || it->second.info.incarnation() != req->incarnation()) {
      resp->set_reregister(true);
      return grpc::Status::OK;
    }
    const absl::Time now = clock_->Now();
    if (it->second.info.state() != v1::NodeInfo::UP) {
      if (!writer) continue;
      write_mu_.AssertHeld();
      if (absl::Status s = FreshLocked(); !s.ok()) return ToGrpc(s);
      it = nodes_.find(req->node_id());
      if (it == nodes_.end() || it->second.info.incarnation() != req->incarnation()) {
        resp->set_reregister(true);
        return grpc::Status::OK;
      }
      v1::NodeInfo up = it->second.info;
      up.set_state(v1::NodeInfo::UP);
      up.set_last_heartbeat_unix_ms(absl::ToUnixMillis(now));
      write_mu_.AssertHeld();
      if (absl::Status s =
              WriteWithNewMapVersionLocked(MetadataWrite().Put("node/" + up.node_id(), up.SerializeAsString()));
          !s.ok())
        return ToGrpc(s);
      nodes_[up.node_id()].info = up;
      KVRING_LOG(INFO) << "node " << up.node_id() << " is UP again, map version " << map_version_;
    }
    Node& n = nodes_[req->node_id()];
    n.last_heartbeat = now;
    n.info.set_last_heartbeat_unix_ms(absl::ToUnixMillis(now));
    resp->set_map_version(map_version_);
    return grpc::Status::OK;
  }
  return grpc::Status::OK;  // (not reached)
}

bool CoordinatorService::FollowStore() {
  absl::MutexLock wl(&write_mu_);
  return FollowStoreLocked();
}

void CoordinatorService::CatchUpWithStore() {
  {
    absl::MutexLock l(&mu_);
    if (leading_ || !store_readable_) return;  // (etcd away: the cache answers at once)
  }
  // After a refresh under way (it may have read the counters before the
  // write), but never long: a refresh stuck on an etcd that went away holds
  // write_mu_ for its timeout, and then the cached state answers.
  const absl::Time give_up = absl::Now() + absl::Milliseconds(500);
  for (;;) {
    if (write_mu_.TryLock()) {
      FollowStoreLocked();
      write_mu_.Unlock();
      return;
    }
    if (absl::Now() > give_up) return;
    absl::SleepFor(absl::Milliseconds(1));
  }
}

bool CoordinatorService::FollowStoreLocked() {
  absl::MutexLock l(&mu_);
  if (leading_) return false;
  // (read without mu_: the cached state keeps serving while etcd is away)
  uint64_t map_version = 0, tenants_version = 0;
  mu_.Unlock();
  auto v = store_->Get("meta/map_version");
  auto t = store_->Get("meta/tenants_version");
  mu_.Lock();
  store_readable_ = (v.ok() || absl::IsNotFound(v.status())) && (t.ok() || absl::IsNotFound(t.status()));
  if (!store_readable_) return true;
  if (v.ok()) (void)absl::SimpleAtoi(*v, &map_version);
  if (t.ok()) (void)absl::SimpleAtoi(*t, &tenants_version);
  if (leading_) return false;  // (it began leading meanwhile)
  if (stale_ || map_version != map_version_ || tenants_version != tenants_version_) {
    if (absl::Status s = LoadLocked(); !s.ok()) KVRING_LOG(WARNING) << "standby: reload failed: " << s.message();
  }
  return true;
}

void CoordinatorService::Tick() {
  if (FollowStore()) return;
  absl::MutexLock wl(&write_mu_);
  absl::MutexLock l(&mu_);
  if (!leading_) return;
  if (lease_held_ && !lease_held_().ok()) return;  // (woken from a pause: the election decides first)
  if (absl::Status s = FreshLocked(); !s.ok()) return;
  const absl::Time now = clock_->Now();
  MetadataWrite w;
  std::vector<std::string> down;
  for (auto& [id, n] : nodes_) {
    if (n.info.state() == v1::NodeInfo::UP && now - n.last_heartbeat > options_.heartbeat_timeout) {
      v1::NodeInfo d = n.info;
      d.set_state(v1::NodeInfo::DOWN);
      w.Put("node/" + id, d.SerializeAsString());
      down.push_back(id);
    }
  }
  if (down.empty()) return;
  absl::Status s = WriteWithNewMapVersionLocked(std::move(w));
  for (const auto& id : down) {
    Node& n = nodes_[id];
    if (s.ok()) n.info.set_state(v1::NodeInfo::DOWN);
    KVRING_LOG(WARNING) << "node " << id << " missed heartbeats for " << absl::FormatDuration(now - n.last_heartbeat)
                        << (s.ok() ? absl::StrCat(": DOWN, map version ", map_version_)
                                   : absl::StrCat(": not marked DOWN, the write failed: ", s.message()));
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
  if (req->page_after().empty()) CatchUpWithStore();  // (a standby: up to what the leader wrote)
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
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      absl::MutexLock l(&mu_);
      for (const auto& [name, e] : tenants_) {
        if (e.token_sha256() == d) {
          *resp = e.tenant();
          return grpc::Status::OK;
        }
      }
    }
    // A tenant the leader created a moment ago: a standby reads it now.
    if (attempt == 0) CatchUpWithStore();
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
  if (absl::Status s = CheckLeading(ctx); !s.ok()) return ToGrpc(s);
  absl::MutexLock w(&write_mu_);
  absl::MutexLock l(&mu_);
  if (absl::Status s = CheckLeadingLocked(ctx); !s.ok()) return ToGrpc(s);
  if (absl::Status s = FreshLocked(); !s.ok()) return ToGrpc(s);
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
  if (absl::Status s = WriteLocked(MetadataWrite()
                                       .Put("tenant/" + req->name(), e.SerializeAsString())
                                       .Put("meta/next_tenant_id", absl::StrCat(next_tenant_id_ + 1))
                                       .Put("meta/tenants_version", absl::StrCat(tenants_version_ + 1)));
      !s.ok())
    return ToGrpc(s);
  ++next_tenant_id_;
  ++tenants_version_;
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
  CatchUpWithStore();  // a standby answers with what the leader wrote up to now
  absl::MutexLock l(&mu_);
  resp->set_tenants_version(tenants_version_);
  for (const auto& [n, e] : tenants_) *resp->add_tenants() = e.tenant();
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::DeleteTenant(grpc::ServerContext* ctx, const v1::DeleteTenantRequest* req,
                                              v1::DeleteTenantResponse*) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  if (absl::Status s = CheckToken(*ctx, options_.admin_token, "admin"); !s.ok()) return ToGrpc(s);
  if (absl::Status s = CheckLeading(ctx); !s.ok()) return ToGrpc(s);
  absl::MutexLock w(&write_mu_);
  absl::MutexLock l(&mu_);
  if (absl::Status s = CheckLeadingLocked(ctx); !s.ok()) return ToGrpc(s);
  if (absl::Status s = FreshLocked(); !s.ok()) return ToGrpc(s);
  auto it = tenants_.find(req->name());
  if (it == tenants_.end()) return ToGrpc(absl::NotFoundError(absl::StrCat("no tenant ", Quote(req->name()))));
  const uint32_t id = it->second.tenant().id();
  // The tombstone with the deletion, in one write: daemons reclaim the
  // namespace of every id listed.
  if (absl::Status s = WriteLocked(MetadataWrite()
                                       .Delete("tenant/" + req->name())
                                       .Put(absl::StrCat("deleted/", id), "")
                                       .Put("meta/tenants_version", absl::StrCat(tenants_version_ + 1)));
      !s.ok())
    return ToGrpc(s);
  tenants_.erase(it);
  deleted_ids_.push_back(id);
  ++tenants_version_;
  KVRING_LOG(INFO) << "tenant '" << req->name() << "' (id " << id << ") deleted; daemons reclaim its blocks";
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::SetTenantQuota(grpc::ServerContext* ctx, const v1::SetTenantQuotaRequest* req,
                                                v1::SetTenantQuotaResponse* resp) {
  if (auto v = VersionCheck(req->version()); !v.ok()) return v;
  if (absl::Status s = CheckToken(*ctx, options_.admin_token, "admin"); !s.ok()) return ToGrpc(s);
  if (absl::Status s = CheckLeading(ctx); !s.ok()) return ToGrpc(s);
  absl::MutexLock w(&write_mu_);
  absl::MutexLock l(&mu_);
  if (absl::Status s = CheckLeadingLocked(ctx); !s.ok()) return ToGrpc(s);
  if (absl::Status s = FreshLocked(); !s.ok()) return ToGrpc(s);
  auto it = tenants_.find(req->name());
  if (it == tenants_.end()) return ToGrpc(absl::NotFoundError(absl::StrCat("no tenant ", Quote(req->name()))));
  v1::TenantTable::Entry e = it->second;
  e.mutable_tenant()->set_max_pinned_bytes(req->max_pinned_bytes());
  if (absl::Status s = WriteLocked(MetadataWrite()
                                       .Put("tenant/" + req->name(), e.SerializeAsString())
                                       .Put("meta/tenants_version", absl::StrCat(tenants_version_ + 1)));
      !s.ok())
    return ToGrpc(s);
  it->second = e;
  ++tenants_version_;
  *resp->mutable_tenant() = e.tenant();
  return grpc::Status::OK;
}

}  // namespace kvring
