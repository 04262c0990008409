// Real processes for cluster tests: a kvring-coordinator and N kvringd
// daemons on loopback, each in its own temporary data directory, started
// from the binaries of this build and stopped (SIGTERM, then SIGKILL) at the
// end. Ports are chosen by the processes (port 0) and read back from their
// --port_file, so tests never collide.
#pragma once

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kvring.grpc.pb.h"
#include "kvring/client/client.h"
#include "kvring/layout/float_convert.h"
#include "kvring/protocol/tls.h"

#ifndef KVRING_BIN_DIR
#error "KVRING_BIN_DIR must point at the build directory"
#endif

namespace kvring::testing {

class Process {
 public:
  Process() = default;
  Process(const Process&) = delete;
  ~Process() { Stop(); }
  // RLIMIT_FSIZE for the child (0: none): a "disk full" for its writes.
  void set_file_size_limit(uint64_t bytes) { fsize_limit_ = bytes; }
  bool Start(const std::vector<std::string>& argv, const std::string& log) {
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      if (fsize_limit_ > 0) {
        struct rlimit rl = {fsize_limit_, fsize_limit_};
        setrlimit(RLIMIT_FSIZE, &rl);
      }
      FILE* f = std::fopen(log.c_str(), "a");
      if (f) {
        dup2(fileno(f), 1);
        dup2(fileno(f), 2);
      }
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    return pid_ > 0;
  }
  void Kill9() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    Kill9();
  }
  // Running: started and not exited. (kill(pid, 0) also succeeds for a
  // child that exited and was not reaped yet; waitid with WNOWAIT sees the
  // exit without reaping it.)
  bool alive() const {
    if (pid_ <= 0) return false;
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0) return false;
    return info.si_pid != pid_;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  uint64_t fsize_limit_ = 0;
};

struct ClusterOptions {
  int nodes = 3;
  int replication = 2;
  bool ucx = true;
  std::string host_bytes = "256M";
  std::string page_bytes = "2M";
  bool write_through = false;
  std::vector<std::string> extra_daemon_flags;
  std::vector<std::string> extra_coordinator_flags;
  // What the test's own clients and stubs use towards a TLS cluster.
  TlsConfig client_tls;
};

class Cluster {
 public:
  explicit Cluster(ClusterOptions o) : o_(std::move(o)) {
    dir_ = std::filesystem::path(::testing::TempDir()) / absl::StrCat("kvring_cluster_", getpid(), "_", counter()++);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    admin_token_ = "admin-token-0123456789abcdef";
    cluster_token_ = "cluster-token-0123456789abcdef";
    daemons_.resize(o_.nodes);
  }
  ~Cluster() {
    for (auto& d : daemons_) d.reset();
    coordinator_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // A binary of this build: beside the test in a packed tree (<root>/bin/<test>
  // with <root>/control/kvringd, bench/gpu/pack.sh's layout), else in the
  // build directory the test was compiled for.
  static std::string Bin(const std::string& rel) {
    std::error_code ec;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) {
      const std::filesystem::path packed = self.parent_path().parent_path() / rel;
      if (self.parent_path().filename() == "bin" && std::filesystem::exists(packed)) return packed.string();
    }
    return std::string(KVRING_BIN_DIR) + "/" + rel;
  }
  const std::filesystem::path& dir() const { return dir_; }

  ::testing::AssertionResult Start() {
    if (auto r = StartCoordinator(); !r) return r;
    for (int i = 0; i < o_.nodes; ++i) {
      if (auto r = StartDaemon(i); !r) return r;
    }
    return WaitForNodesUp(o_.nodes);
  }

  ::testing::AssertionResult StartCoordinator() {
    const std::string pf = (dir_ / "coordinator.port").string();
    std::filesystem::remove(pf);
    coordinator_ = std::make_unique<Process>();
    std::vector<std::string> argv = {Bin("control/kvring-coordinator"),
                                     "--listen=127.0.0.1:" + std::to_string(coordinator_port_),
                                     "--data_dir=" + (dir_ / "coordinator").string(),
                                     "--admin_token=" + admin_token_,
                                     "--cluster_token=" + cluster_token_,
                                     "--replication=" + std::to_string(o_.replication),
                                     "--heartbeat_interval=100ms",
                                     "--heartbeat_timeout=600ms",
                                     "--port_file=" + pf};
    for (const auto& f : o_.extra_coordinator_flags) argv.push_back(f);
    coordinator_->Start(argv, (dir_ / "coordinator.log").string());
    int port = WaitPort(pf);
    if (port <= 0) return ::testing::AssertionFailure() << "coordinator did not start: " << Log("coordinator.log");
    coordinator_port_ = port;  // reuse it across restarts
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult StartDaemon(int i, std::vector<std::string> extra = {}, uint64_t file_size_limit = 0) {
    const std::string pf = (dir_ / absl::StrCat("node", i, ".port")).string();
    std::filesystem::remove(pf);
    std::vector<std::string> argv = {Bin("control/kvringd"),
                                     "--listen=127.0.0.1:0",
                                     "--coordinator=127.0.0.1:" + std::to_string(coordinator_port_),
                                     "--cluster_token=" + cluster_token_,
                                     "--data_dir=" + (dir_ / absl::StrCat("node", i)).string(),
                                     "--node_id=node" + std::to_string(i),
                                     "--host_bytes=" + o_.host_bytes,
                                     "--page_bytes=" + o_.page_bytes,
                                     "--threads=2",
                                     "--metrics_listen=",
                                     "--port_file=" + pf};
    if (o_.ucx) argv.push_back("--ucx_listen=127.0.0.1:0");
    if (o_.write_through) argv.push_back("--cold_write_through");
    for (const auto& f : o_.extra_daemon_flags) argv.push_back(f);
    for (const auto& f : extra) argv.push_back(f);
    daemons_[i] = std::make_unique<Process>();
    daemons_[i]->set_file_size_limit(file_size_limit);
    daemons_[i]->Start(argv, (dir_ / absl::StrCat("node", i, ".log")).string());
    if (WaitPort(pf) <= 0)
      return ::testing::AssertionFailure() << "node" << i << " did not start: " << Log(absl::StrCat("node", i, ".log"));
    return ::testing::AssertionSuccess();
  }

  void KillDaemon(int i) { daemons_[i]->Kill9(); }
  void StopDaemon(int i) { daemons_[i]->Stop(); }
  void KillCoordinator() { coordinator_->Kill9(); }
  Process& daemon(int i) { return *daemons_[i]; }

  // Waits until the coordinator's map shows `up` nodes UP.
  ::testing::AssertionResult WaitForNodesUp(int up, absl::Duration timeout = absl::Seconds(20)) {
    const absl::Time end = absl::Now() + timeout;
    int seen = -1;
    while (absl::Now() < end) {
      auto m = Map();
      if (m.ok()) {
        seen = 0;
        for (const auto& n : m->nodes()) seen += n.state() == v1::NodeInfo::UP;
        if (seen == up) return ::testing::AssertionSuccess();
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return ::testing::AssertionFailure() << "expected " << up << " nodes UP, saw " << seen;
  }

  absl::StatusOr<v1::ShardMap> Map() {
    auto stub = CoordinatorStub();
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + admin_token_);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::GetShardMapRequest req;
    req.set_version(1);
    v1::ShardMap m;
    grpc::Status s = stub->GetShardMap(&ctx, req, &m);
    if (!s.ok()) return absl::UnavailableError(s.error_message());
    return m;
  }

  std::unique_ptr<v1::Coordinator::Stub> CoordinatorStub() {
    auto creds = MakeChannelCredentials(o_.client_tls);
    return v1::Coordinator::NewStub(
        grpc::CreateChannel(coordinator_address(), creds.ok() ? *creds : grpc::InsecureChannelCredentials()));
  }

  // Creates a tenant and returns its token (waits until every UP daemon knows it).
  absl::StatusOr<std::string> CreateTenant(const std::string& name, std::vector<std::string> shared = {},
                                           uint64_t quota = 0, const std::string& kv_encoding = "") {
    TenantSpec spec{name, std::move(shared), quota, kv_encoding};
    absl::StatusOr<CreatedTenant> t = kvring::CreateTenant(coordinator_address(), admin_token_, spec, o_.client_tls);
    if (!t.ok()) return t.status();
    absl::SleepFor(absl::Milliseconds(400));  // > heartbeat interval: daemons refresh their directory
    return t->token;
  }

  absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& token, const std::string& ns = "", bool ucx = true,
                                                  const std::string& quantize = "") {
    ClientOptions co;
    absl::StatusOr<std::optional<KvEncoding>> q = ParseQuantizeOption(quantize);
    if (!q.ok()) return q.status();
    co.quantize = *q;
    co.tls = o_.client_tls;
    co.coordinator = coordinator_address();
    co.token = token;
    co.ns = ns;
    co.use_ucx = ucx && o_.ucx;
    co.rpc_timeout = absl::Seconds(5);
    co.map_refresh = absl::Milliseconds(200);
    return Client::Connect(co);
  }

  std::string coordinator_address() const { return "127.0.0.1:" + std::to_string(coordinator_port_); }
  // gRPC address of daemon i (from its port file).
  std::string daemon_address(int i) const {
    std::ifstream in(dir_ / absl::StrCat("node", i, ".port"));
    int p = 0;
    in >> p;
    return "127.0.0.1:" + std::to_string(p);
  }
  std::string Log(const std::string& name) const {
    std::ifstream in(dir_ / name);
    std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return all.size() > 3000 ? all.substr(all.size() - 3000) : all;
  }
  const std::string& admin_token() const { return admin_token_; }
  const std::string& cluster_token() const { return cluster_token_; }

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  int WaitPort(const std::string& file) {
    for (int i = 0; i < 400; ++i) {
      std::ifstream in(file);
      int p = 0;
      if (in >> p && p > 0) return p;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    return -1;
  }

  ClusterOptions o_;
  std::filesystem::path dir_;
  std::string admin_token_, cluster_token_;
  int coordinator_port_ = 0;
  std::unique_ptr<Process> coordinator_;
  std::vector<std::unique_ptr<Process>> daemons_;
};

// Test data: blocks with their keys and payloads.
inline BlockLayout SmallLayout() { return BlockLayout{16, 2, 2, 64, DType::kBF16}; }  // 16 KiB

struct Blocks {
  std::vector<BlockKey> keys;
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<BlockData> data;
};

// A chain of `nblocks` blocks of random bf16 values (normal), keyed for `c`.
inline Blocks MakeChain(Client& c, const BlockLayout& layout, const std::string& model, uint32_t seed, size_t nblocks) {
  Blocks b;
  std::mt19937 rng(seed);
  std::vector<uint32_t> tokens(nblocks * layout.block_tokens);
  for (auto& t : tokens) t = rng() % 50000;
  b.keys = c.Hasher(model, layout).Chain(tokens);
  std::normal_distribution<float> nd;
  for (size_t i = 0; i < nblocks; ++i) {
    b.payloads.emplace_back(layout.bytes());
    auto* h = reinterpret_cast<uint16_t*>(b.payloads.back().data());
    for (uint64_t e = 0; e < layout.elements(); ++e) h[e] = FloatToBf16(nd(rng));
  }
  for (size_t i = 0; i < nblocks; ++i) {
    b.data.push_back(BlockData{b.keys[i], i ? b.keys[i - 1] : BlockKey{}, layout, {}, b.payloads[i], false});
  }
  return b;
}

}  // namespace kvring::testing
