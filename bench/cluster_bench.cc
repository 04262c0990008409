// Block put/get over loopback: kvring (UCX data plane, and gRPC payloads)
// beside redis-server storing the same blocks and a memcpy ceiling, in one
// run. Each request moves one block; T client threads; latency per request.
//   bench/cluster_bench.sh starts the cluster and redis-server and runs this.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvring/client/client.h"
#include "kvring/common/flags.h"
#include "kvring/common/process.h"

using namespace kvring;
using Clock = std::chrono::steady_clock;

namespace {

double Secs(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

// A minimal RESP client: SET and GET of binary values.
class Redis {
 public:
  static std::unique_ptr<Redis> Connect(const std::string& hostport) {
    auto hp = ParseHostPort(hostport);
    if (!hp.ok()) return nullptr;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(hp->port));
    inet_pton(AF_INET, hp->host.c_str(), &a.sin_addr);
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      close(fd);
      return nullptr;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto r = std::make_unique<Redis>();
    r->fd_ = fd;
    return r;
  }
  ~Redis() {
    if (fd_ >= 0) close(fd_);
  }
  bool Set(const std::string& key, const uint8_t* v, size_t n) {
    std::string head = absl::StrCat("*3\r\n$3\r\nSET\r\n$", key.size(), "\r\n", key, "\r\n$", n, "\r\n");
    iovec iov[3] = {{head.data(), head.size()}, {const_cast<uint8_t*>(v), n}, {const_cast<char*>("\r\n"), 2}};
    if (!WriteAll(iov, 3)) return false;
    std::string line;
    return ReadLine(&line) && line == "+OK";
  }
  bool Get(const std::string& key, std::vector<uint8_t>* out) {
    std::string req = absl::StrCat("*2\r\n$3\r\nGET\r\n$", key.size(), "\r\n", key, "\r\n");
    iovec iov[1] = {{req.data(), req.size()}};
    if (!WriteAll(iov, 1)) return false;
    std::string line;
    if (!ReadLine(&line) || line.empty() || line[0] != '$') return false;
    const long n = std::stol(line.substr(1));
    if (n < 0) return false;
    out->resize(static_cast<size_t>(n));
    return ReadN(out->data(), static_cast<size_t>(n)) && ReadLine(&line);
  }

 private:
  bool WriteAll(iovec* iov, int cnt) {
    while (cnt > 0) {
      ssize_t w = writev(fd_, iov, cnt);
      if (w <= 0) return false;
      while (cnt > 0 && static_cast<size_t>(w) >= iov->iov_len) {
        w -= iov->iov_len;
        ++iov;
        --cnt;
      }
      if (cnt > 0) {
        iov->iov_base = static_cast<char*>(iov->iov_base) + w;
        iov->iov_len -= w;
      }
    }
    return true;
  }
  bool Fill() {
    if (pos_ < len_) return true;
    ssize_t r = read(fd_, buf_, sizeof(buf_));
    if (r <= 0) return false;
    pos_ = 0;
    len_ = static_cast<size_t>(r);
    return true;
  }
  bool ReadLine(std::string* line) {
    line->clear();
    for (;;) {
      if (!Fill()) return false;
      char c = buf_[pos_++];
      if (c == '\n') {
        if (!line->empty() && line->back() == '\r') line->pop_back();
        return true;
      }
      line->push_back(c);
    }
  }
  bool ReadN(uint8_t* dst, size_t n) {
    while (n > 0) {
      if (pos_ < len_) {
        const size_t k = std::min(n, len_ - pos_);
        std::memcpy(dst, buf_ + pos_, k);
        pos_ += k;
        dst += k;
        n -= k;
        continue;
      }
      ssize_t r = read(fd_, dst, n);  // large reads straight into the destination
      if (r <= 0) return false;
      dst += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  int fd_ = -1;
  char buf_[1 << 16];
  size_t pos_ = 0, len_ = 0;
};

struct Result {
  double gbps = 0, p50_ms = 0, p99_ms = 0;
  int errors = 0;
};

template <typename Op>
Result Run(int threads, size_t n, size_t bytes, Op&& op) {
  std::atomic<size_t> next{0};
  std::atomic<int> errors{0};
  std::vector<std::vector<double>> lat(threads);
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      for (size_t i; (i = next.fetch_add(1)) < n;) {
        const auto a = Clock::now();
        if (!op(t, i)) ++errors;
        lat[t].push_back(Secs(a));
      }
    });
  }
  for (auto& t : ts) t.join();
  const double sec = Secs(t0);
  std::vector<double> all;
  for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  Result r;
  r.gbps = static_cast<double>(n) * bytes / sec / 1e9;
  r.p50_ms = all[all.size() / 2] * 1e3;
  r.p99_ms = all[std::min(all.size() - 1, all.size() * 99 / 100)] * 1e3;
  r.errors = errors.load();
  return r;
}

void Row(const std::string& size, const std::string& sys, const char* op, const Result& r) {
  std::printf("| %s | %s | %s | %.2f | %.3f | %.3f | %d |\n", size.c_str(), sys.c_str(), op, r.gbps, r.p50_ms, r.p99_ms,
              r.errors);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string coordinator = "127.0.0.1:7400", token_file = "/tmp/kvring-cluster/tenant.token", redis = "127.0.0.1:6390";
  std::string sizes = "256K,512K,1M,2M";
  uint64_t total = 256ull << 20;
  int64_t threads = 4, get_passes = 1;
  std::string systems = "ucx,grpc,redis";
  FlagSet f("cluster_bench", "block put/get GB/s and latency: kvring vs redis-server vs memcpy");
  f.AddString("coordinator", &coordinator, "kvring coordinator");
  f.AddString("token_file", &token_file, "tenant token file");
  f.AddString("redis", &redis, "redis-server host:port");
  f.AddString("sizes", &sizes, "block sizes");
  f.AddBytes("bytes_per_size", &total, "bytes moved per size and system (blocks = this / size)");
  f.AddInt("threads", &threads, "client threads");
  f.AddString("systems", &systems, "which to run: any of ucx (kvring over UCX), grpc (kvring over gRPC), redis");
  f.AddInt("get_passes", &get_passes, "get every block this many times (one row per pass; for profiling)");
  if (auto s = f.Parse(argc, argv); !s.ok() || f.help_requested()) {
    std::printf("%s", f.Usage().c_str());
    return f.help_requested() ? 0 : 2;
  }
  auto tok = ReadSecretFile(token_file);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return 1;
  }
  const std::vector<std::string> run_systems = absl::StrSplit(systems, ',', absl::SkipEmpty());
  auto runs = [&](const char* name) {
    return std::find(run_systems.begin(), run_systems.end(), name) != run_systems.end();
  };
  std::unique_ptr<Client> ucx_client, grpc_client;
  for (bool ucx : {true, false}) {
    if (!runs(ucx ? "ucx" : "grpc")) continue;
    ClientOptions co;
    co.coordinator = coordinator;
    co.token = *tok;
    co.use_ucx = ucx;
    auto c = Client::Connect(co);
    if (!c.ok()) {
      std::fprintf(stderr, "kvring: %s\n", c.status().ToString().c_str());
      return 1;
    }
    (ucx ? ucx_client : grpc_client) = std::move(*c);
  }
  std::vector<std::unique_ptr<Redis>> rc;
  for (int t = 0; t < threads && runs("redis"); ++t) {
    rc.push_back(Redis::Connect(redis));
    if (!rc.back()) {
      std::fprintf(stderr, "cannot connect to redis at %s\n", redis.c_str());
      return 1;
    }
  }
  std::printf("| block | system | op | GB/s | p50 ms | p99 ms | errors |\n|---|---|---|---|---|---|---|\n");
  std::mt19937_64 rng(static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  for (auto sz : absl::StrSplit(sizes, ',')) {
    uint64_t bytes = 0;
    if (!ParseByteSize(std::string(sz), &bytes).ok() || bytes % (64 << 10) != 0) {
      std::fprintf(stderr, "size %s must be a multiple of 64K\n", std::string(sz).c_str());
      return 2;
    }
    const size_t n = std::max<size_t>(16, total / bytes);
    const BlockLayout layout{16, static_cast<uint32_t>(bytes / (64 << 10)), 8, 128, DType::kBF16};
    std::vector<std::vector<uint8_t>> payloads(n);
    std::vector<BlockKey> keys(n);
    for (size_t i = 0; i < n; ++i) {
      keys[i] = BlockKey{rng() | 1, rng()};
      payloads[i].resize(bytes);
      for (size_t j = 0; j < bytes; j += 8) {
        const uint64_t v = rng();
        std::memcpy(&payloads[i][j], &v, 8);
      }
    }
    const std::string label = std::string(sz);
    // memcpy ceiling: the same blocks into a second set of buffers.
    std::vector<std::vector<uint8_t>> dst(n, std::vector<uint8_t>(bytes));
    Row(label, "memcpy", "copy", Run(static_cast<int>(threads), n, bytes, [&](int, size_t i) {
          std::memcpy(dst[i].data(), payloads[i].data(), bytes);
          return true;
        }));
    for (int which = 0; which < 2; ++which) {
      if (!(which == 0 ? ucx_client : grpc_client)) continue;
      Client& c = which == 0 ? *ucx_client : *grpc_client;
      const std::string name = which == 0 ? "kvring (UCX)" : "kvring (gRPC)";
      std::vector<BlockKey> ks(n);
      for (size_t i = 0; i < n; ++i) ks[i] = BlockKey{keys[i].lo ^ (which + 1), keys[i].hi};
      Row(label, name, "put", Run(static_cast<int>(threads), n, bytes, [&](int, size_t i) {
            BlockData b{ks[i], {}, layout, {}, payloads[i], false};
            return c.Put(absl::MakeConstSpan(&b, 1)).ok();
          }));
      std::vector<std::vector<uint8_t>> into(threads, std::vector<uint8_t>(bytes));
      for (int64_t pass = 0; pass < std::max<int64_t>(1, get_passes); ++pass) {
        Row(label, name, "get", Run(static_cast<int>(threads), n, bytes, [&](int t, size_t i) {
              absl::Span<uint8_t> d[1] = {absl::MakeSpan(into[t])};
              auto r = c.GetInto(absl::MakeConstSpan(&ks[i], 1), d);
              return r[0].status.ok() && r[0].meta.payload_bytes == bytes;
            }));
      }
    }
    if (rc.empty()) continue;
    Row(label, "redis-server", "put", Run(static_cast<int>(threads), n, bytes, [&](int t, size_t i) {
          return rc[t]->Set(keys[i].ToHex(), payloads[i].data(), bytes);
        }));
    std::vector<std::vector<uint8_t>> got(threads);
    Row(label, "redis-server", "get", Run(static_cast<int>(threads), n, bytes, [&](int t, size_t i) {
          return rc[t]->Get(keys[i].ToHex(), &got[t]) && got[t].size() == bytes;
        }));
  }
  return 0;
}
