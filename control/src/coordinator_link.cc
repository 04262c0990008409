#include "kvring/control/coordinator_link.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "kvring/common/logging.h"
#include "kvring/common/status_macros.h"

namespace kvring {

CoordinatorLink::CoordinatorLink(CoordinatorLinkOptions options, TenantDirectory* tenants)
    : options_(std::move(options)), tenants_(tenants) {
  auto channel = CoordinatorChannel::Create(options_.coordinator, options_.credentials);
  if (channel.ok()) {
    channel_ = std::move(*channel);
  } else {
    bad_address_ = channel.status();
  }
}

CoordinatorLink::~CoordinatorLink() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

std::unique_ptr<grpc::ClientContext> CoordinatorLink::Context() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata("authorization", "Bearer " + options_.cluster_token);
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(options_.rpc_timeout));
  return ctx;
}

absl::Status CoordinatorLink::Register() {
  v1::RegisterNodeRequest req;
  req.set_version(1);
  *req.mutable_node() = options_.node;
  v1::RegisterNodeResponse resp;
  KVRING_RETURN_IF_ERROR(channel_->Call(
      [this] { return Context(); },
      [&](v1::Coordinator::Stub& stub, grpc::ClientContext* ctx) { return stub.RegisterNode(ctx, req, &resp); }));
  incarnation_ = resp.incarnation();
  map_version_ = resp.map_version();
  if (resp.heartbeat_interval_ms() > 0) interval_ms_ = resp.heartbeat_interval_ms();
  KVRING_LOG(INFO) << "registered with coordinator " << channel_->current() << " as " << options_.node.node_id()
                   << " (incarnation " << resp.incarnation() << ", map version " << resp.map_version() << ")";
  return absl::OkStatus();
}

absl::StatusOr<v1::TenantTable> CoordinatorLink::FetchTenantTable() {
  // Page by page; a version that moves between pages starts it again.
  for (int attempt = 0; attempt < 8; ++attempt) {
    v1::TenantTable all;
    std::string after;
    bool moved = false;
    for (bool first = true;; first = false) {
      v1::TenantTableRequest req;
      req.set_version(1);
      req.set_page_after(after);
      v1::TenantTable page;
      KVRING_RETURN_IF_ERROR(channel_->Call([this] { return Context(); },
                                            [&](v1::Coordinator::Stub& stub, grpc::ClientContext* ctx) {
                                              page.Clear();
                                              return stub.GetTenantTable(ctx, req, &page);
                                            }));
      if (first) {
        all.set_tenants_version(page.tenants_version());
        *all.mutable_deleted_tenant_ids() = page.deleted_tenant_ids();
      } else if (page.tenants_version() != all.tenants_version()) {
        moved = true;
        break;
      }
      for (auto& e : *page.mutable_entries()) *all.add_entries() = std::move(e);
      if (page.next_page_after().empty()) break;
      if (page.next_page_after() <= after) return absl::InternalError("the tenant table's pages do not advance");
      after = page.next_page_after();
    }
    if (!moved) return all;
  }
  return absl::UnavailableError("the tenant table kept changing while it was read");
}

absl::Status CoordinatorLink::RefreshTenants() {
  absl::StatusOr<v1::TenantTable> fetched = FetchTenantTable();
  if (!fetched.ok()) return fetched.status();
  const v1::TenantTable& table = *fetched;
  const uint64_t before = tenants_->version();
  tenants_->Update(table);
  if (table.tenants_version() != before || before == 0) {
    KVRING_LOG(INFO) << "tenant directory at version " << table.tenants_version() << " (" << table.entries_size()
                     << " tenants)";
    if (options_.on_tenants_changed) options_.on_tenants_changed();
  }
  return absl::OkStatus();
}

absl::Status CoordinatorLink::Start() {
  if (!bad_address_.ok()) return bad_address_;
  const absl::Time deadline = absl::Now() + options_.start_timeout;
  absl::Duration backoff = absl::Milliseconds(100);
  absl::Status last;
  while (absl::Now() < deadline) {
    last = Register();
    if (last.ok()) last = RefreshTenants();
    if (last.ok()) break;
    if (absl::IsPermissionDenied(last) || absl::IsUnauthenticated(last) || absl::IsInvalidArgument(last)) return last;
    KVRING_LOG(WARNING) << "coordinator " << options_.coordinator << " not reachable yet (" << last.message()
                        << "); retrying in " << absl::FormatDuration(backoff);
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
  if (!last.ok()) {
    return absl::UnavailableError(absl::StrCat("could not register with coordinator ", options_.coordinator, " within ",
                                               absl::FormatDuration(options_.start_timeout), ": ", last.message()));
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void CoordinatorLink::Loop() {
  while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(interval_ms_.load()))) {
    v1::HeartbeatRequest req;
    req.set_version(1);
    req.set_node_id(options_.node.node_id());
    req.set_incarnation(incarnation_.load());
    if (options_.fill_load) options_.fill_load(&req);
    v1::HeartbeatResponse resp;
    absl::Status s = channel_->Call([this] { return Context(); },
                                    [&](v1::Coordinator::Stub& stub, grpc::ClientContext* ctx) {
                                      resp.Clear();
                                      return stub.Heartbeat(ctx, req, &resp);
                                    });
    if (!s.ok()) {
      KVRING_LOG(WARNING) << "heartbeat to " << options_.coordinator << " failed: " << s.message();
      // No leader to heartbeat to (a failover, or etcd without quorum): the
      // tenant table is still read from any coordinator, so a tenant
      // created just before is served (at most once a second).
      if (absl::Now() - last_tenant_read_ > absl::Seconds(1)) {
        last_tenant_read_ = absl::Now();
        if (absl::Status r = RefreshTenants(); !r.ok()) KVRING_LOG(WARNING) << "tenant refresh failed: " << r.message();
      }
      continue;
    }
    map_version_ = resp.map_version();
    if (resp.reregister()) {
      KVRING_LOG(WARNING) << "coordinator asks this node to re-register";
      if (absl::Status r = Register(); !r.ok()) KVRING_LOG(WARNING) << "re-registration failed: " << r.message();
    }
    if (resp.tenants_version() != tenants_->version()) {
      if (absl::Status r = RefreshTenants(); !r.ok()) KVRING_LOG(WARNING) << "tenant refresh failed: " << r.message();
    }
  }
}

}  // namespace kvring
