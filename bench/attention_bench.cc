// CPU PartialAttention throughput, beside the machine's own ceilings measured
// in the same run:
//   decode (memory-bound):  KV bytes read / time   vs  a streaming read of the same bytes
//   prefill (compute-bound): GFLOP/s               vs  an FMA loop's GFLOP/s on the same threads
// and the cost of MergePartials as a share of a decode step.
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_format.h"
#include "kvring/attention/merge.h"
#include "kvring/attention/partial_attention.h"
#include "kvring/common/flags.h"
#include "kvring/common/thread_pool.h"
#include "kvring/layout/float_convert.h"

using namespace kvring;
using Clock = std::chrono::steady_clock;

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename Fn>
double TimeMedian(int reps, Fn&& fn) {
  fn();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  return Median(t);
}

struct Seq {
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<KvBlockRef> refs;
};

Seq MakeSeq(const BlockLayout& L, int64_t tokens, std::mt19937& rng) {
  Seq s;
  std::normal_distribution<float> nd;
  for (int64_t p = 0; p < tokens; p += L.block_tokens) {
    s.blocks.emplace_back(L.bytes());
    auto* h = reinterpret_cast<uint16_t*>(s.blocks.back().data());
    for (uint64_t i = 0; i < L.elements(); ++i) h[i] = FloatToBf16(nd(rng));
    s.refs.push_back(KvBlockRef{s.blocks.back().data(), p, L.block_tokens});
  }
  return s;
}

// Streaming read of `bytes` spread over the same blocks (the decode ceiling).
double ReadBandwidth(const Seq& s, size_t bytes_per_block, ThreadPool* pool) {
  std::vector<double> sums(s.refs.size());
  const double sec = TimeMedian(5, [&] {
    ParallelForOrInline(pool, s.refs.size(), [&](size_t i) {
      const uint64_t* p = reinterpret_cast<const uint64_t*>(s.refs[i].data);
      uint64_t acc[4] = {0, 0, 0, 0};
      for (size_t j = 0; j + 4 <= bytes_per_block / 8; j += 4) {
        acc[0] ^= p[j];
        acc[1] ^= p[j + 1];
        acc[2] ^= p[j + 2];
        acc[3] ^= p[j + 3];
      }
      sums[i] = static_cast<double>(acc[0] ^ acc[1] ^ acc[2] ^ acc[3]);
    });
  });
  return static_cast<double>(bytes_per_block) * s.refs.size() / sec;
}

// Peak fp32 FMA rate: 8 independent 8-lane accumulators per thread, compiled
// like the kernel (an x86-64-v3 clone chosen at run time).
typedef float V8 __attribute__((vector_size(32)));
__attribute__((target_clones("arch=x86-64-v3", "default"), noinline)) void FmaLoop(float* out, int iters) {
  V8 a[8], m = {0.999999f, 0.999999f, 0.999999f, 0.999999f, 0.999999f, 0.999999f, 0.999999f, 0.999999f};
  V8 c = m * 1e-6f;
  for (int i = 0; i < 8; ++i) a[i] = m * static_cast<float>(i);
  for (int it = 0; it < iters; ++it) {
    for (int i = 0; i < 8; ++i) a[i] = a[i] * m + c;
  }
  for (int i = 0; i < 8; ++i) std::memcpy(out + 8 * i, &a[i], 32);
}

double FmaPeak(ThreadPool* pool, size_t threads) {
  std::vector<float> out(threads * 64);
  const int iters = 4000000;
  const double sec = TimeMedian(
      3, [&] { ParallelForOrInline(pool, threads, [&](size_t t) { FmaLoop(out.data() + 64 * t, iters); }); });
  return 2.0 * 64 * iters * threads / sec;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t threads = 0;
  int64_t reps = 5;
  FlagSet flags("attention_bench", "CPU PartialAttention throughput vs measured memory and FMA ceilings");
  flags.AddInt("threads", &threads, "threads (0: all cores)");
  flags.AddInt("reps", &reps, "timed repetitions per case (median reported)");
  if (auto s = flags.Parse(argc, argv); !s.ok() || flags.help_requested()) {
    std::printf("%s", flags.help_requested() ? flags.Usage().c_str() : (std::string(s.message()) + "\n").c_str());
    return flags.help_requested() ? 0 : 2;
  }
  const size_t nthreads =
      threads > 0 ? static_cast<size_t>(threads) : std::max(1u, std::thread::hardware_concurrency());
  ThreadPool pool(nthreads - 1);
  std::mt19937 rng(1);
  // Llama-3-8B head shapes, one layer per block (attention is per layer).
  const BlockLayout L{16, 1, 8, 128, DType::kBF16};
  const uint32_t q_heads = 32;
  const double fma = FmaPeak(&pool, nthreads);
  std::printf("CPU attention, %zu threads; FMA loop peak %.1f GFLOP/s\n\n", nthreads, fma / 1e9);

  std::printf("decode (1 query token/sequence, bf16 KV, 32 q heads / 8 kv heads, d=128)\n");
  std::printf("%8s %6s %10s %10s %12s %12s %8s %10s\n", "kv_len", "batch", "time_ms", "GFLOP/s", "KV GB/s", "read GB/s",
              "ratio", "merge %");
  for (int64_t kv_len : {4096, 16384, 32768}) {
    for (uint32_t batch : {1u, 8u}) {
      std::vector<Seq> seqs;
      std::vector<KvBlockRef> refs;
      std::vector<uint32_t> begin{0};
      for (uint32_t b = 0; b < batch; ++b) {
        seqs.push_back(MakeSeq(L, kv_len, rng));
        refs.insert(refs.end(), seqs.back().refs.begin(), seqs.back().refs.end());
        begin.push_back(static_cast<uint32_t>(refs.size()));
      }
      std::vector<uint16_t> q(size_t{batch} * q_heads * 128);
      for (auto& x : q) x = FloatToBf16(std::normal_distribution<float>()(rng));
      std::vector<int64_t> pos(batch, kv_len - 1);
      std::vector<uint32_t> ids(batch);
      std::iota(ids.begin(), ids.end(), 0);
      QueryTensor qt{q.data(), DType::kBF16, batch, q_heads, 128, pos.data(), ids.data()};
      PagedKv kv{L, {}, refs, begin};
      PartialResult out(batch, q_heads, 128);
      const double sec =
          TimeMedian(static_cast<int>(reps), [&] { (void)PartialAttention({}, qt, kv, out.view(), &pool); });
      const double flops = AttentionFlops({}, qt, kv);
      const double kv_bytes = static_cast<double>(refs.size()) * L.bytes();
      Seq all;
      all.refs = refs;
      const double read_bw = ReadBandwidth(all, L.bytes(), &pool);
      // Merge of 8 shard partials for this batch, vs the step.
      std::vector<PartialResult> parts(8, out);
      std::vector<ConstPartial> views;
      for (auto& p : parts) views.push_back(p.cview());
      PartialResult merged(batch, q_heads, 128);
      const double msec = TimeMedian(static_cast<int>(reps) * 4,
                                     [&] { (void)MergePartials(views, batch, q_heads, 128, merged.view()); });
      std::printf("%8lld %6u %10.3f %10.2f %12.2f %12.2f %8.2f %9.2f%%\n", static_cast<long long>(kv_len), batch,
                  sec * 1e3, flops / sec / 1e9, kv_bytes / sec / 1e9, read_bw / 1e9, (kv_bytes / sec) / read_bw,
                  100.0 * msec / (sec + msec));
    }
  }

  std::printf("\nprefill (causal chunk of new tokens over cached context, bf16, 32/8 heads, d=128)\n");
  std::printf("%8s %8s %10s %10s %10s\n", "context", "chunk", "time_ms", "GFLOP/s", "of FMA");
  for (int64_t ctx : {2048, 8192}) {
    const uint32_t chunk = 256;
    Seq s = MakeSeq(L, ctx + chunk, rng);
    std::vector<uint16_t> q(size_t{chunk} * q_heads * 128);
    for (auto& x : q) x = FloatToBf16(std::normal_distribution<float>()(rng));
    std::vector<int64_t> pos(chunk);
    std::iota(pos.begin(), pos.end(), ctx);
    QueryTensor qt{q.data(), DType::kBF16, chunk, q_heads, 128, pos.data(), nullptr};
    std::vector<uint32_t> begin{0, static_cast<uint32_t>(s.refs.size())};
    PagedKv kv{L, {}, s.refs, begin};
    PartialResult out(chunk, q_heads, 128);
    const double sec =
        TimeMedian(static_cast<int>(reps), [&] { (void)PartialAttention({}, qt, kv, out.view(), &pool); });
    const double flops = AttentionFlops({}, qt, kv);
    std::printf("%8lld %8u %10.2f %10.2f %9.1f%%\n", static_cast<long long>(ctx), chunk, sec * 1e3, flops / sec / 1e9,
                100.0 * flops / sec / fma);
  }
  return 0;
}
