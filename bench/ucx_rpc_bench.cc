// Raw UCX request/reply throughput between two processes (a forked server),
// the ceiling under the daemon's data plane: replies of N bytes (as Get) and
// requests of N bytes (as Put), T client threads.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/strings/str_split.h"
#include "kvring/common/flags.h"
#include "kvring/common/thread_pool.h"
#include "kvring/transport/ucx_rpc.h"

using namespace kvring;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  std::string sizes = "256K,1M,2M";
  int64_t threads = 4, reqs = 400, port = 7790;
  FlagSet f("ucx_rpc_bench", "raw UCX request/reply throughput between two processes");
  f.AddString("sizes", &sizes, "payload sizes");
  f.AddInt("threads", &threads, "client threads");
  f.AddInt("requests", &reqs, "requests per size and direction");
  f.AddInt("port", &port, "server port");
  if (auto s = f.Parse(argc, argv); !s.ok() || f.help_requested()) {
    std::printf("%s", f.Usage().c_str());
    return 0;
  }
  int ready[2];
  if (pipe(ready) != 0) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    ThreadPool pool(2);
    std::vector<uint8_t> blob(64 << 20, 7);
    auto srv = UcxRpcServer::Start(
        "127.0.0.1:" + std::to_string(port),
        [&](UcxRequest&& r, UcxReplier rep) {
          if (r.method == 2) {  // "get": reply with meta-sized payload
            const size_t n = std::stoul(r.meta);
            rep.Send(absl::OkStatus(), "", {absl::MakeConstSpan(blob.data(), n)});
          } else {
            rep.Send(absl::OkStatus(), "");
          }
        },
        &pool, 1ull << 30);
    if (!srv.ok()) {
      std::fprintf(stderr, "server: %s\n", srv.status().ToString().c_str());
      _exit(1);
    }
    const std::string a = (*srv)->address() + "\n";
    (void)!write(ready[1], a.data(), a.size());
    pause();
    _exit(0);
  }
  std::string addr;
  for (char c; read(ready[0], &c, 1) == 1 && c != '\n';) addr.push_back(c);
  auto cli = UcxRpcClient::Connect(addr);
  if (!cli.ok()) {
    std::fprintf(stderr, "client: %s\n", cli.status().ToString().c_str());
    kill(pid, SIGKILL);
    return 1;
  }
  std::printf("%8s %6s %10s %10s\n", "size", "dir", "GB/s", "req/s");
  for (auto sz : absl::StrSplit(sizes, ',')) {
    uint64_t n = 0;
    (void)ParseByteSize(std::string(sz), &n);
    std::vector<uint8_t> payload(n, 3);
    for (int dir = 0; dir < 2; ++dir) {
      std::atomic<int64_t> next{0};
      const auto t0 = Clock::now();
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t) {
        ts.emplace_back([&] {
          std::vector<uint8_t> buf(n);
          while (next.fetch_add(1) < reqs) {
            if (dir == 0) {
              auto r = (*cli)->Call(2, "", std::to_string(n), {}, absl::MakeSpan(buf), absl::Seconds(10));
              if (!r.ok() || r->payload_size != n) std::abort();
            } else {
              absl::Span<const uint8_t> p[1] = {payload};
              auto r = (*cli)->Call(1, "", "", p, {}, absl::Seconds(10));
              if (!r.ok()) std::abort();
            }
          }
        });
      }
      for (auto& t : ts) t.join();
      const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
      std::printf("%8s %6s %10.2f %10.0f\n", std::string(sz).c_str(), dir == 0 ? "get" : "put", n * reqs / sec / 1e9,
                  reqs / sec);
    }
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return 0;
}
