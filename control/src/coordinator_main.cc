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
#include "kvring/common/status_macros.h"
#include "kvring/control/coordinator_service.h"
#include "kvring/control/etcd_client.h"
#include "kvring/control/etcd_metadata_store.h"
#include "kvring/control/leader_election.h"
#include "kvring/protocol/tls.h"

using namespace kvring;

namespace {

// Exit statuses: 2 when the flags are wrong, 1 when the coordinator could
// not start.
int Fail(const absl::Status& s, const char* what, int code) {
  KVRING_LOG(ERROR) << what << ": " << s.message();
  return code;
}

// The command line as the flag parser fills it in, with the defaults the
// coordinator documents.
struct Flags {
  std::string listen = "0.0.0.0:7000", data_dir, admin_token, admin_token_file, cluster_token, cluster_token_file;
  std::string port_file, log_level = "info", metrics_listen;
  uint64_t replication = 2, write_quorum = 0, vnodes = 64, chunk_blocks = 64;
  absl::Duration hb_interval = absl::Milliseconds(500), hb_timeout = absl::Seconds(3);
  bool check_config = false;
  std::string etcd, etcd_prefix = "/kvring/", advertise;
  absl::Duration lease_ttl = absl::Seconds(5);
  TlsConfig etcd_tls, tls;
};

void DefineFlags(FlagSet& flags, Flags& f) {
  flags.AddString("listen", &f.listen, "gRPC listen address host:port");
  flags.AddString("data_dir", &f.data_dir, "directory of the metadata database (required without --etcd)");
  flags.AddString("etcd", &f.etcd,
                  "etcd members host:port,... : keep the metadata in etcd and lead or stand by (empty: RocksDB in "
                  "--data_dir, one coordinator)");
  flags.AddString("etcd_prefix", &f.etcd_prefix, "key prefix of this cluster in etcd (clusters may share an etcd)");
  flags.AddString("etcd_ca", &f.etcd_tls.ca_file, "CA that signed etcd's certificates (TLS towards etcd)");
  flags.AddString("etcd_cert", &f.etcd_tls.cert_file, "client certificate presented to etcd");
  flags.AddString("etcd_key", &f.etcd_tls.key_file, "key of --etcd_cert");
  flags.AddString("advertise", &f.advertise,
                  "host:port standbys name as the leader when this one leads (default: --listen's host, or this "
                  "machine's name for 0.0.0.0, with the bound port)");
  flags.AddDuration("lease_ttl", &f.lease_ttl,
                    "leadership lease in etcd: a standby leads within about this long of the leader's death (>= 2s)");
  flags.AddString("admin_token", &f.admin_token, "token for tenant administration (prefer --admin_token_file)");
  flags.AddString("admin_token_file", &f.admin_token_file, "file holding the admin token");
  flags.AddString("cluster_token", &f.cluster_token, "token nodes present (prefer --cluster_token_file)");
  flags.AddString("cluster_token_file", &f.cluster_token_file, "file holding the cluster token");
  flags.AddUint("replication", &f.replication, "replicas per block (R)");
  flags.AddUint("write_quorum", &f.write_quorum, "acknowledgements a write needs (0: R)");
  flags.AddUint("virtual_nodes", &f.vnodes, "hash-ring points per node");
  flags.AddUint("sequence_chunk_blocks", &f.chunk_blocks, "blocks per contiguous chunk of an attention sequence");
  flags.AddDuration("heartbeat_interval", &f.hb_interval, "how often nodes heartbeat");
  flags.AddDuration("heartbeat_timeout", &f.hb_timeout, "silence after which a node is marked DOWN");
  flags.AddString("metrics_listen", &f.metrics_listen, "Prometheus /metrics address host:port (empty: off)");
  flags.AddString("port_file", &f.port_file, "write the bound port here once serving");
  flags.AddString("log_level", &f.log_level, "debug, info, warning or error");
  AddTlsFlags(&flags, &f.tls, /*server=*/true);
  flags.AddBool("check_config", &f.check_config, "parse and check the flags and config file, then exit");
}

// The tokens read and the flags checked; what is wrong names its flag.
absl::Status CheckFlags(Flags& f) {
  KVRING_ASSIGN_OR_RETURN(f.admin_token,
                          TokenFromFlags(f.admin_token, f.admin_token_file, "admin_token", f.check_config));
  KVRING_ASSIGN_OR_RETURN(f.cluster_token,
                          TokenFromFlags(f.cluster_token, f.cluster_token_file, "cluster_token", f.check_config));
  if (f.data_dir.empty() && f.etcd.empty()) return absl::InvalidArgumentError("--data_dir (or --etcd) is required");
  if (!f.etcd.empty()) {
    if (auto e = EtcdClient::ParseEndpoints(f.etcd); !e.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--etcd: ", e.status().message()));
    }
    if (f.lease_ttl < absl::Seconds(2)) {
      return absl::InvalidArgumentError("--lease_ttl must be at least 2s (etcd refuses shorter leases)");
    }
    if (f.etcd_prefix.empty() || f.etcd_prefix.back() != '/') {
      return absl::InvalidArgumentError("--etcd_prefix must end with '/'");
    }
  }
  if (f.replication == 0 || f.replication > 16 || f.write_quorum > f.replication || f.hb_timeout <= f.hb_interval ||
      !ParseHostPort(f.listen).ok()) {
    return absl::InvalidArgumentError(
        "replication in [1,16], write_quorum <= replication, heartbeat_timeout > heartbeat_interval, listen "
        "host:port");
  }
  if (!f.metrics_listen.empty()) {
    if (auto hp = ParseHostPort(f.metrics_listen); !hp.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--metrics_listen: ", hp.status().message()));
    }
  }
  return absl::OkStatus();
}

// Where the metadata lives: RocksDB in --data_dir, or etcd (then `etcd`
// and `etcd_store`, the same object as `store`, are set).
struct Store {
  std::unique_ptr<EtcdClient> etcd;
  std::unique_ptr<MetadataStore> store;
  EtcdMetadataStore* etcd_store = nullptr;
};

absl::StatusOr<Store> OpenStore(const Flags& f) {
  Store st;
  if (f.etcd.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(f.data_dir, ec);
    KVRING_ASSIGN_OR_RETURN(st.store, MetadataStore::Open(f.data_dir + "/meta"));
    return st;
  }
  EtcdOptions eo;
  eo.endpoints = *EtcdClient::ParseEndpoints(f.etcd);
  if (f.etcd_tls.enabled()) {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> c = MakeChannelCredentials(f.etcd_tls);
    if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat("etcd TLS: ", c.status().message()));
    eo.credentials = *c;
  }
  KVRING_ASSIGN_OR_RETURN(st.etcd, EtcdClient::Create(eo));
  auto s = std::make_unique<EtcdMetadataStore>(st.etcd.get(), f.etcd_prefix);
  st.etcd_store = s.get();
  st.store = std::move(s);
  return st;
}

CoordinatorOptions OptionsFrom(const Flags& f, bool standby) {
  CoordinatorOptions o;
  o.replication = static_cast<uint32_t>(f.replication);
  o.write_quorum = static_cast<uint32_t>(f.write_quorum);
  o.virtual_nodes = static_cast<uint32_t>(f.vnodes);
  o.sequence_chunk_blocks = static_cast<uint32_t>(f.chunk_blocks);
  o.heartbeat_interval = f.hb_interval;
  o.heartbeat_timeout = f.hb_timeout;
  o.admin_token = f.admin_token;
  o.cluster_token = f.cluster_token;
  o.standby = standby;
  return o;
}

// /metrics on `listen`: the map's version, its nodes UP and in all, and
// whether this coordinator leads, read at each scrape.
absl::Status ServeMetrics(const std::string& listen, CoordinatorService* service, MetricsRegistry& metrics,
                          HttpServer& http) {
  KVRING_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(listen));
  GaugeMetric* g_map = metrics.Gauge("kvring_map_version", "Version of the shard map");
  GaugeMetric* g_up = metrics.Gauge("kvring_nodes_up", "Nodes UP in the shard map");
  GaugeMetric* g_nodes = metrics.Gauge("kvring_nodes", "Nodes in the shard map, UP or DOWN");
  GaugeMetric* g_leading =
      metrics.Gauge("kvring_coordinator_leading", "1 while this coordinator leads (accepts writes)");
  http.Handle(
      "/metrics",
      [=, &metrics] {
        const v1::ShardMap m = service->CurrentMap();
        int up = 0;
        for (const auto& n : m.nodes()) up += n.state() == v1::NodeInfo::UP;
        g_map->Set(static_cast<double>(m.version()));
        g_up->Set(up);
        g_nodes->Set(m.nodes_size());
        g_leading->Set(service->leading() ? 1 : 0);
        return metrics.Render();
      },
      MetricsRegistry::kContentType);
  absl::StatusOr<int> port = http.Start(hp.host, hp.port);
  if (!port.ok()) return port.status();
  KVRING_LOG(INFO) << "metrics on port " << *port;
  return absl::OkStatus();
}

// What standbys name as the leader while this one leads: --advertise, else
// --listen's host (this machine's name for a wildcard) and the bound port.
std::string Advertised(const Flags& f, int port) {
  if (!f.advertise.empty()) return f.advertise;
  std::string host = ParseHostPort(f.listen)->host;
  if (host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]") {
    char name[256] = {0};
    host = gethostname(name, sizeof(name) - 1) == 0 ? name : "127.0.0.1";
  }
  return absl::StrCat(host, ":", port);
}

// The etcd mode: campaigns for the lead; the service leads while its lease
// holds and stands by otherwise.
std::unique_ptr<LeaderElection> StartElection(const Flags& f, int port, Store& st, CoordinatorService* service) {
  LeaderElectionOptions eo;
  eo.key = f.etcd_prefix + "leader";
  eo.candidate = Advertised(f, port);
  eo.ttl = f.lease_ttl;
  // (on_lead runs on the election's own thread, after Start: the slot is
  // filled by then.)
  auto election_slot = std::make_shared<LeaderElection*>(nullptr);
  eo.on_lead = [election_slot, service, store = st.etcd_store, key = eo.key](int64_t fence) {
    store->SetFence(key, fence);
    LeaderElection* election = *election_slot;
    return service->BecomeLeader([election] { return election->LeaseHeld(); });
  };
  eo.on_follow = [service, store = st.etcd_store, key = eo.key](const std::string& leader, const absl::Status& why) {
    service->BecomeStandby(leader, why);
    store->SetFence(key, 0);
  };
  KVRING_LOG(INFO) << "etcd mode: " << f.etcd << " (prefix " << f.etcd_prefix << "), advertised as " << eo.candidate
                   << ", lease " << absl::FormatDuration(f.lease_ttl);
  auto election = std::make_unique<LeaderElection>(st.etcd.get(), std::move(eo));
  *election_slot = election.get();
  election->Start();
  return election;
}

}  // namespace

int main(int argc, char** argv) {
  BlockTerminationSignals();
  DisableMutexDeadlockDetection();
  Flags f;
  FlagSet flags("kvring-coordinator", "membership, shard map and tenants of a kvring cluster");
  DefineFlags(flags, f);
  if (absl::Status s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "kvring-coordinator: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::printf("%s", flags.Usage().c_str());
    return 0;
  }
  LogLevel lvl;
  if (!ParseLogLevel(f.log_level, &lvl)) return Fail(absl::InvalidArgumentError(f.log_level), "--log_level", 2);
  SetLogLevel(lvl);
  if (absl::Status s = CheckFlags(f); !s.ok()) return Fail(s, "flags", 2);
  if (f.check_config) {
    std::printf("kvring-coordinator: config OK\n");
    return 0;
  }
  absl::StatusOr<Store> st = OpenStore(f);
  if (!st.ok()) return Fail(st.status(), "metadata store", 1);
  SystemClock clock;
  const bool standby = st->etcd_store != nullptr;
  auto service = CoordinatorService::Create(OptionsFrom(f, standby), std::move(st->store), &clock);
  if (!service.ok()) return Fail(service.status(), "coordinator", 1);
  auto creds = MakeServerCredentials(f.tls);
  if (!creds.ok()) return Fail(creds.status(), "TLS", 1);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(f.listen, *creds, &port);
  // A port another process listens on is an error, not a port shared with
  // it (gRPC sets SO_REUSEPORT otherwise, and the kernel would split the
  // connections between the two).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(service->get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    return Fail(
        absl::UnavailableError(absl::StrCat(f.listen, " (in use by another process, or not an address of this host)")),
        "cannot listen on", 1);
  }
  MetricsRegistry metrics;
  HttpServer http;
  if (!f.metrics_listen.empty()) {
    if (absl::Status s = ServeMetrics(f.metrics_listen, service->get(), metrics, http); !s.ok()) {
      return Fail(s, "metrics server", 1);
    }
  }
  std::unique_ptr<LeaderElection> election = standby ? StartElection(f, port, *st, service->get()) : nullptr;
  absl::Notification stop;
  std::thread monitor([&] {
    while (!stop.WaitForNotificationWithTimeout(f.hb_interval / 2)) (*service)->Tick();
  });
  if (!f.port_file.empty()) {
    std::error_code ec;
    std::ofstream(f.port_file + ".tmp") << port << "\n";
    std::filesystem::rename(f.port_file + ".tmp", f.port_file, ec);
  }
  KVRING_LOG(INFO) << "kvring-coordinator ready on port " << port << " (R=" << f.replication << ", timeout "
                   << absl::FormatDuration(f.hb_timeout) << ")";
  const int sig = WaitForTerminationSignal();
  KVRING_LOG(INFO) << "signal " << sig << ": shutting down";
  if (election) election->Stop();  // resign: a standby leads at its next round
  stop.Notify();
  monitor.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(3));
  return 0;
}
