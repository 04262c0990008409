// kvringd: the kvring node daemon. Holds a block store (host DRAM + RocksDB
// cold tier on local SSD; with --gpu an HBM tier in front for the attention
// sequences, attended on the GPU), serves the Node gRPC service (and the UCX
// data plane when enabled), registers and heartbeats with the coordinator,
// and exports Prometheus metrics. The daemon itself is NodeDaemon
// (kvring/control/node_daemon.h); this is its flags and its signals.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvring/common/flags.h"
#include "kvring/common/logging.h"
#include "kvring/common/process.h"
#include "kvring/common/status_macros.h"
#include "kvring/control/node_daemon.h"
#include "kvring/protocol/tls.h"

using namespace kvring;

namespace {

int Fail(const absl::Status& s, const char* what) {
  KVRING_LOG(ERROR) << what << ": " << s;
  return 1;
}

// The command line as the flag parser fills it in (FlagSet takes int64_t
// and std::string fields), with the defaults kvringd documents.
struct Flags {
  std::string listen = "0.0.0.0:7100", advertise, coordinator = "127.0.0.1:7000", cluster_token, cluster_token_file;
  std::string data_dir, node_id, eviction = "lru", cold_codec = "zstd", metrics_listen = "127.0.0.1:0", port_file;
  std::string log_level = "info", ucx_listen;
  int64_t gpu = -1, gpu_lanes = 4, ucx_spin_us = -1, ucx_spin_max_us = -1, ucx_inline_attend_rows = -1, threads = 0;
  bool ucx_busy_poll = false;
  uint64_t hbm_bytes = 0, host_bytes = 1ull << 30, page_bytes = 2ull << 20, max_message = 256ull << 20;
  bool write_through = false, cold_sync = false, lock_memory = false, check_config = false;
  bool delivery_checksum = false, device_delivery = true, check_append_values = true;
  TlsConfig tls;
};

void DefineFlags(FlagSet& flags, Flags& f) {
  flags.AddString("listen", &f.listen, "gRPC listen address host:port (port 0: any free port)");
  flags.AddString("advertise", &f.advertise,
                  "address other processes use to reach this node (default: listen, with 127.0.0.1 for 0.0.0.0)");
  flags.AddString("coordinator", &f.coordinator,
                  "coordinator address host:port, or every coordinator: host:port,host:port,...");
  flags.AddString("cluster_token", &f.cluster_token,
                  "token nodes present to the coordinator (prefer --cluster_token_file)");
  flags.AddString("cluster_token_file", &f.cluster_token_file, "file holding the cluster token");
  flags.AddString("data_dir", &f.data_dir, "directory for the cold tier and node metadata (required)");
  flags.AddString("node_id", &f.node_id, "node id (default: generated once and kept in data_dir)");
  flags.AddBytes("host_bytes", &f.host_bytes, "host-DRAM tier capacity (e.g. 8G)");
  flags.AddBytes("page_bytes", &f.page_bytes, "page size = largest block accepted (e.g. 2M)");
  flags.AddString("eviction_policy", &f.eviction, "host-tier eviction policy");
  flags.AddString("cold_codec", &f.cold_codec, "cold-tier compression: zstd, lz4 or none");
  flags.AddBool("cold_write_through", &f.write_through, "write every Put to the cold tier before acknowledging it");
  flags.AddBool("cold_sync", &f.cold_sync, "fsync cold-tier writes (survive power loss, not just crashes)");
  flags.AddBool("lock_memory", &f.lock_memory, "mlock the host tier");
  flags.AddBool("device_delivery", &f.device_delivery,
                "with --gpu: copy Get's blocks straight into the GPU memory of callers on this host that ask for it "
                "(CUDA IPC). Any process on the host that learns a caller's memory handle could name it: turn this "
                "off on hosts whose engines do not trust each other");
  flags.AddBool("check_append_values", &f.check_append_values,
                "refuse appended K/V holding NaN or Inf (one pass over a step's appended bytes; off: such a token "
                "poisons every later step of its sequence)");
  flags.AddBool("delivery_checksum", &f.delivery_checksum,
                "with --gpu: check each block's checksum again before copying it into a same-host caller's GPU "
                "memory (blocks are checked when they enter the host tier; the re-check costs host memory bandwidth)");
  flags.AddInt("threads", &f.threads, "attention compute threads (0: all cores)");
  flags.AddInt("gpu", &f.gpu, "CUDA device for the HBM tier and GPU attention (-1: none, attention on the CPU)");
  flags.AddBytes("hbm_bytes", &f.hbm_bytes, "with --gpu: HBM for attention sequences (e.g. 40G; required with --gpu)");
  flags.AddInt("gpu_lanes", &f.gpu_lanes, "with --gpu: requests on the GPU at once, each with its own stream (1-64)");
  flags.AddBytes("max_message_bytes", &f.max_message, "largest gRPC message accepted or sent");
  flags.AddString("metrics_listen", &f.metrics_listen, "Prometheus /metrics address host:port (empty: off)");
  flags.AddString("ucx_listen", &f.ucx_listen,
                  "UCX data-plane listen address host:port (empty: off; clients use gRPC payloads)");
  flags.AddInt(
      "ucx_spin_us", &f.ucx_spin_us,
      "UCX progress thread: busy-poll this long after each message before sleeping (-1: 20 with 8+ cores, else 0)");
  flags.AddInt("ucx_spin_max_us", &f.ucx_spin_max_us,
               "UCX adaptive spin: while messages keep arriving (each within this window of the last), the progress "
               "thread busy-polls up to this long after each one instead of --ucx_spin_us, so a decode loop's steps "
               "find it awake; idle, it sleeps (-1: 2000 with 8+ cores, else 0; 0: off)");
  flags.AddBool("ucx_busy_poll", &f.ucx_busy_poll,
                "UCX progress thread: poll without ever sleeping (lowest latency, one core busy)");
  flags.AddInt("ucx_inline_attend_rows", &f.ucx_inline_attend_rows,
               "serve Attend steps of at most this many query rows (decode) on the UCX thread itself: two thread "
               "hand-offs fewer a step, while that thread serves nothing else (0: off; -1: 64 on a GPU node, where a "
               "step takes tens of microseconds, 0 on a CPU node, where it takes milliseconds)");
  flags.AddString("port_file", &f.port_file, "write the bound gRPC port here once serving (for scripts and tests)");
  flags.AddString("log_level", &f.log_level, "debug, info, warning or error");
  AddTlsFlags(&flags, &f.tls, /*server=*/true);
  flags.AddBool("check_config", &f.check_config, "parse and check the flags and config file, then exit");
}

// The daemon's options from its flags (the cluster token read from its file
// unless --check_config), checked; what is wrong names its flag.
absl::StatusOr<NodeDaemonOptions> OptionsFrom(const Flags& f) {
  KVRING_ASSIGN_OR_RETURN(std::string cluster_token,
                          TokenFromFlags(f.cluster_token, f.cluster_token_file, "cluster_token", f.check_config));
  NodeDaemonOptions o;
  o.listen = f.listen;
  o.advertise = f.advertise;
  o.coordinator = f.coordinator;
  o.cluster_token = cluster_token;
  if (f.check_config && o.cluster_token.empty()) o.cluster_token = "unread";  // (--check_config reads no token file)
  o.data_dir = f.data_dir;
  o.node_id = f.node_id;
  o.host_bytes = f.host_bytes;
  o.page_bytes = f.page_bytes;
  o.eviction_policy = f.eviction;
  o.cold_codec = f.cold_codec;
  o.cold_write_through = f.write_through;
  o.cold_sync = f.cold_sync;
  o.lock_memory = f.lock_memory;
  o.device_delivery = f.device_delivery;
  o.delivery_checksum = f.delivery_checksum;
  o.check_append_values = f.check_append_values;
  // (flags beyond int's range are clamped to it, so that they are refused, not truncated into range)
  auto to_int = [](int64_t v) {
    return static_cast<int>(std::clamp<int64_t>(v, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
  };
  o.threads = to_int(f.threads);
  o.gpu = to_int(f.gpu);
  o.hbm_bytes = f.hbm_bytes;
  o.gpu_lanes = to_int(f.gpu_lanes);
  o.max_message_bytes = f.max_message;
  o.metrics_listen = f.metrics_listen;
  o.ucx_listen = f.ucx_listen;
  o.ucx_loop.spin_us = to_int(f.ucx_spin_us);
  o.ucx_loop.spin_max_us = to_int(f.ucx_spin_max_us);
  o.ucx_loop.wakeup = !f.ucx_busy_poll;
  o.ucx_inline_attend_rows = to_int(f.ucx_inline_attend_rows);
  o.tls = f.tls;
  KVRING_RETURN_IF_ERROR(ValidateNodeDaemonOptions(o));
  return o;
}

// The UCX data plane listens on --ucx_listen's port (its TCP transport), not
// on one the system picks. UCX 1.13 takes this setting only from its
// environment (ucp_config_modify does not reach the TCP transport), so it is
// set here, from the flag, before any thread or UCX context exists.
absl::Status PinUcxPort(const std::string& ucx_listen) {
  if (ucx_listen.empty()) return absl::OkStatus();
  const size_t colon = ucx_listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(ucx_listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--ucx_listen: '", ucx_listen, "' is not host:port"));
  }
  if (port != 0) ::setenv("UCX_TCP_PORT_RANGE", absl::StrCat(port, "-", port).c_str(), /*overwrite=*/1);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  BlockTerminationSignals();
  DisableMutexDeadlockDetection();
  Flags f;
  FlagSet flags("kvringd", "the kvring node daemon: a shard of the KV-block store with attention where the KV lives");
  DefineFlags(flags, f);
  if (absl::Status s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "kvringd: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::printf("%s", flags.Usage().c_str());
    return 0;
  }
  LogLevel lvl;
  if (!ParseLogLevel(f.log_level, &lvl)) return Fail(absl::InvalidArgumentError(f.log_level), "--log_level");
  SetLogLevel(lvl);
  absl::StatusOr<NodeDaemonOptions> o = OptionsFrom(f);
  if (!o.ok()) return Fail(o.status(), "flags");
  if (f.check_config) {
    std::printf("kvringd: config OK\n");
    return 0;
  }
  if (absl::Status s = PinUcxPort(f.ucx_listen); !s.ok()) return Fail(s, "flags");
  // A poisoned CUDA context cannot recover in this process: shut down, so
  // that a supervisor restarts the daemon (the host and cold tiers keep their
  // blocks; replicas serve meanwhile).
  o->on_gpu_failure = [] {
    KVRING_LOG(ERROR) << "shutting down for a restart";
    kill(getpid(), SIGTERM);
  };
  auto daemon = NodeDaemon::Open(*std::move(o));
  if (!daemon.ok()) return Fail(daemon.status(), "kvringd");
  if (!f.port_file.empty()) {
    std::error_code ec;
    std::ofstream(f.port_file + ".tmp") << (*daemon)->grpc_port() << "\n";
    std::filesystem::rename(f.port_file + ".tmp", f.port_file, ec);
  }
  const int sig = WaitForTerminationSignal();
  KVRING_LOG(INFO) << "signal " << sig << ": shutting down";
  (*daemon)->Shutdown();
  if ((*daemon)->gpu_failed()) {
    KVRING_LOG(ERROR) << "exiting with status 3: the GPU context failed";
    std::_Exit(3);  // the CUDA context cannot be torn down cleanly
  }
  return 0;
}
