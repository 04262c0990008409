// What refusing non-finite appended K/V costs the daemon (kvringd
// --check_append_values, on by default): FirstNonFinite over a step's
// appended bytes, beside a memcpy of the same bytes (the peer: the node copies
// those bytes into the open block anyway). Sizes: one decode token of
// Llama-3-8B heads (8 KV heads x 128 x bf16, K or V: 2 KiB), a decode batch of
// 64, a 2048-token prefill chunk.
//   build/bench/append_check_bench
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "kvring/control/request_validation.h"

namespace kvring {
namespace {

std::vector<uint8_t> Finite(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; i += 2) {
    v[i] = static_cast<uint8_t>(i * 7);
    v[i + 1] = 0x3f;  // bf16 exponent well below all-ones
  }
  return v;
}

void BM_FirstNonFiniteBf16(benchmark::State& st) {
  const std::vector<uint8_t> v = Finite(static_cast<size_t>(st.range(0)));
  for (auto _ : st) benchmark::DoNotOptimize(FirstNonFinite(v, DType::kBF16));
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * st.range(0));
}

void BM_MemcpyPeer(benchmark::State& st) {
  const std::vector<uint8_t> v = Finite(static_cast<size_t>(st.range(0)));
  std::vector<uint8_t> d(v.size());
  for (auto _ : st) {
    std::memcpy(d.data(), v.data(), v.size());
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * st.range(0));
}

BENCHMARK(BM_FirstNonFiniteBf16)->Arg(2 << 10)->Arg(128 << 10)->Arg(4 << 20);
BENCHMARK(BM_MemcpyPeer)->Arg(2 << 10)->Arg(128 << 10)->Arg(4 << 20);

}  // namespace
}  // namespace kvring

BENCHMARK_MAIN();
