// NodeCore: what a daemon does for each request, independent of how the
// request arrived (gRPC: NodeService; UCX: the daemon's UcxRpcServer).
//
// Every request is authenticated (the tenant comes from the token, the
// namespace from the tenant) and validated (request_validation.h) before any
// of it is used; errors are statuses with messages, never crashes. A tenant
// only ever sees blocks of its own namespace or a shared one it belongs to.
// Payload bytes are never logged.
//
// Thread-safe: handlers run concurrently on the server's threads.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvring.pb.h"
#include "kvring/cache/block_store.h"
#include "kvring/common/metrics.h"
#include "kvring/common/thread_pool.h"
#include "kvring/control/auth.h"
#include "kvring/control/request_validation.h"
#include "kvring/control/sequence_table.h"

namespace kvring {

struct NodeCoreOptions {
  std::string node_id;
  std::string ucx_address;  // advertised in Stats
  RequestLimits limits;
};

class NodeCore {
 public:
  // None of the pointers is owned; all must outlive the core.
  NodeCore(NodeCoreOptions options, BlockStore* store, SequenceTable* sequences, TenantDirectory* tenants,
           ThreadPool* pool, MetricsRegistry* metrics);

  absl::StatusOr<v1::Tenant> Authenticate(const std::string& token) const { return tenants_->ByToken(token); }
  TenantDirectory* tenants() const { return tenants_; }

  absl::Status Lookup(const v1::Tenant& t, const v1::LookupRequest& req, v1::LookupResponse* resp);
  // `external` (optional): payloads that arrived beside the message (UCX),
  // one per block; when empty the payloads are inline in `req`.
  absl::Status Put(const v1::Tenant& t, const v1::PutRequest& req, absl::Span<const absl::Span<const uint8_t>> external,
                   v1::PutResponse* resp);
  // With `held` non-null, payloads stay in the store (read holds returned
  // for a zero-copy send) instead of being copied into `resp`.
  absl::Status Get(const v1::Tenant& t, const v1::GetRequest& req, v1::GetResponse* resp,
                   std::vector<PinnedBlock>* held = nullptr);
  // Whether Get(t, req) would not touch the disk tier (every block in host
  // memory or not held; a request that fails validation counts as staying).
  bool GetStaysInMemory(const v1::Tenant& t, const v1::GetRequest& req);
  absl::Status Pin(const v1::Tenant& t, const v1::PinRequest& req, v1::PinResponse* resp);
  absl::Status Attend(const v1::Tenant& t, const v1::AttendRequest& req, v1::AttendResponse* resp);
  absl::Status Stats(const v1::Tenant& t, const v1::StatsRequest& req, v1::StatsResponse* resp);

  // Applies every tenant's pinned-bytes quota to the store (after the
  // directory changes).
  void ApplyQuotas();

 private:
  struct OpMetrics {
    CounterMetric* requests;
    CounterMetric* errors;
    HistogramMetric* latency;
  };
  OpMetrics Op(const std::string& name);
  absl::StatusOr<NamespaceId> Namespace(const v1::Tenant& t, const v1::RequestHeader& h) const;

  NodeCoreOptions options_;
  BlockStore* store_;
  SequenceTable* sequences_;
  TenantDirectory* tenants_;
  ThreadPool* pool_;
  MetricsRegistry* metrics_;
  OpMetrics lookup_, put_, get_, pin_, attend_, stats_;
  CounterMetric* put_bytes_;
  CounterMetric* quantized_;
  CounterMetric* get_bytes_;
  friend class OpScope;
};

}  // namespace kvring
