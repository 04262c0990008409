// kvringd: the kvring node daemon. Holds a block store (host DRAM + RocksDB
// cold tier on local SSD; with --gpu an HBM tier in front for the attention
// sequences, attended on the GPU), serves the Node gRPC service (and the UCX
// data plane when enabled), registers and heartbeats with the coordinator,
// and exports Prometheus metrics.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "kvring/cache/eviction_policy.h"
#include "kvring/cache/rocksdb_cold_tier.h"
#include "kvring/common/background_task.h"
#include "kvring/common/flags.h"
#include "kvring/common/http_server.h"
#include "kvring/common/logging.h"
#include "kvring/common/process.h"
#include "kvring/control/coordinator_link.h"
#include "kvring/control/cpu_attention_backend.h"
#include "kvring/control/cuda_attention_backend.h"
#include "kvring/control/metadata_store.h"
#include "kvring/control/node_core.h"
#include "kvring/control/node_service.h"
#include "kvring/control/sequence_table.h"
#include "kvring/control/ucx_data_plane.h"
#include "kvring/protocol/tls.h"

using namespace kvring;

namespace {

int Fail(const absl::Status& s, const char* what) {
  KVRING_LOG(ERROR) << what << ": " << s;
  return 1;
}

absl::StatusOr<std::string> NodeIdFor(MetadataStore& meta, const std::string& flag) {
  auto stored = meta.Get("node/id");
  if (stored.ok()) {
    if (!flag.empty() && flag != *stored) {
      return absl::FailedPreconditionError(
          absl::StrCat("data directory belongs to node '", *stored, "', not '", flag, "'"));
    }
    return *stored;
  }
  if (!absl::IsNotFound(stored.status())) return stored.status();
  std::string id = flag;
  if (id.empty()) {
    auto tok = GenerateToken();
    if (!tok.ok()) return tok.status();
    id = "node-" + tok->substr(0, 8);
  }
  if (absl::Status s = meta.Put("node/id", id); !s.ok()) return s;
  return id;
}

}  // namespace

int main(int argc, char** argv) {
  BlockTerminationSignals();
  std::string listen = "0.0.0.0:7100", advertise, coordinator = "127.0.0.1:7000", cluster_token, cluster_token_file;
  std::string data_dir, node_id, eviction = "lru", cold_codec = "zstd", metrics_listen = "127.0.0.1:0", port_file;
  std::string log_level = "info", ucx_listen;
  int64_t gpu = -1, gpu_lanes = 4, ucx_spin_us = -1, ucx_spin_max_us = -1;
  bool ucx_busy_poll = false;
  int64_t ucx_inline_attend_rows = -1;
  uint64_t hbm_bytes = 0;
  uint64_t host_bytes = 1ull << 30, page_bytes = 2ull << 20, max_message = 256ull << 20;
  int64_t threads = 0;
  bool write_through = false, cold_sync = false, lock_memory = false, check_config = false;
  bool delivery_checksum = false, device_delivery = true, check_append_values = true;
  FlagSet flags("kvringd", "the kvring node daemon: a shard of the KV-block store with attention where the KV lives");
  flags.AddString("listen", &listen, "gRPC listen address host:port (port 0: any free port)");
  flags.AddString("advertise", &advertise,
                  "address other processes use to reach this node (default: listen, with 127.0.0.1 for 0.0.0.0)");
  flags.AddString("coordinator", &coordinator,
                  "coordinator address host:port, or every coordinator: host:port,host:port,...");
  flags.AddString("cluster_token", &cluster_token,
                  "token nodes present to the coordinator (prefer --cluster_token_file)");
  flags.AddString("cluster_token_file", &cluster_token_file, "file holding the cluster token");
  flags.AddString("data_dir", &data_dir, "directory for the cold tier and node metadata (required)");
  flags.AddString("node_id", &node_id, "node id (default: generated once and kept in data_dir)");
  flags.AddBytes("host_bytes", &host_bytes, "host-DRAM tier capacity (e.g. 8G)");
  flags.AddBytes("page_bytes", &page_bytes, "page size = largest block accepted (e.g. 2M)");
  flags.AddString("eviction_policy", &eviction, "host-tier eviction policy");
  flags.AddString("cold_codec", &cold_codec, "cold-tier compression: zstd, lz4 or none");
  flags.AddBool("cold_write_through", &write_through, "write every Put to the cold tier before acknowledging it");
  flags.AddBool("cold_sync", &cold_sync, "fsync cold-tier writes (survive power loss, not just crashes)");
  flags.AddBool("lock_memory", &lock_memory, "mlock the host tier");
  flags.AddBool("device_delivery", &device_delivery,
                "with --gpu: copy Get's blocks straight into the GPU memory of callers on this host that ask for it "
                "(CUDA IPC). Any process on the host that learns a caller's memory handle could name it: turn this "
                "off on hosts whose engines do not trust each other");
  flags.AddBool("check_append_values", &check_append_values,
                "refuse appended K/V holding NaN or Inf (one pass over a step's appended bytes; off: such a token "
                "poisons every later step of its sequence)");
  flags.AddBool("delivery_checksum", &delivery_checksum,
                "with --gpu: check each block's checksum again before copying it into a same-host caller's GPU "
                "memory (blocks are checked when they enter the host tier; the re-check costs host memory bandwidth)");
  flags.AddInt("threads", &threads, "attention compute threads (0: all cores)");
  flags.AddInt("gpu", &gpu, "CUDA device for the HBM tier and GPU attention (-1: none, attention on the CPU)");
  flags.AddBytes("hbm_bytes", &hbm_bytes, "with --gpu: HBM for attention sequences (e.g. 40G; required with --gpu)");
  flags.AddInt("gpu_lanes", &gpu_lanes, "with --gpu: requests on the GPU at once, each with its own stream (1-64)");
  flags.AddBytes("max_message_bytes", &max_message, "largest gRPC message accepted or sent");
  flags.AddString("metrics_listen", &metrics_listen, "Prometheus /metrics address host:port (empty: off)");
  flags.AddString("ucx_listen", &ucx_listen,
                  "UCX data-plane listen address host:port (empty: off; clients use gRPC payloads)");
  flags.AddInt(
      "ucx_spin_us", &ucx_spin_us,
      "UCX progress thread: busy-poll this long after each message before sleeping (-1: 20 with 8+ cores, else 0)");
  flags.AddInt("ucx_spin_max_us", &ucx_spin_max_us,
               "UCX adaptive spin: while messages keep arriving (each within this window of the last), the progress "
               "thread busy-polls up to this long after each one instead of --ucx_spin_us, so a decode loop's steps "
               "find it awake; idle, it sleeps (-1: 2000 with 8+ cores, else 0; 0: off)");
  flags.AddBool("ucx_busy_poll", &ucx_busy_poll,
                "UCX progress thread: poll without ever sleeping (lowest latency, one core busy)");
  flags.AddInt("ucx_inline_attend_rows", &ucx_inline_attend_rows,
               "serve Attend steps of at most this many query rows (decode) on the UCX thread itself: two thread "
               "hand-offs fewer a step, while that thread serves nothing else (0: off; -1: 64 on a GPU node, where a "
               "step takes tens of microseconds, 0 on a CPU node, where it takes milliseconds)");
  flags.AddString("port_file", &port_file, "write the bound gRPC port here once serving (for scripts and tests)");
  flags.AddString("log_level", &log_level, "debug, info, warning or error");
  TlsConfig tls;
  AddTlsFlags(&flags, &tls, /*server=*/true);
  flags.AddBool("check_config", &check_config, "parse and check the flags and config file, then exit");
  if (absl::Status s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "kvringd: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::printf("%s", flags.Usage().c_str());
    return 0;
  }
  if (!ucx_listen.empty()) {
    // The UCX data plane listens on --ucx_listen's port (its TCP transport),
    // not on one the system picks. UCX 1.13 takes this setting only from its
    // environment (ucp_config_modify does not reach the TCP transport), so it
    // is set here, from the flag, before any thread or UCX context exists.
    const size_t colon = ucx_listen.rfind(':');
    int port = -1;
    if (colon == std::string::npos || !absl::SimpleAtoi(ucx_listen.substr(colon + 1), &port) || port < 0 ||
        port > 65535) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("'", ucx_listen, "' is not host:port")), "--ucx_listen");
    }
    if (port != 0) ::setenv("UCX_TCP_PORT_RANGE", absl::StrCat(port, "-", port).c_str(), /*overwrite=*/1);
  }
  LogLevel lvl;
  if (!ParseLogLevel(log_level, &lvl)) return Fail(absl::InvalidArgumentError(log_level), "--log_level");
  SetLogLevel(lvl);
  if (data_dir.empty()) return Fail(absl::InvalidArgumentError("--data_dir is required"), "flags");
  if (!cluster_token_file.empty() && !check_config) {
    auto t = ReadSecretFile(cluster_token_file);
    if (!t.ok()) return Fail(t.status(), "--cluster_token_file");
    cluster_token = *t;
  }
  if (cluster_token.empty() && cluster_token_file.empty()) {
    return Fail(absl::InvalidArgumentError("--cluster_token or --cluster_token_file is required"), "flags");
  }
  auto codec = ParseColdCodec(cold_codec);
  if (!codec.ok()) return Fail(codec.status(), "--cold_codec");
  if (!MakeEvictionPolicy(eviction, 1).ok()) return Fail(MakeEvictionPolicy(eviction, 1).status(), "--eviction_policy");
  if (page_bytes == 0 || page_bytes % 64 != 0 || host_bytes < page_bytes) {
    return Fail(absl::InvalidArgumentError("page_bytes must be a positive multiple of 64 and at most host_bytes"),
                "flags");
  }
  if (gpu >= 0 && hbm_bytes < page_bytes) {
    return Fail(absl::InvalidArgumentError("--gpu needs --hbm_bytes of at least one page (--page_bytes)"), "flags");
  }
  if (gpu < -1) return Fail(absl::InvalidArgumentError("--gpu must be a device ordinal, or -1 for none"), "flags");
  if (gpu_lanes < 1 || gpu_lanes > 64)
    return Fail(absl::InvalidArgumentError("--gpu_lanes must be in [1, 64]"), "flags");
  if (!ParseHostPort(listen).ok()) return Fail(ParseHostPort(listen).status(), "--listen");
  if (!ParseHostPort(coordinator).ok()) return Fail(ParseHostPort(coordinator).status(), "--coordinator");
  if (check_config) {
    std::printf("kvringd: config OK\n");
    return 0;
  }
  std::error_code ec;
  std::filesystem::create_directories(data_dir, ec);
  if (ec) return Fail(absl::UnavailableError(ec.message()), "creating --data_dir");

  auto meta = MetadataStore::Open(data_dir + "/meta");
  if (!meta.ok()) return Fail(meta.status(), "metadata store");
  auto id = NodeIdFor(**meta, node_id);
  if (!id.ok()) return Fail(id.status(), "node id");
  auto cold = RocksDbColdTier::Open({.path = data_dir + "/cold", .codec = *codec, .sync_writes = cold_sync});
  if (!cold.ok()) return Fail(cold.status(), "cold tier");
  BlockStoreOptions so;
  so.page_bytes = page_bytes;
  so.num_pages = std::max<uint64_t>(1, host_bytes / page_bytes);
  so.eviction_policy = eviction;
  so.lock_memory = lock_memory;
  so.cold_write_through = write_through;
  if (gpu >= 0) {
    // Promotions into HBM copy from the host pages: pin them for DMA.
    so.register_memory = CudaRegisterHostMemory;
    so.unregister_memory = CudaUnregisterHostMemory;
  }
  KVRING_LOG(INFO) << "node " << *id << ": host tier " << so.num_pages << " pages x " << page_bytes
                   << " bytes, cold tier " << data_dir << "/cold (" << cold_codec << "), recovering...";
  auto store = BlockStore::Create(so, std::move(*cold));
  if (!store.ok()) return Fail(store.status(), "block store");
  const BlockStoreStats st0 = (*store)->stats();
  KVRING_LOG(INFO) << "recovered " << st0.cold_only_blocks << " blocks from the cold tier";
  auto seqs = SequenceTable::Create(meta->get());
  if (!seqs.ok()) return Fail(seqs.status(), "sequence table");

  ThreadPool pool(threads > 0 ? static_cast<size_t>(threads) - 1 : 0);
  MetricsRegistry metrics;
  TenantDirectory tenants;
  NodeCoreOptions co;
  co.node_id = *id;
  co.limits.max_payload_bytes = page_bytes;
  co.limits.max_request_bytes = max_message;
  co.limits.finite_appends = check_append_values;
  co.delivery_checksum = delivery_checksum;
  CpuAttentionBackend cpu_backend(store->get(), &pool);
  AttentionBackend* backend = &cpu_backend;
  std::unique_ptr<AttentionBackend> gpu_backend;
  std::unique_ptr<DeviceDelivery> delivery;
  std::atomic<bool> gpu_failed{false};
  if (gpu >= 0) {
    CudaBackendOptions go;
    go.device = static_cast<int>(gpu);
    go.hbm_bytes = hbm_bytes;
    go.page_bytes = page_bytes;
    go.lanes = static_cast<int>(gpu_lanes);
    // A poisoned CUDA context cannot recover in this process: report
    // unhealthy and shut down, so that a supervisor restarts the daemon (the
    // host and cold tiers keep their blocks; replicas serve meanwhile).
    go.on_fatal = [&gpu_failed](const absl::Status& why) {
      if (gpu_failed.exchange(true)) return;
      KVRING_LOG(ERROR) << "GPU failed (" << why << "): shutting down for a restart";
      kill(getpid(), SIGTERM);
    };
    auto b = MakeCudaAttentionBackend(go, store->get(), &pool);
    if (!b.ok()) return Fail(b.status(), "--gpu");
    // Whether an engine on this GPU can share the daemon's context (CUDA MPS:
    // the driver joined it at the first CUDA call if its control pipe was there).
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
    gpu_backend = std::move(*b);
    backend = gpu_backend.get();
    // Get into the GPU memory of engines on this host (CUDA IPC).
    if (device_delivery) {
      auto d = DeviceDelivery::Create({.device = static_cast<int>(gpu), .on_fatal = go.on_fatal});
      if (d.ok()) {
        delivery = std::move(*d);
      } else {
        KVRING_LOG(WARNING) << "no delivery into callers' GPU memory: " << d.status();
      }
    }
  }
  NodeCore core(co, store->get(), seqs->get(), backend, &tenants, &metrics, delivery.get());
  NodeService service(&core);

  grpc::ServerBuilder builder;
  int port = 0;
  auto server_creds = MakeServerCredentials(tls);
  if (!server_creds.ok()) return Fail(server_creds.status(), "TLS");
  // Towards the coordinator: verify it with --tls_ca; present this node's
  // certificate when the cluster runs mutual TLS.
  const bool mtls = tls.require_client_cert;
  auto link_creds =
      MakeChannelCredentials(TlsConfig{mtls ? tls.cert_file : "", mtls ? tls.key_file : "", tls.ca_file, false});
  if (!link_creds.ok()) return Fail(link_creds.status(), "TLS");
  if (tls.enabled() && !ucx_listen.empty()) {
    KVRING_LOG(WARNING)
        << "TLS is on for gRPC; the UCX data plane (--ucx_listen) is not encrypted, and TLS clients do not use it";
  }
  builder.AddListeningPort(listen, *server_creds, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<uint64_t>(max_message, INT32_MAX)));
  builder.SetMaxSendMessageSize(static_cast<int>(std::min<uint64_t>(max_message, INT32_MAX)));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0)
    return Fail(absl::UnavailableError(absl::StrCat("cannot listen on ", listen)), "gRPC server");
  auto lhp = ParseHostPort(listen);
  if (advertise.empty())
    advertise = absl::StrCat(lhp.ok() && lhp->host != "0.0.0.0" ? lhp->host : "127.0.0.1", ":", port);

  // The UCX data plane (optional).
  std::unique_ptr<UcxDataPlane> ucx;
  std::string ucx_address;
  if (!ucx_listen.empty()) {
    if (ucx_inline_attend_rows < -1 || ucx_inline_attend_rows > 4096) {
      return Fail(absl::InvalidArgumentError("--ucx_inline_attend_rows must be in [-1, 4096]"), "flags");
    }
    if (ucx_inline_attend_rows < 0) ucx_inline_attend_rows = gpu >= 0 ? 64 : 0;
    UcxDataPlaneOptions uo;
    uo.listen = ucx_listen;
    uo.max_message_bytes = max_message;
    uo.threads = 4;
    // (Flags beyond int's range are clamped to it, so that they are refused below, not truncated into range.)
    constexpr int64_t kIntMin = std::numeric_limits<int>::min(), kIntMax = std::numeric_limits<int>::max();
    uo.loop.spin_us = static_cast<int>(std::clamp(ucx_spin_us, kIntMin, kIntMax));
    uo.loop.spin_max_us = static_cast<int>(std::clamp(ucx_spin_max_us, kIntMin, kIntMax));
    uo.loop.wakeup = !ucx_busy_poll;
    if (absl::Status s = ValidateUcxLoopOptions(uo.loop); !s.ok()) return Fail(s, "flags");
    uo.inline_attend_rows = static_cast<uint32_t>(ucx_inline_attend_rows);
    auto u = UcxDataPlane::Start(&core, uo);
    if (!u.ok()) return Fail(u.status(), "UCX data plane");
    ucx = std::move(*u);
    ucx_address = ucx->address();
  }

  // Metrics.
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
  HttpServer http;
  int metrics_port = 0;
  if (!metrics_listen.empty()) {
    auto mhp = ParseHostPort(metrics_listen);
    if (!mhp.ok()) return Fail(mhp.status(), "--metrics_listen");
    http.Handle(
        "/metrics",
        [&] {
          const BlockStoreStats s = (*store)->stats();
          g_blocks->Set(static_cast<double>(s.blocks));
          g_free->Set(static_cast<double>(s.free_pages));
          g_cold->Set(static_cast<double>(s.cold_only_blocks));
          c_evict->SetTotal(s.evictions);
          if ((*store)->cold_tier())
            g_cold_bytes->Set(static_cast<double>((*store)->cold_tier()->stats().stored_bytes));
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
    http.HandleWithStatus("/healthz", [backend, &gpu_failed] {
      return backend->stats().healthy && !gpu_failed ? HttpServer::Response{"200 OK", "ok\n"}
                                                     : HttpServer::Response{"503 Service Unavailable", "gpu failed\n"};
    });
    auto mp = http.Start(mhp->host, mhp->port);
    if (!mp.ok()) return Fail(mp.status(), "metrics server");
    metrics_port = *mp;
  }

  // Deleted tenants' blocks and sequences are reclaimed off the request path,
  // whenever the tenant table changes (and once after start: the cold tier
  // may have recovered blocks of tenants deleted while this node was down).
  BackgroundTask reclaimer([&core] {
    absl::StatusOr<ReclaimResult> r = core.ReclaimDeletedTenants();
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
  BackgroundTask expirer([&core] {
    absl::StatusOr<uint64_t> n = core.ExpireIdleSequences();
    if (!n.ok()) {
      KVRING_LOG(WARNING) << "expiring idle sequences failed (retried at the next heartbeat): " << n.status().message();
    } else if (*n > 0) {
      KVRING_LOG(INFO) << "expired " << *n << " idle sequence(s)";
    }
  });
  CoordinatorLinkOptions lo;
  lo.coordinator = coordinator;
  lo.credentials = *link_creds;
  lo.cluster_token = cluster_token;
  lo.node.set_node_id(*id);
  lo.node.set_grpc_address(advertise);
  lo.node.set_ucx_address(ucx_address);
  lo.node.set_capacity_bytes(so.num_pages * so.page_bytes);
  lo.on_tenants_changed = [&core, &reclaimer] {
    core.ApplyQuotas();
    reclaimer.Kick();
  };
  lo.fill_load = [&](v1::HeartbeatRequest* r) {
    expirer.Kick();
    const BlockStoreStats s = (*store)->stats();
    r->set_blocks(s.blocks);
    r->set_free_pages(s.free_pages);
  };
  CoordinatorLink link(lo, &tenants);
  if (absl::Status s = link.Start(); !s.ok()) return Fail(s, "coordinator");
  // A token this node has not seen yet (a tenant created since the last
  // heartbeat) is looked up at the coordinator before it is refused.
  // (The gRPC server and UCX plane stop before `link` goes away.)
  tenants.SetMissHandler(
      [&link] {
        if (absl::Status s = link.RefreshTenants(); !s.ok())
          KVRING_LOG(WARNING) << "tenant refresh failed: " << s.message();
      },
      absl::Milliseconds(100));

  if (!port_file.empty()) {
    std::ofstream(port_file + ".tmp") << port << "\n";
    std::filesystem::rename(port_file + ".tmp", port_file, ec);
  }
  KVRING_LOG(INFO) << "kvringd ready: node=" << *id << " grpc=" << advertise
                   << (ucx_address.empty() ? "" : " ucx=" + ucx_address)
                   << (metrics_port ? absl::StrCat(" metrics=", metrics_port) : "");
  const int sig = WaitForTerminationSignal();
  KVRING_LOG(INFO) << "signal " << sig << ": shutting down";
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ucx.reset();
  if (gpu_failed) {
    KVRING_LOG(ERROR) << "exiting with status 3: the GPU context failed";
    std::_Exit(3);  // the CUDA context cannot be torn down cleanly
  }
  return 0;
}
