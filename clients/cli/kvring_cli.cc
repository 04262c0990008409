// kvring: command-line client for a kvring cluster.
//
//   kvring [flags] put|get|lookup   store / read back / look up synthetic sequences
//   kvring [flags] stats            per-node table
//   kvring [flags] map              the shard map
//   kvring [flags] bench            put/get throughput and latency
//   kvring [flags] tenant-create|tenant-list|tenant-delete   (admin token)
//   kvring seq-list | --sequence=ID seq-delete | --sequence=ID --keep_tokens=N seq-truncate
//   kvring --source=SRC --sequence=ID --keep_tokens=N seq-fork
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "grpcpp/create_channel.h"
#include "kvring.grpc.pb.h"
#include "kvring/cache/quantize.h"
#include "kvring/client/client.h"
#include "kvring/common/flags.h"
#include "kvring/common/process.h"
#include "kvring/common/status_macros.h"
#include "kvring/protocol/coordinator_channel.h"
#include "kvring/protocol/tls.h"

using namespace kvring;
using Clock = std::chrono::steady_clock;

namespace {

struct Opts {
  std::string coordinator = "127.0.0.1:7000", token, token_file, ns, model = "demo-model", dtype = "bf16";
  bool ucx = true;
  int64_t sequences = 8, tokens = 1024, seed = 1, block_tokens = 16, layers = 4, kv_heads = 8, head_dim = 128;
  int64_t threads = 4, blocks = 512, seconds = 5;
  uint64_t block_bytes = 1 << 20, quota = 0;
  std::string op = "both", name, shared, quantize, kv_encoding, sequence;
  int64_t keep_tokens = -1;
  std::string source;
  absl::Duration rpc_timeout = absl::Seconds(10);
  absl::Duration sequence_ttl = absl::ZeroDuration();
  TlsConfig tls;
};

double Secs(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

// Deterministic payload of a key: pseudo-random floats, all finite (the top
// exponent bit of every 16-bit element is cleared; of every f32 element when
// `f32`), so the blocks can also be quantized.
std::vector<uint8_t> PayloadFor(const BlockKey& k, size_t n, bool f32 = false) {
  std::vector<uint8_t> p(n);
  uint64_t x = k.lo ^ (k.hi << 1);
  const uint64_t mask = f32 ? ~0x4000000040000000ull : ~0x4000400040004000ull;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const uint64_t v = x & mask;
    std::memcpy(&p[i], &v, 8);
  }
  return p;
}

// A block read back equals what `put` stored: bit for bit when plain; within
// the codec's error (relative L2 under 0.1) when the node quantized it.
bool Matches(const GetResult& r, const BlockLayout& layout, const std::vector<uint8_t>& want) {
  if (!r.meta.encoding.quantized()) return r.payload == want;
  std::vector<uint8_t> plain;
  if (!DequantizeBlock(layout, r.meta.encoding, r.payload, &plain).ok() || plain.size() != want.size()) return false;
  double err = 0, ref = 0;
  for (uint64_t e = 0; e < layout.elements(); ++e) {
    const double a = PlainElement(layout, plain.data(), e), b = PlainElement(layout, want.data(), e);
    err += (a - b) * (a - b);
    ref += b * b;
  }
  return err <= 0.01 * ref;
}

BlockLayout LayoutOf(const Opts& o) {
  DType dt = o.dtype == "f32" ? DType::kF32 : o.dtype == "f16" ? DType::kF16 : DType::kBF16;
  return BlockLayout{static_cast<uint32_t>(o.block_tokens), static_cast<uint32_t>(o.layers),
                     static_cast<uint32_t>(o.kv_heads), static_cast<uint32_t>(o.head_dim), dt};
}

// What the bench holds in memory at once (every payload, put then read back).
constexpr uint64_t kMaxBenchBytes = 16ull << 30;

absl::Status InRange(const char* flag, int64_t v, int64_t lo, int64_t hi) {
  if (v >= lo && v <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", v, " is out of range [", lo, ", ", hi, "]"));
}

// Every flag the command uses, checked before anything is built or sent:
// the same layout checks and limits the daemons apply.
absl::Status ValidateOpts(const Opts& o, const std::string& cmd) {
  if (o.sequence_ttl < absl::ZeroDuration()) return absl::InvalidArgumentError("--sequence_ttl must not be negative");
  if (cmd == "seq-delete" || cmd == "seq-truncate" || cmd == "seq-fork") {
    if (o.sequence.empty()) return absl::InvalidArgumentError(cmd + " needs --sequence=ID");
    if (cmd == "seq-truncate" && o.keep_tokens < 0) {
      return absl::InvalidArgumentError("seq-truncate needs --keep_tokens=N (N >= 0)");
    }
    if (cmd == "seq-fork" && (o.source.empty() || o.keep_tokens <= 0)) {
      return absl::InvalidArgumentError("seq-fork needs --source=ID and --keep_tokens=N (N >= 1)");
    }
  }
  if (o.rpc_timeout <= absl::ZeroDuration() || o.rpc_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rpc_timeout=", absl::FormatDuration(o.rpc_timeout), ": must be a positive duration"));
  }
  if (cmd == "put" || cmd == "get" || cmd == "lookup") {
    if (o.dtype != "f32" && o.dtype != "f16" && o.dtype != "bf16") {
      return absl::InvalidArgumentError(absl::StrCat("--dtype=", o.dtype, ": expected f32, f16 or bf16"));
    }
    for (auto [flag, v] : {std::pair<const char*, int64_t>{"block_tokens", o.block_tokens},
                           {"layers", o.layers},
                           {"kv_heads", o.kv_heads},
                           {"head_dim", o.head_dim}}) {
      KVRING_RETURN_IF_ERROR(InRange(flag, v, 1, 512));
    }
    const char* why = nullptr;
    if (!LayoutOf(o).IsValid(&why)) return absl::InvalidArgumentError(absl::StrCat("bad block layout: ", why));
    KVRING_RETURN_IF_ERROR(InRange("sequences", o.sequences, 1, 1 << 20));
    KVRING_RETURN_IF_ERROR(InRange("tokens", o.tokens, o.block_tokens, 1 << 24));
    if (o.sequences * o.tokens > (int64_t{1} << 27)) {
      return absl::InvalidArgumentError(absl::StrCat("--sequences x --tokens = ", o.sequences * o.tokens,
                                                     " tokens; at most 134217728 (they are generated in memory)"));
    }
  }
  if (cmd == "bench") {
    KVRING_RETURN_IF_ERROR(InRange("threads", o.threads, 1, 1024));
    KVRING_RETURN_IF_ERROR(InRange("blocks", o.blocks, 1, 1 << 24));
    if (o.block_bytes < (64u << 10) || o.block_bytes > kMaxBlockBytes || o.block_bytes % (64u << 10) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--block_bytes=", o.block_bytes, " must be a multiple of 64K in [64K, ", kMaxBlockBytes >> 20, "M]"));
    }
    if (static_cast<uint64_t>(o.blocks) * o.block_bytes > kMaxBenchBytes) {
      return absl::InvalidArgumentError(absl::StrCat("--blocks x --block_bytes = ", (o.blocks * o.block_bytes) >> 20,
                                                     " MiB; the bench holds them all in memory: at most ",
                                                     kMaxBenchBytes >> 30, " GiB"));
    }
    if (o.op != "put" && o.op != "get" && o.op != "both") {
      return absl::InvalidArgumentError(absl::StrCat("--op=", o.op, ": expected put, get or both"));
    }
  }
  if (absl::StatusOr<std::optional<KvEncoding>> q = ParseQuantizeOption(o.quantize); !q.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--quantize: ", q.status().message()));
  }
  if (cmd == "tenant-create") {
    if (o.name.empty()) return absl::InvalidArgumentError("tenant-create needs --name");
    KvEncoding e;
    if (absl::Status s = ParseKvEncoding(o.kv_encoding, &e); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--kv_encoding: ", s.message()));
    }
  }
  if (cmd == "tenant-delete" && o.name.empty()) return absl::InvalidArgumentError("tenant-delete needs --name");
  return absl::OkStatus();
}

std::vector<std::vector<uint32_t>> Sequences(const Opts& o) {
  std::mt19937 rng(static_cast<uint32_t>(o.seed));
  std::vector<uint32_t> shared_prefix(static_cast<size_t>(o.tokens / 2));
  for (auto& t : shared_prefix) t = rng() % 128000;
  std::vector<std::vector<uint32_t>> out;
  for (int64_t s = 0; s < o.sequences; ++s) {
    std::vector<uint32_t> t = shared_prefix;
    while (static_cast<int64_t>(t.size()) < o.tokens) t.push_back(rng() % 128000);
    out.push_back(std::move(t));
  }
  return out;
}

void Progress(const char* what, uint64_t done, uint64_t total, Clock::time_point t0, uint64_t bytes) {
  std::fprintf(stderr, "\r%s %llu/%llu blocks, %.1f MB/s   ", what, static_cast<unsigned long long>(done),
               static_cast<unsigned long long>(total), bytes / 1e6 / std::max(1e-9, Secs(t0)));
}

int CmdPutGetLookup(Client& c, const Opts& o, const std::string& cmd) {
  const BlockLayout layout = LayoutOf(o);
  BlockKeyHasher h = c.Hasher(o.model, layout);
  auto seqs = Sequences(o);
  const auto t0 = Clock::now();
  uint64_t total = 0, done = 0, bytes = 0, bad = 0, hit = 0;
  for (auto& s : seqs) total += s.size() / layout.block_tokens;
  for (size_t si = 0; si < seqs.size(); ++si) {
    auto chain = h.Chain(seqs[si]);
    if (cmd == "lookup") {
      auto n = c.LookupPrefix(chain);
      if (!n.ok()) {
        std::fprintf(stderr, "lookup: %s\n", n.status().ToString().c_str());
        return 1;
      }
      std::printf("sequence %zu: %zu of %zu blocks held\n", si, *n, chain.size());
      hit += *n;
      continue;
    }
    if (cmd == "put") {
      std::vector<std::vector<uint8_t>> payloads;
      std::vector<BlockData> blocks;
      for (size_t i = 0; i < chain.size(); ++i)
        payloads.push_back(PayloadFor(chain[i], layout.bytes(), layout.dtype == DType::kF32));
      for (size_t i = 0; i < chain.size(); ++i) {
        blocks.push_back(BlockData{chain[i], i ? chain[i - 1] : BlockKey{}, layout, {}, payloads[i], false});
      }
      auto r = c.Put(blocks);
      if (!r.ok()) {
        std::fprintf(stderr, "\nput: %s\n", r.status().ToString().c_str());
        return 1;
      }
      done += chain.size();
      bytes += r->bytes;
      hit += chain.size() - r->inserted;
    } else {
      auto res = c.Get(chain);
      for (size_t i = 0; i < res.size(); ++i) {
        if (!res[i].status.ok() ||
            !Matches(res[i], layout, PayloadFor(chain[i], layout.bytes(), layout.dtype == DType::kF32)))
          ++bad;
        else
          bytes += res[i].payload.size();
      }
      done += chain.size();
    }
    Progress(cmd.c_str(), done, total, t0, bytes);
  }
  if (cmd == "lookup") {
    std::printf("%llu of %llu blocks held (%.1f%%)\n", static_cast<unsigned long long>(hit),
                static_cast<unsigned long long>(total), 100.0 * hit / std::max<uint64_t>(1, total));
    return 0;
  }
  std::fprintf(stderr, "\n");
  if (cmd == "put") {
    std::printf("put %llu blocks (%llu already held: deduplicated), %.1f MB in %.2f s\n",
                static_cast<unsigned long long>(done), static_cast<unsigned long long>(hit), bytes / 1e6, Secs(t0));
  } else {
    std::printf("got %llu blocks, %llu missing or wrong, %.1f MB in %.2f s\n", static_cast<unsigned long long>(done),
                static_cast<unsigned long long>(bad), bytes / 1e6, Secs(t0));
    if (bad) return 1;
  }
  return 0;
}

int CmdStats(Client& c) {
  auto st = c.Stats();
  std::printf("%-14s %-22s %-5s %8s %8s %8s %8s %9s %9s %9s %10s\n", "node", "address", "state", "blocks", "host",
              "cold", "free", "puts", "hits", "evictions", "cold MB");
  for (const auto& s : st) {
    if (!s.status.ok()) {
      std::printf("%-14s %-22s %-5s  (%s)\n", s.node_id.c_str(), s.address.c_str(), s.state.c_str(),
                  std::string(s.status.message()).c_str());
      continue;
    }
    std::printf("%-14s %-22s %-5s %8llu %8llu %8llu %8llu %9llu %9llu %9llu %10.1f\n", s.node_id.c_str(),
                s.address.c_str(), s.state.c_str(), (unsigned long long)s.blocks, (unsigned long long)s.host_blocks,
                (unsigned long long)s.cold_blocks, (unsigned long long)s.free_pages, (unsigned long long)s.puts,
                (unsigned long long)s.hits, (unsigned long long)s.evictions, s.cold_stored_bytes / 1e6);
  }
  return 0;
}

int CmdBench(Client& c, const Opts& o) {
  // One layer per 64 KiB of bf16 (8 heads x 16 tokens x 128 dims x K|V).
  const uint32_t layers = static_cast<uint32_t>(std::max<uint64_t>(1, o.block_bytes / (64 << 10)));
  const BlockLayout layout{16, layers, 8, 128, DType::kBF16};
  const size_t n = static_cast<size_t>(o.blocks);
  std::vector<BlockKey> keys(n);
  std::mt19937_64 rng(static_cast<uint64_t>(o.seed) * 7919 +
                      static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  for (auto& k : keys) k = BlockKey{rng() | 1, rng()};
  std::vector<std::vector<uint8_t>> payloads(n);
  for (size_t i = 0; i < n; ++i) payloads[i] = PayloadFor(keys[i], layout.bytes(), layout.dtype == DType::kF32);
  std::printf("bench: %zu blocks of %.0f KiB, %lld threads, one block per request\n", n, layout.bytes() / 1024.0,
              static_cast<long long>(o.threads));
  auto run = [&](const char* what, auto&& op) {
    std::atomic<size_t> next{0};
    std::vector<std::vector<double>> lat(static_cast<size_t>(o.threads));
    std::atomic<int> errors{0};
    const auto t0 = Clock::now();
    std::vector<std::thread> ts;
    for (int64_t t = 0; t < o.threads; ++t) {
      ts.emplace_back([&, t] {
        for (size_t i; (i = next.fetch_add(1)) < n;) {
          const auto a = Clock::now();
          if (!op(i)) ++errors;
          lat[t].push_back(Secs(a));
        }
      });
    }
    for (auto& t : ts) t.join();
    const double sec = Secs(t0);
    std::vector<double> all;
    for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
    std::sort(all.begin(), all.end());
    std::printf("%-4s %8.2f GB/s %10.0f blocks/s   p50 %8.3f ms   p99 %8.3f ms   errors %d\n", what,
                n * layout.bytes() / sec / 1e9, n / sec, all[all.size() / 2] * 1e3, all[all.size() * 99 / 100] * 1e3,
                errors.load());
  };
  if (o.op == "put" || o.op == "both") {
    run("put", [&](size_t i) {
      BlockData b{keys[i], {}, layout, {}, payloads[i], false};
      return c.Put(absl::MakeConstSpan(&b, 1)).ok();
    });
  }
  if (o.op == "get" || o.op == "both") {
    run("get", [&](size_t i) {
      auto r = c.Get(absl::MakeConstSpan(&keys[i], 1));
      return r[0].status.ok() && r[0].payload.size() == layout.bytes();
    });
  }
  return 0;
}

int CmdTenant(const Opts& o, const std::string& cmd) {
  auto creds = MakeChannelCredentials(o.tls);
  if (!creds.ok()) {
    std::fprintf(stderr, "%s\n", creds.status().ToString().c_str());
    return 1;
  }
  auto channel = CoordinatorChannel::Create(o.coordinator, *creds);
  if (!channel.ok()) {
    std::fprintf(stderr, "%s\n", channel.status().ToString().c_str());
    return 1;
  }
  auto ctx = [&] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->AddMetadata("authorization", "Bearer " + o.token);
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return c;
  };
  if (cmd == "tenant-create") {
    TenantSpec spec;
    spec.name = o.name;
    spec.max_pinned_bytes = o.quota;
    spec.kv_encoding = o.kv_encoding;
    spec.sequence_ttl_s = static_cast<uint64_t>(absl::ToInt64Seconds(o.sequence_ttl));
    if (!o.shared.empty()) {
      for (auto s : absl::StrSplit(o.shared, ',')) spec.shared_namespaces.push_back(std::string(s));
    }
    auto t = CreateTenant(o.coordinator, o.token, spec, o.tls);
    if (!t.ok()) {
      std::fprintf(stderr, "tenant-create: %s\n", std::string(t.status().message()).c_str());
      return 1;
    }
    std::printf("%s\n", t->token.c_str());
    std::fprintf(stderr, "tenant '%s' (id %u, namespace %s) created; the token above is shown once\n", o.name.c_str(),
                 t->id, t->namespace_name.c_str());
    return 0;
  }
  if (cmd == "tenant-delete") {
    v1::DeleteTenantRequest req;
    req.set_version(1);
    req.set_name(o.name);
    v1::DeleteTenantResponse resp;
    absl::Status s = (*channel)->Call(
        ctx, [&](v1::Coordinator::Stub& stub, grpc::ClientContext* c) { return stub.DeleteTenant(c, req, &resp); });
    if (!s.ok()) {
      std::fprintf(stderr, "tenant-delete: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    return 0;
  }
  v1::ListTenantsRequest req;
  req.set_version(1);
  v1::ListTenantsResponse resp;
  absl::Status s = (*channel)->Call(ctx, [&](v1::Coordinator::Stub& stub, grpc::ClientContext* c) {
    resp.Clear();
    return stub.ListTenants(c, req, &resp);
  });
  if (!s.ok()) {
    std::fprintf(stderr, "tenant-list: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("%-4s %-20s %-28s %-14s %s\n", "id", "name", "namespace", "pinned quota", "shared");
  for (const auto& t : resp.tenants()) {
    std::string sh;
    for (const auto& x : t.shared_namespaces()) sh += x + " ";
    std::printf("%-4u %-20s %-28s %-14llu %s\n", t.id(), t.name().c_str(), t.namespace_().c_str(),
                static_cast<unsigned long long>(t.max_pinned_bytes()), sh.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  kvring::DisableMutexDeadlockDetection();
  Opts o;
  FlagSet f(
      "kvring",
      "client for a kvring cluster\n\nusage: kvring [flags] COMMAND\ncommands: put, get, lookup (synthetic sequences), "
      "stats, map, bench, tenant-create, tenant-list, tenant-delete, seq-list, seq-delete, seq-truncate, "
      "seq-fork");
  f.AddString("coordinator", &o.coordinator, "coordinator host:port, or every coordinator: host:port,...");
  f.AddString("token", &o.token, "tenant token (admin token for tenant-*)");
  f.AddString("token_file", &o.token_file, "file holding the token");
  f.AddString("ns", &o.ns, "namespace (empty: the tenant's own; or shared/<name>)");
  f.AddBool("ucx", &o.ucx, "use the daemons' UCX data plane when they have one");
  f.AddString("model", &o.model, "model id hashed into the keys");
  f.AddInt("sequences", &o.sequences, "put/get/lookup: number of sequences (they share their first half)");
  f.AddInt("tokens", &o.tokens, "put/get/lookup: tokens per sequence");
  f.AddInt("seed", &o.seed, "seed of the synthetic tokens and payloads");
  f.AddInt("block_tokens", &o.block_tokens, "tokens per block");
  f.AddInt("layers", &o.layers, "layers per block");
  f.AddInt("kv_heads", &o.kv_heads, "KV heads");
  f.AddInt("head_dim", &o.head_dim, "head dimension");
  f.AddString("dtype", &o.dtype, "f32, f16 or bf16");
  f.AddInt("threads", &o.threads, "bench: client threads");
  f.AddInt("blocks", &o.blocks, "bench: blocks to put then get");
  f.AddBytes("block_bytes", &o.block_bytes, "bench: block size (multiple of 64K)");
  f.AddString("op", &o.op, "bench: put, get or both");
  f.AddString("sequence", &o.sequence, "seq-delete / seq-truncate / seq-fork: the attention sequence's id");
  f.AddInt(
      "keep_tokens", &o.keep_tokens,
      "seq-truncate: the tokens to keep (the sequence's new length); seq-fork: the source's tokens the fork starts "
      "with");
  f.AddString("source", &o.source, "seq-fork: the sequence the fork starts from");
  f.AddString("name", &o.name, "tenant-*: tenant name");
  f.AddString("shared", &o.shared, "tenant-create: comma-separated shared namespaces (shared/<name>)");
  f.AddString("kv_encoding", &o.kv_encoding,
              "tenant-create: quantize the tenant's blocks at Put (int8|fp8[/per-head|/per-token|/kivi])");
  AddTlsFlags(&f, &o.tls, /*server=*/false);
  f.AddDuration("rpc_timeout", &o.rpc_timeout, "deadline of each call to a node (then the next replica is tried)");
  f.AddString("quantize", &o.quantize,
              "put/bench: have the nodes quantize the blocks (int8|fp8[/...], none; empty: tenant default)");
  f.AddBytes("quota", &o.quota, "tenant-create: pinned-bytes quota (0: unlimited)");
  f.AddDuration("sequence_ttl", &o.sequence_ttl,
                "tenant-create: delete the tenant's attention sequences idle this long (0s: never)");
  std::vector<std::string> pos;
  if (absl::Status s = f.Parse(argc, argv, &pos); !s.ok()) {
    std::fprintf(stderr, "kvring: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (f.help_requested() || pos.empty()) {
    std::printf("%s", f.Usage().c_str());
    return f.help_requested() ? 0 : 2;
  }
  if (!o.token_file.empty()) {
    auto t = ReadSecretFile(o.token_file);
    if (!t.ok()) {
      std::fprintf(stderr, "kvring: %s\n", t.status().ToString().c_str());
      return 2;
    }
    o.token = *t;
  }
  const std::string cmd = pos[0];
  if (absl::Status s = ValidateOpts(o, cmd); !s.ok()) {
    std::fprintf(stderr, "kvring: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (cmd.rfind("tenant-", 0) == 0) return CmdTenant(o, cmd);
  ClientOptions co;
  co.coordinator = o.coordinator;
  co.token = o.token;
  co.ns = o.ns;
  co.use_ucx = o.ucx;
  co.quantize = *ParseQuantizeOption(o.quantize);  // validated above
  co.rpc_timeout = o.rpc_timeout;
  co.tls = o.tls;
  auto c = Client::Connect(co);
  if (!c.ok()) {
    std::fprintf(stderr, "kvring: %s\n", c.status().ToString().c_str());
    return 1;
  }
  if (cmd == "put" || cmd == "get" || cmd == "lookup") return CmdPutGetLookup(**c, o, cmd);
  if (cmd == "stats") return CmdStats(**c);
  if (cmd == "seq-list") {
    absl::StatusOr<std::vector<SequenceListing>> l = (*c)->ListSequences();
    if (!l.ok()) {
      std::fprintf(stderr, "kvring: %s\n", l.status().ToString().c_str());
      return 1;
    }
    std::printf("%-32s %10s %6s %12s %12s %14s %8s  %s\n", "sequence", "tokens", "nodes", "full blocks", "open blocks",
                "bytes (full)", "shared", "placed with");
    for (const SequenceListing& s : *l) {
      std::string placed;
      for (const PlacementSegment& g : s.placement) {
        absl::StrAppend(&placed, placed.empty() ? "" : ", ", "'", g.placed_as, "' to chunk ", g.end_chunk);
      }
      std::printf("%-32s %10llu %6d %12llu %12llu %14llu %8llu  %s\n", s.sequence_id.c_str(),
                  static_cast<unsigned long long>(s.tokens), s.nodes, static_cast<unsigned long long>(s.full_blocks),
                  static_cast<unsigned long long>(s.open_blocks), static_cast<unsigned long long>(s.bytes),
                  static_cast<unsigned long long>(s.shared_blocks), placed.empty() ? "-" : placed.c_str());
    }
    std::printf("%zu sequence(s)\n", l->size());
    return 0;
  }
  if (cmd == "seq-fork") {
    absl::StatusOr<ForkReport> r = (*c)->ForkSequence(o.source, o.sequence, static_cast<uint64_t>(o.keep_tokens));
    if (!r.ok()) {
      std::fprintf(stderr, "kvring: %s\n", r.status().ToString().c_str());
      return 1;
    }
    std::printf(
        "forked '%s' from the first %lld tokens of '%s': %llu chunks placed with the source's, %llu full "
        "blocks shared, %llu partly filled blocks copied (replicas count), on %d nodes\n",
        o.sequence.c_str(), static_cast<long long>(o.keep_tokens), o.source.c_str(),
        static_cast<unsigned long long>(r->shared_chunks), static_cast<unsigned long long>(r->blocks_shared),
        static_cast<unsigned long long>(r->blocks_copied), r->nodes_holding);
    return 0;
  }
  if (cmd == "seq-delete" || cmd == "seq-truncate") {
    absl::StatusOr<SequenceChangeReport> r =
        cmd == "seq-delete" ? (*c)->DeleteSequence(o.sequence)
                            : (*c)->TruncateSequence(o.sequence, static_cast<uint64_t>(o.keep_tokens));
    if (!r.ok()) {
      std::fprintf(stderr, "kvring: %s\n", r.status().ToString().c_str());
      return 1;
    }
    std::printf("%s '%s': held on %d nodes, %llu full blocks erased, %llu open blocks dropped\n",
                cmd == "seq-delete" ? "deleted" : "truncated", o.sequence.c_str(), r->nodes_holding,
                static_cast<unsigned long long>(r->blocks_erased),
                static_cast<unsigned long long>(r->open_blocks_dropped));
    return 0;
  }
  if (cmd == "bench") return CmdBench(**c, o);
  if (cmd == "map") {
    std::printf("shard map version %llu\n", static_cast<unsigned long long>((*c)->map_version()));
    return CmdStats(**c);
  }
  std::fprintf(stderr, "kvring: unknown command '%s' (see --help)\n", cmd.c_str());
  return 2;
}
