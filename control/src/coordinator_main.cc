// kvring-coordinator: membership, the shard map and tenants for a kvring
// cluster, persisted in RocksDB.
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "kvring/common/flags.h"
#include "kvring/common/http_server.h"
#include "kvring/common/logging.h"
#include "kvring/common/metrics.h"
#include "kvring/common/process.h"
#include "kvring/control/coordinator_service.h"
#include "kvring/protocol/tls.h"

using namespace kvring;

int main(int argc, char** argv) {
  BlockTerminationSignals();
  std::string listen = "0.0.0.0:7000", data_dir, admin_token, admin_token_file, cluster_token, cluster_token_file;
  std::string port_file, log_level = "info", metrics_listen;
  uint64_t replication = 2, write_quorum = 0, vnodes = 64, chunk_blocks = 64;
  absl::Duration hb_interval = absl::Milliseconds(500), hb_timeout = absl::Seconds(3);
  bool check_config = false;
  FlagSet flags("kvring-coordinator", "membership, shard map and tenants of a kvring cluster");
  flags.AddString("listen", &listen, "gRPC listen address host:port");
  flags.AddString("data_dir", &data_dir, "directory of the metadata database (required)");
  flags.AddString("admin_token", &admin_token, "token for tenant administration (prefer --admin_token_file)");
  flags.AddString("admin_token_file", &admin_token_file, "file holding the admin token");
  flags.AddString("cluster_token", &cluster_token, "token nodes present (prefer --cluster_token_file)");
  flags.AddString("cluster_token_file", &cluster_token_file, "file holding the cluster token");
  flags.AddUint("replication", &replication, "replicas per block (R)");
  flags.AddUint("write_quorum", &write_quorum, "acknowledgements a write needs (0: R)");
  flags.AddUint("virtual_nodes", &vnodes, "hash-ring points per node");
  flags.AddUint("sequence_chunk_blocks", &chunk_blocks, "blocks per contiguous chunk of an attention sequence");
  flags.AddDuration("heartbeat_interval", &hb_interval, "how often nodes heartbeat");
  flags.AddDuration("heartbeat_timeout", &hb_timeout, "silence after which a node is marked DOWN");
  flags.AddString("metrics_listen", &metrics_listen, "Prometheus /metrics address host:port (empty: off)");
  flags.AddString("port_file", &port_file, "write the bound port here once serving");
  flags.AddString("log_level", &log_level, "debug, info, warning or error");
  TlsConfig tls;
  AddTlsFlags(&flags, &tls, /*server=*/true);
  flags.AddBool("check_config", &check_config, "parse and check the flags and config file, then exit");
  if (absl::Status s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "kvring-coordinator: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::printf("%s", flags.Usage().c_str());
    return 0;
  }
  LogLevel lvl;
  if (ParseLogLevel(log_level, &lvl)) SetLogLevel(lvl);
  auto secret = [&](std::string* v, const std::string& file, const char* name) -> bool {
    if (!file.empty() && check_config) return true;
    if (!file.empty()) {
      auto t = ReadSecretFile(file);
      if (!t.ok()) {
        KVRING_LOG(ERROR) << name << ": " << t.status();
        return false;
      }
      *v = *t;
    }
    if (v->empty()) {
      KVRING_LOG(ERROR) << "--" << name << " or --" << name << "_file is required";
      return false;
    }
    return true;
  };
  if (!secret(&admin_token, admin_token_file, "admin_token") ||
      !secret(&cluster_token, cluster_token_file, "cluster_token"))
    return 2;
  if (data_dir.empty()) {
    KVRING_LOG(ERROR) << "--data_dir is required";
    return 2;
  }
  if (replication == 0 || replication > 16 || write_quorum > replication || hb_timeout <= hb_interval ||
      !ParseHostPort(listen).ok()) {
    KVRING_LOG(ERROR) << "bad flags: replication in [1,16], write_quorum <= replication, heartbeat_timeout > "
                         "heartbeat_interval, listen host:port";
    return 2;
  }
  if (check_config) {
    std::printf("kvring-coordinator: config OK\n");
    return 0;
  }
  std::error_code ec;
  std::filesystem::create_directories(data_dir, ec);
  auto store = MetadataStore::Open(data_dir + "/meta");
  if (!store.ok()) {
    KVRING_LOG(ERROR) << store.status();
    return 1;
  }
  CoordinatorOptions o;
  o.replication = static_cast<uint32_t>(replication);
  o.write_quorum = static_cast<uint32_t>(write_quorum);
  o.virtual_nodes = static_cast<uint32_t>(vnodes);
  o.sequence_chunk_blocks = static_cast<uint32_t>(chunk_blocks);
  o.heartbeat_interval = hb_interval;
  o.heartbeat_timeout = hb_timeout;
  o.admin_token = admin_token;
  o.cluster_token = cluster_token;
  SystemClock clock;
  auto service = CoordinatorService::Create(o, std::move(*store), &clock);
  if (!service.ok()) {
    KVRING_LOG(ERROR) << service.status();
    return 1;
  }
  grpc::ServerBuilder builder;
  int port = 0;
  auto creds = MakeServerCredentials(tls);
  if (!creds.ok()) {
    KVRING_LOG(ERROR) << creds.status();
    return 1;
  }
  builder.AddListeningPort(listen, *creds, &port);
  builder.RegisterService(service->get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    KVRING_LOG(ERROR) << "cannot listen on " << listen;
    return 1;
  }
  HttpServer http;
  MetricsRegistry metrics;
  GaugeMetric* g_map = metrics.Gauge("kvring_map_version", "Version of the shard map");
  GaugeMetric* g_up = metrics.Gauge("kvring_nodes_up", "Nodes UP in the shard map");
  GaugeMetric* g_nodes = metrics.Gauge("kvring_nodes", "Nodes in the shard map, UP or DOWN");
  if (!metrics_listen.empty()) {
    auto hp = ParseHostPort(metrics_listen);
    if (!hp.ok()) {
      KVRING_LOG(ERROR) << "--metrics_listen: " << hp.status().message();
      return 2;
    }
    http.Handle(
        "/metrics",
        [&] {
          const v1::ShardMap m = (*service)->CurrentMap();
          int up = 0;
          for (const auto& n : m.nodes()) up += n.state() == v1::NodeInfo::UP;
          g_map->Set(static_cast<double>(m.version()));
          g_up->Set(up);
          g_nodes->Set(m.nodes_size());
          return metrics.Render();
        },
        MetricsRegistry::kContentType);
    absl::StatusOr<int> mp = http.Start(hp->host, hp->port);
    if (!mp.ok()) {
      KVRING_LOG(ERROR) << "metrics server on " << metrics_listen << ": " << mp.status().message();
      return 1;
    }
    KVRING_LOG(INFO) << "metrics on port " << *mp;
  }
  absl::Notification stop;
  std::thread monitor([&] {
    while (!stop.WaitForNotificationWithTimeout(hb_interval / 2)) (*service)->Tick();
  });
  if (!port_file.empty()) {
    std::ofstream(port_file + ".tmp") << port << "\n";
    std::filesystem::rename(port_file + ".tmp", port_file, ec);
  }
  KVRING_LOG(INFO) << "kvring-coordinator ready on port " << port << " (R=" << replication << ", timeout "
                   << absl::FormatDuration(hb_timeout) << ")";
  const int sig = WaitForTerminationSignal();
  KVRING_LOG(INFO) << "signal " << sig << ": shutting down";
  stop.Notify();
  monitor.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(3));
  return 0;
}
