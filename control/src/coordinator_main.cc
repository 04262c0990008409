// kvring-coordinator: membership, the shard map and tenants for a kvring
// cluster, persisted in RocksDB (one coordinator) or in etcd (--etcd: any
// number of coordinators, one leading through an etcd lease, the others
// serving reads; docs/CONTROL-PLANE.md).
#include <unistd.h>

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
#include "kvring/control/etcd_client.h"
#include "kvring/control/etcd_metadata_store.h"
#include "kvring/control/leader_election.h"
#include "kvring/protocol/tls.h"

using namespace kvring;

int main(int argc, char** argv) {
  BlockTerminationSignals();
  DisableMutexDeadlockDetection();
  std::string listen = "0.0.0.0:7000", data_dir, admin_token, admin_token_file, cluster_token, cluster_token_file;
  std::string port_file, log_level = "info", metrics_listen;
  uint64_t replication = 2, write_quorum = 0, vnodes = 64, chunk_blocks = 64;
  absl::Duration hb_interval = absl::Milliseconds(500), hb_timeout = absl::Seconds(3);
  bool check_config = false;
  std::string etcd, etcd_prefix = "/kvring/", advertise;
  absl::Duration lease_ttl = absl::Seconds(5);
  TlsConfig etcd_tls;
  FlagSet flags("kvring-coordinator", "membership, shard map and tenants of a kvring cluster");
  flags.AddString("listen", &listen, "gRPC listen address host:port");
  flags.AddString("data_dir", &data_dir, "directory of the metadata database (required without --etcd)");
  flags.AddString("etcd", &etcd,
                  "etcd members host:port,... : keep the metadata in etcd and lead or stand by (empty: RocksDB in "
                  "--data_dir, one coordinator)");
  flags.AddString("etcd_prefix", &etcd_prefix, "key prefix of this cluster in etcd (clusters may share an etcd)");
  flags.AddString("etcd_ca", &etcd_tls.ca_file, "CA that signed etcd's certificates (TLS towards etcd)");
  flags.AddString("etcd_cert", &etcd_tls.cert_file, "client certificate presented to etcd");
  flags.AddString("etcd_key", &etcd_tls.key_file, "key of --etcd_cert");
  flags.AddString("advertise", &advertise,
                  "host:port standbys name as the leader when this one leads (default: --listen's host, or this "
                  "machine's name for 0.0.0.0, with the bound port)");
  flags.AddDuration("lease_ttl", &lease_ttl,
                    "leadership lease in etcd: a standby leads within about this long of the leader's death (>= 2s)");
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
  if (data_dir.empty() && etcd.empty()) {
    KVRING_LOG(ERROR) << "--data_dir (or --etcd) is required";
    return 2;
  }
  if (!etcd.empty()) {
    if (auto e = EtcdClient::ParseEndpoints(etcd); !e.ok()) {
      KVRING_LOG(ERROR) << "--etcd: " << e.status().message();
      return 2;
    }
    if (lease_ttl < absl::Seconds(2)) {
      KVRING_LOG(ERROR) << "--lease_ttl must be at least 2s (etcd refuses shorter leases)";
      return 2;
    }
    if (etcd_prefix.empty() || etcd_prefix.back() != '/') {
      KVRING_LOG(ERROR) << "--etcd_prefix must end with '/'";
      return 2;
    }
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
  std::unique_ptr<MetadataStore> store;
  std::unique_ptr<EtcdClient> etcd_client;
  EtcdMetadataStore* etcd_store = nullptr;
  if (etcd.empty()) {
    std::filesystem::create_directories(data_dir, ec);
    auto opened = MetadataStore::Open(data_dir + "/meta");
    if (!opened.ok()) {
      KVRING_LOG(ERROR) << opened.status();
      return 1;
    }
    store = std::move(*opened);
  } else {
    EtcdOptions eo;
    eo.endpoints = *EtcdClient::ParseEndpoints(etcd);
    if (etcd_tls.enabled()) {
      auto c = MakeChannelCredentials(etcd_tls);
      if (!c.ok()) {
        KVRING_LOG(ERROR) << "etcd TLS: " << c.status().message();
        return 2;
      }
      eo.credentials = *c;
    }
    auto client = EtcdClient::Create(eo);
    if (!client.ok()) {
      KVRING_LOG(ERROR) << client.status();
      return 2;
    }
    etcd_client = std::move(*client);
    auto s = std::make_unique<EtcdMetadataStore>(etcd_client.get(), etcd_prefix);
    etcd_store = s.get();
    store = std::move(s);
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
  o.standby = etcd_store != nullptr;
  SystemClock clock;
  auto service = CoordinatorService::Create(o, std::move(store), &clock);
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
  GaugeMetric* g_leading =
      metrics.Gauge("kvring_coordinator_leading", "1 while this coordinator leads (accepts writes)");
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
          g_leading->Set((*service)->leading() ? 1 : 0);
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
  // The etcd mode: lead or stand by.
  std::unique_ptr<LeaderElection> election;
  if (etcd_store != nullptr) {
    if (advertise.empty()) {
      auto hp = ParseHostPort(listen);
      std::string host = hp->host;
      if (host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]") {
        char name[256] = {0};
        host = gethostname(name, sizeof(name) - 1) == 0 ? name : "127.0.0.1";
      }
      advertise = absl::StrCat(host, ":", port);
    }
    LeaderElectionOptions eo;
    eo.key = etcd_prefix + "leader";
    eo.candidate = advertise;
    eo.ttl = lease_ttl;
    eo.on_lead = [&, key = eo.key](int64_t fence) {
      etcd_store->SetFence(key, fence);
      return (*service)->BecomeLeader([&] { return election->LeaseHeld(); });
    };
    eo.on_follow = [&, key = eo.key](const std::string& leader, const absl::Status& why) {
      (*service)->BecomeStandby(leader, why);
      etcd_store->SetFence(key, 0);
    };
    election = std::make_unique<LeaderElection>(etcd_client.get(), eo);
    election->Start();
    KVRING_LOG(INFO) << "etcd mode: " << etcd << " (prefix " << etcd_prefix << "), advertised as " << advertise
                     << ", lease " << absl::FormatDuration(lease_ttl);
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
  if (election) election->Stop();  // resign: a standby leads at its next round
  stop.Notify();
  monitor.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(3));
  return 0;
}
