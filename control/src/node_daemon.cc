#include "kvring/control/node_daemon.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "kvring/cache/eviction_policy.h"
#include "kvring/cache/rocksdb_cold_tier.h"
#include "kvring/common/background_task.h"
#include "kvring/common/http_server.h"
#include "kvring/common/logging.h"
#include "kvring/common/metrics.h"
#include "kvring/common/process.h"
#include "kvring/common/status_macros.h"
#include "kvring/common/thread_pool.h"
#include "kvring/control/auth.h"
#include "kvring/control/coordinator_link.h"
#include "kvring/control/cpu_attention_backend.h"
#include "kvring/control/cuda_attention_backend.h"
#include "kvring/control/device_delivery.h"
#include "kvring/control/metadata_store.h"
#include "kvring/control/node_core.h"
#include "kvring/control/node_service.h"
#include "kvring/control/sequence_table.h"
#include "kvring/control/ucx_data_plane.h"
#include "kvring/protocol/tls.h"

namespace kvring {
namespace {

// The node's id: the one data_dir holds, else `wanted`, else a new one.
absl::StatusOr<std::string> NodeIdFor(MetadataStore& meta, const std::string& wanted) {
  auto stored = meta.Get("node/id");
  if (stored.ok()) {
    if (!wanted.empty() && wanted != *stored) {
      return absl::FailedPreconditionError(
          absl::StrCat("data directory belongs to node '", *stored, "', not '", wanted, "'"));
    }
    return *stored;
  }
  if (!absl::IsNotFound(stored.status())) return stored.status();
  std::string id = wanted;
  if (id.empty()) {
    absl::StatusOr<std::string> tok = GenerateToken();
    if (!tok.ok()) return tok.status();
    id = "node-" + tok->substr(0, 8);
  }
  KVRING_RETURN_IF_ERROR(meta.Put("node/id", id));
  return id;
}

// Says whether an engine on this GPU can share the daemon's context (CUDA
// MPS: the driver joined it at the first CUDA call if its control pipe was
// there).
void LogMps(int gpu) {
  const char* mps_dir = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string mps_pipe =
      absl::StrCat(mps_dir != nullptr && *mps_dir != '\0' ? mps_dir : "/tmp/nvidia-mps", "/control");
  std::error_code ec;
  if (std::filesystem::exists(mps_pipe, ec)) {
    KVRING_LOG(INFO) << "GPU " << gpu << " shared through CUDA MPS (" << mps_pipe
                     << "): engines started under the same MPS attend without a GPU context switch";
  } else {
    KVRING_LOG(WARNING) << "GPU " << gpu << ": no CUDA MPS (" << mps_pipe
                        << " missing): an engine on this GPU pays a GPU context switch (~150 us) on every pass-Q "
                           "step; deploy/local-cluster.sh --gpu and the kvring-mps unit start MPS (docs/MPS.md)";
  }
}

// `s` with what failed before its message (same code).
absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// *out = *r, or r's error with what failed.
template <typename T, typename U>
absl::Status Take(absl::StatusOr<T> r, U* out, absl::string_view what) {
  if (!r.ok()) return Annotate(r.status(), what);
  *out = std::move(*r);
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateNodeDaemonOptions(const NodeDaemonOptions& o) {
  auto bad = [](auto&&... what) { return absl::InvalidArgumentError(absl::StrCat(what...)); };
  if (o.data_dir.empty()) return bad("data_dir is required");
  if (o.cluster_token.empty()) return bad("cluster_token is required");
  if (absl::StatusOr<ColdCodec> c = ParseColdCodec(o.cold_codec); !c.ok())
    return bad("cold_codec: ", c.status().message());
  if (auto p = MakeEvictionPolicy(o.eviction_policy, 1); !p.ok()) {
    return bad("eviction_policy: ", p.status().message());
  }
  if (o.page_bytes == 0 || o.page_bytes % 64 != 0 || o.host_bytes < o.page_bytes) {
    return bad("page_bytes must be a positive multiple of 64 and at most host_bytes");
  }
  if (o.gpu < -1) return bad("gpu must be a device ordinal, or -1 for none");
  if (o.gpu >= 0 && o.hbm_bytes < o.page_bytes) return bad("gpu needs hbm_bytes of at least one page (page_bytes)");
  if (o.gpu_lanes < 1 || o.gpu_lanes > 64) return bad("gpu_lanes must be in [1, 64]");
  if (o.threads < 0) return bad("threads must be 0 (all cores) or more");
  if (o.ucx_inline_attend_rows < -1 || o.ucx_inline_attend_rows > 4096) {
    return bad("ucx_inline_attend_rows must be in [-1, 4096]");
  }
  KVRING_RETURN_IF_ERROR(ValidateUcxLoopOptions(o.ucx_loop));
  if (auto hp = ParseHostPort(o.listen); !hp.ok()) return bad("listen: ", hp.status().message());
  if (auto hp = ParseHostPort(o.coordinator.substr(0, o.coordinator.find(','))); !hp.ok()) {
    return bad("coordinator: ", hp.status().message());
  }
  if (!o.metrics_listen.empty()) {
    if (auto hp = ParseHostPort(o.metrics_listen); !hp.ok()) return bad("metrics_listen: ", hp.status().message());
  }
  return absl::OkStatus();
}

// Everything the daemon holds, in the order Open builds it (and the reverse
// of the order it goes).
struct NodeDaemon::Parts {
  NodeDaemonOptions o;
  std::string node_id, advertise, ucx_address;
  int grpc_port = 0, metrics_port = 0;
  std::atomic<bool> gpu_failed{false};
  std::unique_ptr<MetadataStore> meta;
  std::unique_ptr<BlockStore> store;
  std::unique_ptr<SequenceTable> sequences;
  std::unique_ptr<ThreadPool> pool;
  MetricsRegistry metrics;
  TenantDirectory tenants;
  std::unique_ptr<CpuAttentionBackend> cpu_backend;
  std::unique_ptr<AttentionBackend> gpu_backend;
  AttentionBackend* backend = nullptr;
  std::unique_ptr<DeviceDelivery> delivery;
  std::unique_ptr<NodeCore> core;
  std::unique_ptr<NodeService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<UcxDataPlane> ucx;
  std::unique_ptr<HttpServer> http;
  std::unique_ptr<BackgroundTask> reclaimer, expirer;
  std::unique_ptr<CoordinatorLink> link;
  bool shut_down = false;

  absl::Status OpenStore();
  absl::Status OpenBackend();
  absl::Status StartServers();
  absl::Status StartMetrics();
  absl::Status StartLink();
};

absl::Status NodeDaemon::Parts::OpenStore() {
  std::error_code ec;
  std::filesystem::create_directories(o.data_dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("creating data_dir ", o.data_dir, ": ", ec.message()));
  KVRING_RETURN_IF_ERROR(Take(MetadataStore::Open(o.data_dir + "/meta"), &meta, "metadata store"));
  KVRING_RETURN_IF_ERROR(Take(NodeIdFor(*meta, o.node_id), &node_id, "node id"));
  ColdCodec codec = ColdCodec::kZstd;
  KVRING_RETURN_IF_ERROR(Take(ParseColdCodec(o.cold_codec), &codec, "cold_codec"));
  std::unique_ptr<RocksDbColdTier> cold;
  KVRING_RETURN_IF_ERROR(
      Take(RocksDbColdTier::Open({.path = o.data_dir + "/cold", .codec = codec, .sync_writes = o.cold_sync}), &cold,
           "cold tier"));
  BlockStoreOptions so;
  so.page_bytes = o.page_bytes;
  so.num_pages = std::max<uint64_t>(1, o.host_bytes / o.page_bytes);
  so.eviction_policy = o.eviction_policy;
  so.lock_memory = o.lock_memory;
  so.cold_write_through = o.cold_write_through;
  if (o.gpu >= 0) {
    // Promotions into HBM copy from the host pages: pin them for DMA.
    so.register_memory = CudaRegisterHostMemory;
    so.unregister_memory = CudaUnregisterHostMemory;
  }
  KVRING_LOG(INFO) << "node " << node_id << ": host tier " << so.num_pages << " pages x " << o.page_bytes
                   << " bytes, cold tier " << o.data_dir << "/cold (" << o.cold_codec << "), recovering...";
  KVRING_RETURN_IF_ERROR(Take(BlockStore::Create(so, std::move(cold)), &store, "block store"));
  KVRING_LOG(INFO) << "recovered " << store->stats().cold_only_blocks << " blocks from the cold tier";
  KVRING_RETURN_IF_ERROR(Take(SequenceTable::Create(meta.get()), &sequences, "sequence table"));
  return absl::OkStatus();
}

absl::Status NodeDaemon::Parts::OpenBackend() {
  pool = std::make_unique<ThreadPool>(o.threads > 0 ? static_cast<size_t>(o.threads) - 1 : 0);
  cpu_backend = std::make_unique<CpuAttentionBackend>(store.get(), pool.get());
  backend = cpu_backend.get();
  if (o.gpu < 0) return absl::OkStatus();
  CudaBackendOptions go;
  go.device = o.gpu;
  go.hbm_bytes = o.hbm_bytes;
  go.page_bytes = o.page_bytes;
  go.lanes = o.gpu_lanes;
  // A poisoned CUDA context cannot recover in this process: the node reports
  // itself unhealthy and the owner is told (kvringd shuts down, so that a
  // supervisor restarts it; the host and cold tiers keep their blocks and
  // replicas serve meanwhile).
  go.on_fatal = [this](const absl::Status& why) {
    if (gpu_failed.exchange(true)) return;
    KVRING_LOG(ERROR) << "GPU failed: " << why;
    if (o.on_gpu_failure) o.on_gpu_failure();
  };
  KVRING_RETURN_IF_ERROR(Take(MakeCudaAttentionBackend(go, store.get(), pool.get()), &gpu_backend, "gpu"));
  LogMps(o.gpu);
  backend = gpu_backend.get();
  // Get into the GPU memory of engines on this host (CUDA IPC).
  if (o.device_delivery) {
    absl::StatusOr<std::unique_ptr<DeviceDelivery>> d =
        DeviceDelivery::Create({.device = o.gpu, .on_fatal = go.on_fatal});
    if (d.ok()) {
      delivery = std::move(*d);
    } else {
      KVRING_LOG(WARNING) << "no delivery into callers' GPU memory: " << d.status();
    }
  }
  return absl::OkStatus();
}

absl::Status NodeDaemon::Parts::StartServers() {
  NodeCoreOptions co;
  co.node_id = node_id;
  co.limits.max_payload_bytes = o.page_bytes;
  co.limits.max_request_bytes = o.max_message_bytes;
  co.limits.finite_appends = o.check_append_values;
  co.delivery_checksum = o.delivery_checksum;
  core = std::make_unique<NodeCore>(co, store.get(), sequences.get(), backend, &tenants, &metrics, delivery.get());
  service = std::make_unique<NodeService>(core.get());
  std::shared_ptr<grpc::ServerCredentials> creds;
  KVRING_RETURN_IF_ERROR(Take(MakeServerCredentials(o.tls), &creds, "TLS"));
  if (o.tls.enabled() && !o.ucx_listen.empty()) {
    KVRING_LOG(WARNING) << "TLS is on for gRPC; the UCX data plane is not encrypted, and TLS clients do not use it";
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(o.listen, creds, &grpc_port);
  // A port another process listens on is an error, not a port shared with
  // it (gRPC sets SO_REUSEPORT otherwise, and the kernel would split the
  // connections between the two).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  const int max_message = static_cast<int>(std::min<uint64_t>(o.max_message_bytes, INT32_MAX));
  builder.SetMaxReceiveMessageSize(max_message);
  builder.SetMaxSendMessageSize(max_message);
  builder.RegisterService(service.get());
  server = builder.BuildAndStart();
  if (!server || grpc_port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", o.listen, " (in use by another process, or not an address of this host)"));
  }
  advertise = o.advertise;
  if (advertise.empty()) {
    auto hp = ParseHostPort(o.listen);
    advertise = absl::StrCat(hp.ok() && hp->host != "0.0.0.0" ? hp->host : "127.0.0.1", ":", grpc_port);
  }
  if (o.ucx_listen.empty()) return absl::OkStatus();
  UcxDataPlaneOptions uo;
  uo.listen = o.ucx_listen;
  uo.max_message_bytes = o.max_message_bytes;
  uo.threads = 4;
  uo.loop = o.ucx_loop;
  uo.inline_attend_rows = static_cast<uint32_t>(o.ucx_inline_attend_rows >= 0 ? o.ucx_inline_attend_rows
                                                : o.gpu >= 0                  ? 64
                                                                              : 0);
  KVRING_RETURN_IF_ERROR(Take(UcxDataPlane::Start(core.get(), uo), &ucx, "UCX data plane"));
  ucx_address = ucx->address();
  return absl::OkStatus();
}

absl::Status NodeDaemon::Parts::StartMetrics() {
  if (o.metrics_listen.empty()) return absl::OkStatus();
  HostPort hp;
  KVRING_RETURN_IF_ERROR(Take(ParseHostPort(o.metrics_listen), &hp, "metrics_listen"));
  GaugeMetric* g_blocks = metrics.Gauge("kvring_blocks", "Blocks held in any tier");
  GaugeMetric* g_free = metrics.Gauge("kvring_free_pages", "Free host pages");
  GaugeMetric* g_cold = metrics.Gauge("kvring_cold_blocks", "Blocks only in the cold tier");
  CounterMetric* c_evict = metrics.Counter("kvring_evictions_total", "Host-tier evictions");
  GaugeMetric* g_cold_bytes = metrics.Gauge("kvring_cold_stored_bytes", "Bytes in the cold tier after compression");
  GaugeMetric* g_hbm_pages = metrics.Gauge("kvring_hbm_pages", "HBM pages of the attention backend (0 on a CPU node)");
  GaugeMetric* g_hbm_free = metrics.Gauge("kvring_hbm_free_pages", "Free HBM pages");
  GaugeMetric* g_hbm_bytes = metrics.Gauge("kvring_hbm_used_bytes", "HBM bytes holding sequence blocks");
  GaugeMetric* g_hbm_blocks = metrics.Gauge("kvring_hbm_blocks", "Full sequence blocks resident in HBM");
  CounterMetric* c_hbm_hits = metrics.Counter("kvring_hbm_hits_total", "Blocks attention found in HBM");
  CounterMetric* c_hbm_misses = metrics.Counter("kvring_hbm_misses_total", "Blocks promoted into HBM to be attended");
  CounterMetric* c_hbm_demotions =
      metrics.Counter("kvring_hbm_demotions_total", "Blocks dropped from HBM to make room");
  GaugeMetric* g_open = metrics.Gauge("kvring_open_blocks", "Sequence blocks being filled by appends");
  http = std::make_unique<HttpServer>();
  http->Handle(
      "/metrics",
      [=, this] {
        const BlockStoreStats s = store->stats();
        g_blocks->Set(static_cast<double>(s.blocks));
        g_free->Set(static_cast<double>(s.free_pages));
        g_cold->Set(static_cast<double>(s.cold_only_blocks));
        c_evict->SetTotal(s.evictions);
        if (store->cold_tier()) g_cold_bytes->Set(static_cast<double>(store->cold_tier()->stats().stored_bytes));
        const BackendStats b = backend->stats();
        g_hbm_pages->Set(static_cast<double>(b.pages));
        g_hbm_free->Set(static_cast<double>(b.free_pages));
        g_hbm_bytes->Set(static_cast<double>((b.pages - b.free_pages) * b.page_bytes));
        g_hbm_blocks->Set(static_cast<double>(b.resident_blocks));
        c_hbm_hits->SetTotal(b.hits);
        c_hbm_misses->SetTotal(b.misses);
        c_hbm_demotions->SetTotal(b.demotions);
        g_open->Set(static_cast<double>(b.open_blocks));
        return metrics.Render();
      },
      MetricsRegistry::kContentType);
  http->HandleWithStatus("/healthz", [this] {
    return backend->stats().healthy && !gpu_failed ? HttpServer::Response{"200 OK", "ok\n"}
                                                   : HttpServer::Response{"503 Service Unavailable", "gpu failed\n"};
  });
  KVRING_RETURN_IF_ERROR(Take(http->Start(hp.host, hp.port), &metrics_port, "metrics server"));
  return absl::OkStatus();
}

absl::Status NodeDaemon::Parts::StartLink() {
  // Deleted tenants' blocks and sequences are reclaimed off the request path,
  // whenever the tenant table changes (and once after start: the cold tier
  // may have recovered blocks of tenants deleted while this node was down).
  reclaimer = std::make_unique<BackgroundTask>([this] {
    absl::StatusOr<ReclaimResult> r = core->ReclaimDeletedTenants();
    if (!r.ok()) {
      KVRING_LOG(WARNING) << "reclaiming deleted tenants' blocks failed (retried at the next table change): "
                          << r.status().message();
    } else if (r->tenants > 0) {
      KVRING_LOG(INFO) << "reclaimed " << r->blocks << " blocks and " << r->sequences << " sequences of " << r->tenants
                       << " deleted tenant(s)";
    }
  });
  // Idle attention sequences of tenants with a sequence TTL, swept at every
  // heartbeat.
  expirer = std::make_unique<BackgroundTask>([this] {
    absl::StatusOr<uint64_t> n = core->ExpireIdleSequences();
    if (!n.ok()) {
      KVRING_LOG(WARNING) << "expiring idle sequences failed (retried at the next heartbeat): " << n.status().message();
    } else if (*n > 0) {
      KVRING_LOG(INFO) << "expired " << *n << " idle sequence(s)";
    }
  });
  // Towards the coordinator: verify it with the CA; present this node's
  // certificate when the cluster runs mutual TLS.
  const bool mtls = o.tls.require_client_cert;
  std::shared_ptr<grpc::ChannelCredentials> link_creds;
  KVRING_RETURN_IF_ERROR(Take(
      MakeChannelCredentials(TlsConfig{mtls ? o.tls.cert_file : "", mtls ? o.tls.key_file : "", o.tls.ca_file, false}),
      &link_creds, "TLS"));
  CoordinatorLinkOptions lo;
  lo.coordinator = o.coordinator;
  lo.credentials = link_creds;
  lo.cluster_token = o.cluster_token;
  lo.node.set_node_id(node_id);
  lo.node.set_grpc_address(advertise);
  lo.node.set_ucx_address(ucx_address);
  lo.node.set_capacity_bytes(std::max<uint64_t>(1, o.host_bytes / o.page_bytes) * o.page_bytes);
  lo.on_tenants_changed = [this] {
    core->ApplyQuotas();
    reclaimer->Kick();
  };
  lo.fill_load = [this](v1::HeartbeatRequest* r) {
    expirer->Kick();
    const BlockStoreStats s = store->stats();
    r->set_blocks(s.blocks);
    r->set_free_pages(s.free_pages);
  };
  link = std::make_unique<CoordinatorLink>(lo, &tenants);
  if (absl::Status s = link->Start(); !s.ok()) return Annotate(s, "coordinator");
  // A token this node has not seen yet (a tenant created since the last
  // heartbeat) is looked up at the coordinator before it is refused.
  tenants.SetMissHandler(
      [this] {
        if (absl::Status s = link->RefreshTenants(); !s.ok())
          KVRING_LOG(WARNING) << "tenant refresh failed: " << s.message();
      },
      absl::Milliseconds(100));
  return absl::OkStatus();
}

NodeDaemon::NodeDaemon() : p_(std::make_unique<Parts>()) {}

absl::StatusOr<std::unique_ptr<NodeDaemon>> NodeDaemon::Open(NodeDaemonOptions options) {
  KVRING_RETURN_IF_ERROR(ValidateNodeDaemonOptions(options));
  std::unique_ptr<NodeDaemon> d(new NodeDaemon());
  Parts& p = *d->p_;
  p.o = std::move(options);
  KVRING_RETURN_IF_ERROR(p.OpenStore());
  KVRING_RETURN_IF_ERROR(p.OpenBackend());
  KVRING_RETURN_IF_ERROR(p.StartServers());
  KVRING_RETURN_IF_ERROR(p.StartMetrics());
  KVRING_RETURN_IF_ERROR(p.StartLink());
  KVRING_LOG(INFO) << "kvringd ready: node=" << p.node_id << " grpc=" << p.advertise
                   << (p.ucx_address.empty() ? "" : " ucx=" + p.ucx_address)
                   << (p.metrics_port ? absl::StrCat(" metrics=", p.metrics_port) : "");
  return d;
}

void NodeDaemon::Shutdown() {
  if (p_->shut_down) return;
  p_->shut_down = true;
  // No request is served from here on: the miss handler and the link go
  // only after the servers stopped.
  if (p_->server) p_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  p_->ucx.reset();
}

NodeDaemon::~NodeDaemon() {
  Shutdown();
  Parts& p = *p_;
  p.link.reset();
  p.expirer.reset();
  p.reclaimer.reset();
  p.http.reset();
  p.server.reset();
  p.service.reset();
  p.core.reset();
  // (the rest goes with p_, in the reverse order of its members)
}

const std::string& NodeDaemon::node_id() const { return p_->node_id; }
int NodeDaemon::grpc_port() const { return p_->grpc_port; }
const std::string& NodeDaemon::advertise() const { return p_->advertise; }
const std::string& NodeDaemon::ucx_address() const { return p_->ucx_address; }
int NodeDaemon::metrics_port() const { return p_->metrics_port; }
bool NodeDaemon::gpu_failed() const { return p_->gpu_failed.load(); }

}  // namespace kvring
