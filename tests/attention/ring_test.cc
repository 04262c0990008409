// The rings against the dense float64 reference: N = 1..8 ranks on the
// loopback transport, one thread per rank.
#include "kvring/attention/ring/ring.h"

#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "attention_test_util.h"
#include "gtest/gtest.h"
#include "kvring/transport/loopback_transport.h"

namespace kvring {
namespace {

using testing::DenseOf;
using testing::ExpectClose;
using testing::RandomQueries;
using testing::RandomSequence;

constexpr double kTol = 2e-5;

void RunRanks(int n, const std::function<void(int, Transport&)>& fn) {
  auto group = LoopbackTransport::CreateGroup(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back([&, r] { fn(r, *group[r]); });
  for (auto& t : ts) t.join();
}

enum class Algo { kPassKv, kPassQRing, kPassQAll };
const char* Name(Algo a) {
  return a == Algo::kPassKv ? "pass-KV" : a == Algo::kPassQRing ? "pass-Q ring" : "pass-Q all-to-all";
}

struct Placement {
  std::vector<std::vector<KvBlockRef>> kv;  // per rank
  std::vector<std::vector<int64_t>> q_pos;  // per rank: positions of its queries
};

// Prefill: every rank's queries are the tokens of the blocks it holds (plus
// the context before them is elsewhere), each rank's KV its blocks.
Placement ByOwner(const testing::SeqKv& seq, int n, const std::function<int(uint64_t)>& owner, int64_t q_from = 0) {
  Placement p;
  p.kv.resize(n);
  p.q_pos.resize(n);
  for (size_t b = 0; b < seq.refs.size(); ++b) {
    const int r = owner(b);
    p.kv[r].push_back(seq.refs[b]);
    for (uint32_t t = 0; t < seq.refs[b].num_tokens; ++t) {
      const int64_t pos = seq.refs[b].start_pos + t;
      if (pos >= q_from) p.q_pos[r].push_back(pos);
    }
  }
  return p;
}

void CheckAlgo(Algo algo, const testing::SeqKv& seq, const Placement& pl, uint32_t q_heads, bool causal, uint64_t seed,
               const std::string& what) {
  const int n = static_cast<int>(pl.kv.size());
  const BlockLayout& L = seq.layout;
  AttentionOptions o;
  o.causal = causal;
  const auto dense = DenseOf(L, seq.refs, 0);
  std::vector<testing::Queries> qs;
  std::mt19937_64 rng(seed);
  for (int r = 0; r < n; ++r)
    qs.push_back(
        RandomQueries(DType::kBF16, static_cast<uint32_t>(pl.q_pos[r].size()), q_heads, L.head_dim, pl.q_pos[r], rng));
  std::vector<PartialResult> outs(n);
  std::vector<absl::Status> st(n);
  std::vector<RingStats> stats(n);
  RunRanks(n, [&](int r, Transport& t) {
    outs[r] = PartialResult(qs[r].view.num_rows, q_heads, L.head_dim);
    testing::Poison(outs[r]);
    std::vector<uint32_t> begin{0, static_cast<uint32_t>(pl.kv[r].size())};
    PagedKv kv{L, {}, pl.kv[r], begin};
    RingOptions ro;
    ro.call_id = 42;
    ro.timeout = absl::Seconds(20);
    switch (algo) {
      case Algo::kPassKv:
        st[r] = RingPassKv(t, o, qs[r].view, kv, outs[r].view(), ro, &stats[r]);
        break;
      case Algo::kPassQRing:
        st[r] = RingPassQ(t, o, qs[r].view, kv, outs[r].view(), ro, PassQMode::kRing, &stats[r]);
        break;
      case Algo::kPassQAll:
        st[r] = RingPassQ(t, o, qs[r].view, kv, outs[r].view(), ro, PassQMode::kAllToAll, &stats[r]);
        break;
    }
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << what << " rank " << r << ": " << st[r];
    if (qs[r].view.num_rows == 0) continue;
    auto ref = reference::Attention(qs[r].values, qs[r].positions, q_heads, dense, o);
    ExpectClose(outs[r].out.data(), outs[r].lse.data(), ref, kTol, absl::StrCat(what, " ", Name(algo), " rank ", r));
    if (n > 1) {
      EXPECT_GT(stats[r].bytes_sent, 0u);
    }
  }
}

TEST(RingTest, CausalPrefillWithLoadBalancedLayoutMatchesReference) {
  for (int n = 1; n <= 8; ++n) {
    std::mt19937_64 rng(100 + n);
    const uint32_t ratio = n % 3 == 0 ? 1 : n % 3 == 1 ? 4 : 8;
    const BlockLayout L{16, 1, 2, n % 2 ? 64u : 128u, DType::kBF16};
    auto seq = RandomSequence(L, 16 * 2 * n * 2 + 7, rng);  // 2N chunks of 2 blocks, plus a partial block
    const uint64_t nb = seq.refs.size();
    auto pl = ByOwner(seq, n, [&](uint64_t b) { return LoadBalancedOwner(nb, n, b); });
    for (Algo a : {Algo::kPassKv, Algo::kPassQRing, Algo::kPassQAll}) {
      CheckAlgo(a, seq, pl, 2 * ratio, true, rng(), absl::StrCat("N=", n));
    }
  }
}

TEST(RingTest, UnevenShardsAndNonCausalMatchReference) {
  for (int n : {2, 3, 5, 8}) {
    std::mt19937_64 rng(200 + n);
    const BlockLayout L{64, 1, 1, 64, DType::kBF16};
    auto seq = RandomSequence(L, 64 * 9 + 30, rng);
    // Skewed placement: rank 0 gets half the blocks, some ranks none.
    auto pl = ByOwner(seq, n,
                      [&](uint64_t b) { return b % 2 == 0 ? 0 : static_cast<int>(1 + (b / 2) % std::max(1, n / 2)); });
    for (Algo a : {Algo::kPassKv, Algo::kPassQRing, Algo::kPassQAll}) {
      CheckAlgo(a, seq, pl, 8, false, rng(), absl::StrCat("uneven N=", n));
      CheckAlgo(a, seq, pl, 8, true, rng(), absl::StrCat("uneven causal N=", n));
    }
  }
}

// Persistent-KV prefill: the first P tokens are cached (spread contiguously
// over the shards), the next T tokens are new; queries are the new tokens.
TEST(RingTest, ChunkedPrefillWithPartialPrefixHitMatchesReference) {
  for (int n : {1, 2, 4, 7}) {
    std::mt19937_64 rng(300 + n);
    const BlockLayout L{16, 1, 8, 128, DType::kBF16};
    const int64_t P = 16 * 20, T = 16 * 4 + 5;
    auto seq = RandomSequence(L, P + T, rng);
    const uint64_t cached_blocks = P / 16, nb = seq.refs.size();
    auto pl = ByOwner(
        seq, n,
        [&](uint64_t b) {
          return b < cached_blocks ? ContiguousOwner(cached_blocks, n, b)
                                   : LoadBalancedOwner(nb - cached_blocks, n, b - cached_blocks);
        },
        /*q_from=*/P);
    EXPECT_FALSE(PreferPassKv(T, P, 32, 8));  // T/(T+P) ~ 0.18 < 2*8/32: pass-Q
    for (Algo a : {Algo::kPassQRing, Algo::kPassQAll, Algo::kPassKv}) {
      CheckAlgo(a, seq, pl, 32, true, rng(), absl::StrCat("chunked N=", n));
    }
  }
  EXPECT_TRUE(PreferPassKv(1000, 0, 32, 8));
}

TEST(RingTest, LayoutHelpersCoverEveryBlockOnce) {
  for (int n = 1; n <= 8; ++n) {
    for (uint64_t nb : {1ull, 5ull, 16ull, 100ull}) {
      std::vector<int> count(n, 0);
      for (uint64_t b = 0; b < nb; ++b) {
        const int o = LoadBalancedOwner(nb, n, b);
        ASSERT_GE(o, 0);
        ASSERT_LT(o, n);
        ++count[o];
        ASSERT_LT(ContiguousOwner(nb, n, b), n);
        if (b > 0) {
          ASSERT_GE(ContiguousOwner(nb, n, b), ContiguousOwner(nb, n, b - 1));
        }
      }
      if (nb == 100) {
        // 2N chunks: shard i holds chunk i and chunk 2N-1-i.
        EXPECT_EQ(LoadBalancedOwner(nb, n, 0), 0);
        EXPECT_EQ(LoadBalancedOwner(nb, n, nb - 1), 0);
        const int mx = *std::max_element(count.begin(), count.end());
        const int mn = *std::min_element(count.begin(), count.end());
        EXPECT_LE(mx - mn, 2) << "n=" << n;
      }
    }
  }
}

// Decode: a batch of sequences whose KV is spread over the shards; each step
// appends the new token's KV to the tail owner and attends over everything.
TEST(RingTest, DecodeBatchAppendsToTailOwnersAndMatchesReference) {
  for (int n : {1, 2, 3, 5}) {
    std::mt19937_64 rng(400 + n);
    const BlockLayout L{16, 2, 2, 64, DType::kBF16};
    const uint32_t B = 4, q_heads = 8;
    std::vector<testing::SeqKv> seqs;
    for (uint32_t b = 0; b < B; ++b) seqs.push_back(RandomSequence(L, 16 * (2 + b * 3), rng));
    // The extra rank n holds the batch and no KV (an engine).
    const int world = n + 1, caller = n;
    std::vector<int> tail_owner(B);
    std::vector<std::unique_ptr<KvShard>> shards;
    for (int r = 0; r < world; ++r) shards.push_back(std::make_unique<KvShard>(L, KvEncoding{}, B));
    for (uint32_t b = 0; b < B; ++b) {
      const uint64_t nb = seqs[b].refs.size();
      for (uint64_t i = 0; i < nb; ++i)
        ASSERT_TRUE(shards[ContiguousOwner(nb, n, i)]->AddBlock(b, seqs[b].refs[i]).ok());
      tail_owner[b] = ContiguousOwner(nb, n, nb - 1);
      ASSERT_TRUE(shards[tail_owner[b]]->OwnTail(b, seqs[b].num_tokens).ok());
    }
    // Dense copies that grow with each step, per layer.
    std::vector<std::vector<reference::DenseKv>> dense(L.layers);
    for (uint32_t layer = 0; layer < L.layers; ++layer)
      for (uint32_t b = 0; b < B; ++b) dense[layer].push_back(DenseOf(L, seqs[b].refs, layer));
    std::normal_distribution<double> nd;
    for (int step = 0; step < 20; ++step) {
      std::vector<int64_t> pos;
      std::vector<uint32_t> ids;
      for (uint32_t b = 0; b < B; ++b) {
        pos.push_back(seqs[b].num_tokens + step);
        ids.push_back(b);
      }
      // Every layer of the new token, in layer order (as an engine runs them).
      for (uint32_t layer = 0; layer < L.layers; ++layer) {
        auto q = RandomQueries(DType::kBF16, B, q_heads, 64, pos, rng, ids);
        const size_t row = size_t{L.kv_heads} * 64;
        std::vector<uint16_t> nk(B * row), nv(B * row);
        for (uint32_t b = 0; b < B; ++b) {
          auto& d = dense[layer][b];
          d.positions.push_back(pos[b]);
          for (size_t i = 0; i < row; ++i)
            d.k.push_back(testing::StoreAs(DType::kBF16, nk.data(), b * row + i, nd(rng)));
          for (size_t i = 0; i < row; ++i)
            d.v.push_back(testing::StoreAs(DType::kBF16, nv.data(), b * row + i, nd(rng)));
        }
        PartialResult out(B, q_heads, 64);
        testing::Poison(out);
        std::vector<absl::Status> st(world);
        AttentionOptions o;
        o.layer = layer;
        RunRanks(world, [&](int r, Transport& t) {
          RingOptions ro;
          ro.call_id = static_cast<uint32_t>(step * 8 + layer);
          ro.timeout = absl::Seconds(20);
          QueryTensor mine = r == caller ? q.view : QueryTensor{};
          if (r != caller) {
            mine.dtype = DType::kBF16;
            mine.q_heads = q_heads;
            mine.head_dim = 64;
          }
          st[r] = DecodeStep(t, o, caller, tail_owner, mine, r == caller ? nk.data() : nullptr,
                             r == caller ? nv.data() : nullptr, *shards[r], out.view(), ro);
        });
        for (int r = 0; r < world; ++r) ASSERT_TRUE(st[r].ok()) << "step " << step << " rank " << r << ": " << st[r];
        for (uint32_t b = 0; b < B; ++b) {
          auto ref = reference::Attention(testing::RowsOf(q, {b}, q_heads, 64), {pos[b]}, q_heads, dense[layer][b], o);
          ExpectClose(out.out.data() + size_t{b} * q_heads * 64, out.lse.data() + size_t{b} * q_heads, ref, kTol,
                      absl::StrCat("decode N=", n, " step ", step, " layer ", layer, " seq ", b));
        }
      }
    }
    for (uint32_t b = 0; b < B; ++b) {
      int64_t held = 0;
      for (int r = 0; r < world; ++r) held += shards[r]->tokens(b, 1);
      EXPECT_EQ(held, seqs[b].num_tokens + 20);  // every appended token landed exactly once
      EXPECT_EQ(shards[tail_owner[b]]->next_position(b, 1), seqs[b].num_tokens + 20);
    }
  }
}

TEST(RingTest, ARankWithBadInputFailsAndPeersTimeOutInsteadOfReturningGarbage) {
  std::mt19937_64 rng(7);
  const BlockLayout L{16, 1, 2, 64, DType::kBF16};
  auto seq = RandomSequence(L, 64, rng);
  std::vector<absl::Status> st(3);
  RunRanks(3, [&](int r, Transport& t) {
    auto q = RandomQueries(DType::kBF16, 2, 4, 64, {10, 20}, rng);
    if (r == 1) q.view.q_heads = 3;  // not a multiple of kv_heads
    std::vector<KvBlockRef> mine{seq.refs[r]};
    std::vector<uint32_t> begin{0, 1};
    PartialResult out(2, 4, 64);
    RingOptions ro;
    ro.timeout = absl::Milliseconds(300);
    st[r] = RingPassQ(t, {}, q.view, PagedKv{L, {}, mine, begin}, out.view(), ro, PassQMode::kRing);
  });
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(st[r].ok()) << "rank " << r;
}

}  // namespace
}  // namespace kvring
