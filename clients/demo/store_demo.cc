// kvring-store-demo: a single-process walk through the block store.
// Stores a few chat sessions that share a system prompt, shows prefix reuse
// (blocks found instead of recomputed) and eviction once the store is full,
// and prints a table. No cluster needed.
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_format.h"
#include "kvring/cache/block_key.h"
#include "kvring/cache/block_store.h"
#include "kvring/common/flags.h"

using namespace kvring;

int main(int argc, char** argv) {
  int64_t pages = 96;
  int64_t sessions = 8;
  int64_t prompt_tokens = 512;
  std::string policy = "lru";
  FlagSet flags("kvring-store-demo", "store chat sessions in a local block store and show prefix reuse and eviction");
  flags.AddInt("pages", &pages, "host-tier capacity in blocks");
  flags.AddInt("sessions", &sessions, "number of sessions to store");
  flags.AddInt("system_prompt_tokens", &prompt_tokens, "tokens of the shared system prompt");
  flags.AddString("eviction_policy", &policy, "eviction policy");
  if (absl::Status s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::printf("%s", flags.Usage().c_str());
    return 0;
  }
  const BlockLayout layout{16, 4, 8, 128, DType::kBF16};  // 4 layers: 256 KiB blocks
  BlockStoreOptions o;
  o.page_bytes = layout.bytes();
  o.num_pages = static_cast<size_t>(pages);
  o.eviction_policy = policy;
  auto store_or = BlockStore::Create(o);
  if (!store_or.ok()) {
    std::fprintf(stderr, "store: %s\n", store_or.status().ToString().c_str());
    return 1;
  }
  BlockStore& store = **store_or;
  BlockKeyHasher keys("demo-llama-3-8b", "tenant-demo", layout);
  std::mt19937 rng(42);
  std::vector<uint32_t> system_prompt(static_cast<size_t>(prompt_tokens));
  for (auto& t : system_prompt) t = rng() % 128000;
  std::vector<uint8_t> payload(layout.bytes());

  std::printf(
      "kvring store demo: %lld pages of %s, policy %s, block = %u tokens x %u layers x %u kv heads x %u dims (%s)\n\n",
      static_cast<long long>(pages), absl::StrFormat("%.0f KiB", layout.bytes() / 1024.0).c_str(), policy.c_str(),
      layout.block_tokens, layout.layers, layout.kv_heads, layout.head_dim, DTypeName(layout.dtype));
  std::printf("%-10s %7s %7s %9s %9s %10s %10s %9s\n", "session", "tokens", "blocks", "reused", "stored", "evicted",
              "resident", "hit %");
  uint64_t total_blocks = 0, total_reused = 0;
  std::vector<std::vector<uint32_t>> all;
  for (int64_t s = 0; s < sessions; ++s) {
    std::vector<uint32_t> tokens = system_prompt;
    const size_t user = 128 + rng() % 384;
    for (size_t i = 0; i < user; ++i) tokens.push_back(rng() % 128000);
    all.push_back(tokens);
  }
  // Revisit the first two sessions at the end (a second turn): by then some
  // of their blocks have been evicted.
  std::vector<int> order;
  for (int64_t s = 0; s < sessions; ++s) order.push_back(static_cast<int>(s));
  order.push_back(0);
  order.push_back(1);
  for (int idx : order) {
    const auto& tokens = all[idx];
    const std::vector<BlockKey> chain = keys.Chain(tokens);
    const uint64_t before = store.stats().evictions;
    const size_t hit = store.LookupPrefix(keys.namespace_id(), chain);
    // Load the hit blocks, as an engine would before attending over them.
    for (size_t i = 0; i < hit; ++i) {
      auto b = store.Acquire(keys.namespace_id(), chain[i]);
      if (!b.ok()) {
        std::fprintf(stderr, "get: %s\n", b.status().ToString().c_str());
        return 1;
      }
    }
    size_t stored = 0;
    for (size_t i = hit; i < chain.size(); ++i) {
      for (size_t j = 0; j < payload.size(); j += 4096) payload[j] = static_cast<uint8_t>(chain[i].lo >> (j % 64));
      PutArgs a;
      a.ns = keys.namespace_id();
      a.key = chain[i];
      a.parent = i ? chain[i - 1] : BlockKey{};
      a.meta.layout = layout;
      auto r = store.Put(a, payload);
      if (!r.ok()) {
        std::fprintf(stderr, "put: %s\n", r.status().ToString().c_str());
        return 1;
      }
      stored += r->inserted;
    }
    const BlockStoreStats st = store.stats();
    total_blocks += chain.size();
    total_reused += hit;
    std::printf("%-10s %7zu %7zu %9zu %9zu %10llu %10llu %8.1f%%\n", absl::StrFormat("s%d", idx).c_str(), tokens.size(),
                chain.size(), hit, stored, static_cast<unsigned long long>(st.evictions - before),
                static_cast<unsigned long long>(st.host_blocks), 100.0 * hit / chain.size());
  }
  const BlockStoreStats st = store.stats();
  std::printf("\n%llu of %llu blocks reused (%.1f%% prefill saved); %llu puts, %llu evictions, %llu free pages\n",
              static_cast<unsigned long long>(total_reused), static_cast<unsigned long long>(total_blocks),
              100.0 * total_reused / total_blocks, static_cast<unsigned long long>(st.puts),
              static_cast<unsigned long long>(st.evictions), static_cast<unsigned long long>(st.free_pages));
  return 0;
}
