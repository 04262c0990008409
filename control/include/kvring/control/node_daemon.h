// NodeDaemon: one kvring node, assembled and serving (kvringd is its flags
// and a signal wait around NodeDaemon::Open, in the way of RocksDB's
// DB::Open).
//
// Open builds, in order: the node's metadata (its id kept in data_dir), the
// block store (host DRAM + the RocksDB cold tier, recovered), the sequence
// table, the attention backend (CPU, or CUDA with --gpu, with delivery into
// same-host callers' GPU memory), the node core, the gRPC Node service, the
// optional UCX data plane, the /metrics and /healthz endpoints, the
// background reclaimer (deleted tenants) and expirer (idle sequences), and
// the coordinator link (registration, heartbeats, tenants). Any failure is
// returned with what failed; nothing is left running.
//
// Thread safety: the accessors may be called from any thread; Shutdown and
// the destructor from one thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvring/common/tls_config.h"
#include "kvring/transport/ucx_rpc.h"

namespace kvring {

struct NodeDaemonOptions {
  // gRPC listen address host:port (port 0: any free port).
  std::string listen = "0.0.0.0:7100";
  // The address other processes reach this node at. Default: `listen`, with
  // 127.0.0.1 for 0.0.0.0.
  std::string advertise;
  // The coordinator(s): host:port, or host:port,host:port,...
  std::string coordinator = "127.0.0.1:7000";
  // The token nodes present to the coordinator. Required.
  std::string cluster_token;
  // The cold tier and the node's metadata. Required.
  std::string data_dir;
  // Default: generated once and kept in data_dir.
  std::string node_id;
  uint64_t host_bytes = 1ull << 30;  // host-DRAM tier
  uint64_t page_bytes = 2ull << 20;  // the largest block accepted
  std::string eviction_policy = "lru";
  std::string cold_codec = "zstd";  // zstd, lz4 or none
  bool cold_write_through = false;
  bool cold_sync = false;
  bool lock_memory = false;
  // With gpu >= 0: Get into same-host callers' GPU memory (CUDA IPC), and
  // blocks' checksums checked again before such a copy.
  bool device_delivery = true;
  bool delivery_checksum = false;
  // Refuse appended K/V holding NaN or Inf.
  bool check_append_values = true;
  int threads = 0;  // attention compute threads (0: all cores)
  // CUDA device for the HBM tier and GPU attention (-1: none), its HBM for
  // sequences (required with a GPU) and its lanes (1-64).
  int gpu = -1;
  uint64_t hbm_bytes = 0;
  int gpu_lanes = 4;
  uint64_t max_message_bytes = 256ull << 20;  // the largest gRPC message
  // Prometheus /metrics and /healthz (empty: off).
  std::string metrics_listen = "127.0.0.1:0";
  // The UCX data plane (empty: off) and its progress loop.
  std::string ucx_listen;
  UcxLoopOptions ucx_loop;
  // Attend steps of at most this many rows served on the UCX thread itself
  // (-1: 64 on a GPU node, 0 on a CPU node).
  int ucx_inline_attend_rows = -1;
  TlsConfig tls;
  // Called once, from the thread that met it, after the GPU context was
  // poisoned (the node then reports itself unhealthy). kvringd shuts down
  // for a restart. Default: none.
  std::function<void()> on_gpu_failure;
};

// INVALID_ARGUMENT naming the option when `o` cannot work (what kvringd
// --check_config checks; Open checks it too).
absl::Status ValidateNodeDaemonOptions(const NodeDaemonOptions& o);

class NodeDaemon {
 public:
  static absl::StatusOr<std::unique_ptr<NodeDaemon>> Open(NodeDaemonOptions options);
  // Shutdown(), then everything goes, in the reverse order of Open.
  ~NodeDaemon();
  NodeDaemon(const NodeDaemon&) = delete;
  NodeDaemon& operator=(const NodeDaemon&) = delete;

  const std::string& node_id() const;
  int grpc_port() const;
  const std::string& advertise() const;
  const std::string& ucx_address() const;  // empty: no UCX data plane
  int metrics_port() const;                // 0: none
  // The GPU context was poisoned (the daemon cannot recover in-process).
  bool gpu_failed() const;
  // Stops taking requests: gRPC drains for up to 5 s, the UCX plane stops.
  // Idempotent.
  void Shutdown();

 private:
  struct Parts;
  NodeDaemon();
  std::unique_ptr<Parts> p_;
};

}  // namespace kvring
