// Block store micro-benchmarks, each beside its peer in the same run:
//   put/get of 256 KiB blocks vs a plain memcpy of the same bytes;
//   LookupPrefix over an 8K-block chain (128K tokens at 16 tokens a block)
//   vs the linear per-block probe that prefix caches commonly do.
// Latency benchmarks time every call and report p50/p99 counters.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <vector>

#include "benchmark/benchmark.h"
#include "kvring/cache/block_index.h"
#include "kvring/cache/block_key.h"
#include "kvring/cache/block_store.h"

namespace kvring {
namespace {

constexpr NamespaceId kNs = 1;

BlockLayout LayoutFor(size_t bytes) {
  // layers x 2 x 8 heads x 16 tokens x 128 dim x bf16 = layers * 64 KiB
  return BlockLayout{16, static_cast<uint32_t>(bytes / (64 << 10)), 8, 128, DType::kBF16};
}

std::vector<BlockKey> MakeChain(size_t n) {
  BlockKeyHasher h("bench-model", "bench-ns", BlockLayout{16, 32, 8, 128, DType::kBF16});
  std::vector<uint32_t> tokens(n * 16);
  std::iota(tokens.begin(), tokens.end(), 1000);
  return h.Chain(tokens);
}

void ReportPercentiles(benchmark::State& state, std::vector<double>& ns) {
  std::sort(ns.begin(), ns.end());
  if (ns.empty()) return;
  state.counters["p50_us"] = ns[ns.size() / 2] / 1e3;
  state.counters["p99_us"] = ns[ns.size() * 99 / 100] / 1e3;
}

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = state.range(0);
  std::vector<uint8_t> src(bytes, 1), dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_Memcpy)->Arg(256 << 10)->Arg(2 << 20);

// Put of fresh keys into a store at steady state (evicting: LRU, no cold tier).
void BM_StorePut(benchmark::State& state) {
  const size_t bytes = state.range(0);
  BlockStoreOptions o;
  o.page_bytes = bytes;
  o.num_pages = (512ull << 20) / bytes;
  auto store = std::move(BlockStore::Create(o).value());
  std::vector<uint8_t> payload(bytes, 7);
  PutArgs a;
  a.ns = kNs;
  a.meta.layout = LayoutFor(bytes);
  uint64_t i = 1;
  for (auto _ : state) {
    a.key = BlockKey{i, i * 31};
    ++i;
    auto r = store->Put(a, payload);
    if (!r.ok()) state.SkipWithError(r.status().ToString().c_str());
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_StorePut)->Arg(256 << 10)->Arg(2 << 20);

void BM_StoreRead(benchmark::State& state) {
  const size_t bytes = state.range(0);
  BlockStoreOptions o;
  o.page_bytes = bytes;
  o.num_pages = (512ull << 20) / bytes;
  auto store = std::move(BlockStore::Create(o).value());
  std::vector<uint8_t> payload(bytes, 7), out(bytes);
  PutArgs a;
  a.ns = kNs;
  a.meta.layout = LayoutFor(bytes);
  const uint64_t n = o.num_pages;
  for (uint64_t i = 1; i <= n; ++i) {
    a.key = BlockKey{i, i * 31};
    (void)store->Put(a, payload);
  }
  uint64_t i = 0;
  for (auto _ : state) {
    const uint64_t k = 1 + (i++ % n);
    absl::Status s = store->Read(kNs, BlockKey{k, k * 31}, absl::MakeSpan(out), nullptr);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_StoreRead)->Arg(256 << 10)->Arg(2 << 20);

// LookupPrefix on a fully held 8K-block chain, through the store's lock.
void BM_LookupPrefix(benchmark::State& state) {
  const size_t n = state.range(0);
  const bool linear = state.range(1) != 0;
  BlockIndex index;
  const auto chain = MakeChain(n);
  for (size_t i = 0; i < n; ++i) (void)index.Insert(ScopedKey{kNs, chain[i]}, i ? chain[i - 1] : BlockKey{}, {});
  std::vector<double> ns;
  ns.reserve(1 << 20);
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    size_t hit = linear ? index.LookupPrefixLinear(kNs, chain) : index.LookupPrefix(kNs, chain);
    const auto t1 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(hit);
    if (hit != n) state.SkipWithError("wrong prefix length");
    if (ns.size() < ns.capacity()) ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
  }
  ReportPercentiles(state, ns);
}
BENCHMARK(BM_LookupPrefix)->ArgNames({"blocks", "linear"})->Args({8192, 0})->Args({8192, 1})->Args({1024, 0});

// The same through BlockStore (adds its mutex), with a miss half-way.
void BM_StoreLookupPrefix(benchmark::State& state) {
  const size_t n = state.range(0);
  BlockStoreOptions o;
  o.page_bytes = 64;
  o.num_pages = n;
  auto store = std::move(BlockStore::Create(o).value());
  const auto chain = MakeChain(n);
  std::vector<uint8_t> payload(64);
  PutArgs a;
  a.ns = kNs;
  a.meta.layout = BlockLayout{1, 1, 1, 8, DType::kF32};
  for (size_t i = 0; i < n; ++i) {
    a.key = chain[i];
    a.parent = i ? chain[i - 1] : BlockKey{};
    (void)store->Put(a, payload);
  }
  const bool with_miss = state.range(1) != 0;
  if (with_miss) (void)store->Erase(kNs, chain[n / 2]);
  std::vector<double> ns;
  ns.reserve(1 << 20);
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    size_t hit = store->LookupPrefix(kNs, chain);
    const auto t1 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(hit);
    if (hit != (with_miss ? n / 2 : n)) state.SkipWithError("wrong prefix length");
    if (ns.size() < ns.capacity()) ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
  }
  ReportPercentiles(state, ns);
}
BENCHMARK(BM_StoreLookupPrefix)->ArgNames({"blocks", "miss_at_half"})->Args({8192, 0})->Args({8192, 1});

void BM_ChainKeys(benchmark::State& state) {
  BlockKeyHasher h("bench-model", "bench-ns", BlockLayout{16, 32, 8, 128, DType::kBF16});
  std::vector<uint32_t> tokens(state.range(0));
  std::iota(tokens.begin(), tokens.end(), 0);
  for (auto _ : state) benchmark::DoNotOptimize(h.Chain(tokens));
  state.SetItemsProcessed(state.iterations() * tokens.size());
  state.counters["tokens"] = static_cast<double>(tokens.size());
}
BENCHMARK(BM_ChainKeys)->Arg(128 << 10);

}  // namespace
}  // namespace kvring

BENCHMARK_MAIN();
