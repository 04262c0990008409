// KV block codecs, measured on synthetic KV with the statistics real models
// show (the data is synthetic: no model ships in a Debian package):
//
//   K: per (head, channel) mean and scale; a few outlier channels per head
//      (here 4 of 128) with 10-20x the scale and a bias, fixed across tokens,
//      as the KIVI and KVQuant papers report for Llama-family K caches; a
//      rotary-like slow drift along the token axis.
//   V: per-token scale (lognormal, sigma 0.5), no channel outliers.
//   Q: like K's channel structure (the outlier channels line up, which is
//      what makes K outliers matter for the scores).
//
// Part 1, accuracy: attention output (decode, 4 query rows over 4K tokens of
// one layer, GQA 32/8, head_dim 128) from blocks quantized with int8 and
// fp8-e4m3 under each scale mode, as relative L2 error against attention
// over the bf16 blocks, beside the bytes stored per block.
// Part 2, lossless cold-tier codecs: zstd levels and lz4 over bf16 and
// quantized blocks (ratio, compress and decompress MB/s on one core), with
// and without a byte-shuffle (bf16: high bytes then low bytes) to show what
// a transform before the entropy coder would buy.
//
//   ./build/bench/kv_codec_bench [--tokens=4096] [--reps=5]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kvring/attention/partial_attention.h"
#include "kvring/cache/quantize.h"
#include "kvring/cache/rocksdb_cold_tier.h"
#include "kvring/common/flags.h"
#include "kvring/layout/float_convert.h"

using namespace kvring;
using Clock = std::chrono::steady_clock;

namespace {

struct SyntheticKv {
  BlockLayout layout;
  std::vector<std::vector<uint8_t>> blocks;  // bf16 blocks
  std::vector<float> q;                      // [rows, q_heads, head_dim]
  uint32_t q_heads = 32;
};

SyntheticKv Generate(int64_t tokens, uint64_t seed) {
  SyntheticKv s;
  s.layout = BlockLayout{16, 1, 8, 128, DType::kBF16};
  const BlockLayout& L = s.layout;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd;
  std::lognormal_distribution<double> logn(0.0, 0.5);
  // Channel statistics of K (and Q), per kv head.
  std::vector<double> kmean(L.kv_heads * L.head_dim), kscale(L.kv_heads * L.head_dim);
  for (uint32_t h = 0; h < L.kv_heads; ++h) {
    for (uint32_t d = 0; d < L.head_dim; ++d) {
      kmean[h * L.head_dim + d] = 0.2 * nd(rng);
      kscale[h * L.head_dim + d] = 0.5 + 0.5 * std::abs(nd(rng));
    }
    for (int o = 0; o < 4; ++o) {  // outlier channels
      const uint32_t d = static_cast<uint32_t>(rng() % L.head_dim);
      kscale[h * L.head_dim + d] = 10 + 10 * (rng() % 1000) / 1000.0;
      kmean[h * L.head_dim + d] = 3 * nd(rng);
    }
  }
  const int64_t nblocks = tokens / L.block_tokens;
  for (int64_t b = 0; b < nblocks; ++b) {
    std::vector<uint8_t> blk(L.bytes());
    auto* e = reinterpret_cast<uint16_t*>(blk.data());
    for (uint32_t h = 0; h < L.kv_heads; ++h) {
      for (uint32_t t = 0; t < L.block_tokens; ++t) {
        const double pos = static_cast<double>(b * L.block_tokens + t);
        const double vs = logn(rng);
        for (uint32_t d = 0; d < L.head_dim; ++d) {
          const size_t c = h * L.head_dim + d;
          const double drift = std::sin(pos / std::pow(10000.0, 2.0 * (d / 2) / L.head_dim));
          e[L.index(0, 0, h, t, d)] =
              FloatToBf16(static_cast<float>(kmean[c] + kscale[c] * (0.8 * nd(rng) + 0.6 * drift)));
          e[L.index(0, 1, h, t, d)] = FloatToBf16(static_cast<float>(vs * nd(rng)));
        }
      }
    }
    s.blocks.push_back(std::move(blk));
  }
  const uint32_t rows = 4, group = s.q_heads / L.kv_heads;
  s.q.resize(size_t{rows} * s.q_heads * L.head_dim);
  for (uint32_t r = 0; r < rows; ++r) {
    for (uint32_t qh = 0; qh < s.q_heads; ++qh) {
      for (uint32_t d = 0; d < L.head_dim; ++d) {
        const size_t c = (qh / group) * L.head_dim + d;
        s.q[(size_t{r} * s.q_heads + qh) * L.head_dim + d] = static_cast<float>(nd(rng) * std::sqrt(kscale[c]) * 0.5);
      }
    }
  }
  return s;
}

PartialResult Attend(const SyntheticKv& s, KvEncoding enc, const std::vector<std::vector<uint8_t>>& blocks) {
  std::vector<KvBlockRef> refs;
  for (size_t b = 0; b < blocks.size(); ++b) {
    refs.push_back(
        KvBlockRef{blocks[b].data(), static_cast<int64_t>(b * s.layout.block_tokens), s.layout.block_tokens});
  }
  std::vector<uint32_t> begin{0, static_cast<uint32_t>(refs.size())};
  const uint32_t rows = static_cast<uint32_t>(s.q.size() / (s.q_heads * s.layout.head_dim));
  std::vector<int64_t> pos(rows, static_cast<int64_t>(blocks.size() * s.layout.block_tokens));
  QueryTensor qt{s.q.data(), DType::kF32, rows, s.q_heads, s.layout.head_dim, pos.data(), nullptr};
  PartialResult r(rows, s.q_heads, s.layout.head_dim);
  absl::Status st = PartialAttention(AttentionOptions{}, qt, PagedKv{s.layout, enc, refs, begin}, r.view());
  if (!st.ok()) {
    std::fprintf(stderr, "attention: %s\n", st.ToString().c_str());
    std::exit(1);
  }
  return r;
}

double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return std::sqrt(num / den);
}

std::vector<uint8_t> Shuffle16(const std::vector<uint8_t>& in) {
  std::vector<uint8_t> out(in.size());
  const size_t n = in.size() / 2;
  for (size_t i = 0; i < n; ++i) {
    out[i] = in[2 * i + 1];
    out[n + i] = in[2 * i];
  }
  return out;
}

struct Lossless {
  double ratio, comp_mbs, decomp_mbs;
};

Lossless MeasureLossless(const std::vector<std::vector<uint8_t>>& blocks, ColdCodec codec, int level, int reps) {
  uint64_t raw = 0, stored = 0;
  double tc = 1e30, td = 1e30;
  std::vector<std::string> packed(blocks.size());
  for (int r = 0; r < reps; ++r) {
    auto a = Clock::now();
    for (size_t i = 0; i < blocks.size(); ++i) (void)RocksDbColdTier::Compress(codec, level, blocks[i], &packed[i]);
    tc = std::min(tc, std::chrono::duration<double>(Clock::now() - a).count());
    std::vector<uint8_t> out;
    a = Clock::now();
    for (size_t i = 0; i < blocks.size(); ++i) {
      (void)RocksDbColdTier::Decompress(
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(packed[i].data()), packed[i].size()), &out);
    }
    td = std::min(td, std::chrono::duration<double>(Clock::now() - a).count());
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    raw += blocks[i].size();
    stored += packed[i].size();
  }
  return Lossless{static_cast<double>(raw) / stored, raw / tc / 1e6, raw / td / 1e6};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 4096, reps = 5, seed = 1;
  FlagSet f("kv_codec_bench", "accuracy of int8/fp8 KV blocks and lossless cold-tier codecs on synthetic KV");
  f.AddInt("tokens", &tokens, "tokens of KV (one layer, 8 kv heads x 128)");
  f.AddInt("reps", &reps, "timing repetitions (best of)");
  f.AddInt("seed", &seed, "random seed");
  if (auto s = f.Parse(argc, argv); !s.ok() || f.help_requested()) {
    std::printf("%s", f.Usage().c_str());
    return f.help_requested() ? 0 : 2;
  }
  const SyntheticKv s = Generate(tokens, static_cast<uint64_t>(seed));
  const PartialResult base = Attend(s, KvEncoding{}, s.blocks);
  std::printf("synthetic KV: %lld tokens, 1 layer, 8 kv heads x 128 (bf16), 32 q heads, 4 decode rows\n",
              static_cast<long long>(tokens));
  std::printf(
      "\n| encoding | bytes/block | of bf16 | rel. L2 of O vs bf16 | rel. L2 of K codes | rel. L2 of V codes |\n");
  std::printf("|---|---|---|---|---|---|\n");
  std::vector<std::pair<std::string, std::vector<std::vector<uint8_t>>>> encoded_sets;
  for (const char* name :
       {"int8/per-head", "int8/per-token", "int8/kivi", "fp8/per-head", "fp8/per-token", "fp8/kivi"}) {
    KvEncoding enc;
    (void)ParseKvEncoding(name, &enc);
    std::vector<std::vector<uint8_t>> q(s.blocks.size());
    double ek = 0, rk = 0, ev = 0, rv = 0;
    for (size_t b = 0; b < s.blocks.size(); ++b) {
      if (absl::Status st = QuantizeBlock(s.layout, s.blocks[b], enc, &q[b]); !st.ok()) {
        std::fprintf(stderr, "%s: %s\n", name, st.ToString().c_str());
        return 1;
      }
      std::vector<uint8_t> back;
      (void)DequantizeBlock(s.layout, enc, q[b], &back);
      for (uint64_t e = 0; e < s.layout.elements(); ++e) {
        const double x = PlainElement(s.layout, s.blocks[b].data(), e), y = PlainElement(s.layout, back.data(), e);
        const bool is_v = (e / s.layout.plane_elems() / s.layout.kv_heads) % 2 == 1;
        (is_v ? ev : ek) += (x - y) * (x - y);
        (is_v ? rv : rk) += x * x;
      }
    }
    const PartialResult got = Attend(s, enc, q);
    std::printf("| %s | %llu | %.3f | %.2e | %.2e | %.2e |\n", name,
                static_cast<unsigned long long>(EncodedBytes(s.layout, enc)),
                static_cast<double>(EncodedBytes(s.layout, enc)) / s.layout.bytes(), RelL2(got.out, base.out),
                std::sqrt(ek / rk), std::sqrt(ev / rv));
    std::fflush(stdout);
    encoded_sets.emplace_back(name, std::move(q));
  }
  std::vector<std::vector<uint8_t>> shuffled;
  for (const auto& b : s.blocks) shuffled.push_back(Shuffle16(b));
  std::printf("\n| data | codec | ratio | compress MB/s | decompress MB/s |\n|---|---|---|---|---|\n");
  auto row = [&](const char* data, const std::vector<std::vector<uint8_t>>& blocks) {
    struct C {
      const char* name;
      ColdCodec codec;
      int level;
    };
    for (const C& c : {C{"lz4", ColdCodec::kLz4, 0}, C{"zstd-1", ColdCodec::kZstd, 1}, C{"zstd-3", ColdCodec::kZstd, 3},
                       C{"zstd-9", ColdCodec::kZstd, 9}}) {
      const Lossless l = MeasureLossless(blocks, c.codec, c.level, static_cast<int>(reps));
      std::printf("| %s | %s | %.3f | %.0f | %.0f |\n", data, c.name, l.ratio, l.comp_mbs, l.decomp_mbs);
      std::fflush(stdout);
    }
  };
  row("bf16", s.blocks);
  row("bf16, byte-shuffled", shuffled);
  for (const auto& [name, blocks] : encoded_sets) {
    if (name == "int8/kivi" || name == "fp8/kivi") row(name.c_str(), blocks);
  }
  return 0;
}
