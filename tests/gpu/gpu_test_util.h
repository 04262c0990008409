// Helpers for the GPU tests: device checks, device buffers, paged KV built
// from random host data (the same bits the CPU reference reads).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvring/attention/cuda/paged_attention_cuda.h"
#include "kvring/attention/reference.h"
#include "kvring/layout/float_convert.h"
#include "require_gpu.h"

namespace kvring::gpu_testing {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  Dev() = default;
  explicit Dev(size_t count) : n(count) { cudaMalloc(&p, std::max<size_t>(1, count) * sizeof(T)); }
  Dev(const std::vector<T>& h) : Dev(h.size()) {
    cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  Dev(Dev&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; }
  Dev& operator=(Dev&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  ~Dev() {
    if (p) cudaFree(p);
  }
  std::vector<T> Host() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  void Poison() { cudaMemset(p, 0xff, n * sizeof(T)); }  // NaN for floats
  void Zero() { cudaMemset(p, 0, n * sizeof(T)); }
};

inline uint16_t ToBits(double v, bool bf16) {
  return bf16 ? FloatToBf16(static_cast<float>(v)) : FloatToF16(static_cast<float>(v));
}
inline double FromBits(uint16_t b, bool bf16) { return bf16 ? Bf16ToFloat(b) : F16ToFloat(b); }

// One sequence's KV for the GPU: pages in a device pool at shuffled page ids,
// plus the dense double copy the reference reads.
struct PagedSeq {
  int num_tokens = 0;
  std::vector<int32_t> page_ids, page_pos;  // listed pages
  reference::DenseKv dense;
};

// A pool of `capacity` pages of layout (bt, layers, kv_heads, D) and the
// sequences in it. Positions: sequence s's listed page i starts at
// pos_start[s] + i * bt unless `gap` (then every other page is skipped, as a
// shard holding every other block would).
struct PagedBatch {
  int bt, layers, kv_heads, D;
  bool bf16;
  std::vector<uint16_t> pool_host;
  Dev<uint16_t> pool;
  std::vector<PagedSeq> seqs;
  Dev<int32_t> page_ids, page_pos, seq_page_begin, seq_tokens;
  uint64_t page_elems() const { return (uint64_t)layers * 2 * kv_heads * bt * D; }

  cuda::PagedKvView View(int layer) const {
    cuda::PagedKvView v;
    v.pool = pool.p;
    v.page_stride = page_elems() * 2;
    v.block_tokens = bt;
    v.layers = layers;
    v.kv_heads = kv_heads;
    v.head_dim = D;
    v.dtype = bf16 ? cuda::KvType::kBF16 : cuda::KvType::kF16;
    v.layer = layer;
    v.page_ids = page_ids.p;
    v.page_pos = page_pos.p;
    v.seq_page_begin = seq_page_begin.p;
    v.seq_tokens = seq_tokens.p;
    v.num_seqs = static_cast<int>(seqs.size());
    return v;
  }
};

// The slots of a last page past its sequence's end hold `junk` (NaN by
// default: a kernel must never read them into a result, not even as 0 x V).
inline PagedBatch MakeBatch(std::mt19937_64& rng, int bt, int layers, int kv_heads, int D, bool bf16,
                            const std::vector<int>& tokens, const std::vector<int>& pos_start, bool gap,
                            int layer_for_dense, double junk = std::nan("")) {
  PagedBatch b{bt, layers, kv_heads, D, bf16};
  int total_pages = 0;
  for (int t : tokens) total_pages += (t + bt - 1) / bt;
  const int capacity = total_pages + 3;
  b.pool_host.assign((size_t)capacity * b.page_elems(), 0);
  std::vector<int32_t> perm(capacity);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::normal_distribution<double> nd;
  std::vector<int32_t> ids, poss, begin{0}, ntok;
  int next = 0;
  for (size_t s = 0; s < tokens.size(); ++s) {
    PagedSeq q;
    q.num_tokens = tokens[s];
    q.dense.kv_heads = kv_heads;
    q.dense.head_dim = D;
    const int np = (tokens[s] + bt - 1) / bt;
    for (int i = 0; i < np; ++i) {
      const int page = perm[next++];
      const int start = pos_start[s] + i * bt * (gap ? 2 : 1);
      ids.push_back(page);
      poss.push_back(start);
      const int nt = std::min(bt, tokens[s] - i * bt);
      uint16_t* base = b.pool_host.data() + (size_t)page * b.page_elems();
      for (int l = 0; l < layers; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int h = 0; h < kv_heads; ++h)
            for (int t = 0; t < bt; ++t)
              for (int d = 0; d < D; ++d) {
                const size_t e = (((size_t)(l * 2 + kv) * kv_heads + h) * bt + t) * D + d;
                base[e] = ToBits(t < nt ? nd(rng) : junk, bf16);
              }
      for (int t = 0; t < nt; ++t) {
        q.dense.positions.push_back(start + t);
        for (int kv = 0; kv < 2; ++kv)
          for (int h = 0; h < kv_heads; ++h)
            for (int d = 0; d < D; ++d) {
              const size_t e = (((size_t)(layer_for_dense * 2 + kv) * kv_heads + h) * bt + t) * D + d;
              (kv == 0 ? q.dense.k : q.dense.v).push_back(FromBits(base[e], bf16));
            }
      }
    }
    begin.push_back(static_cast<int32_t>(ids.size()));
    ntok.push_back(tokens[s]);
    b.seqs.push_back(std::move(q));
  }
  b.pool = Dev<uint16_t>(b.pool_host);
  b.page_ids = Dev<int32_t>(ids);
  b.page_pos = Dev<int32_t>(poss);
  b.seq_page_begin = Dev<int32_t>(begin);
  b.seq_tokens = Dev<int32_t>(ntok);
  return b;
}

// Queries grouped by sequence.
struct QueryBatch {
  std::vector<uint16_t> q_host;
  std::vector<double> q_values;
  std::vector<int32_t> pos, begin;
  Dev<uint16_t> q;
  Dev<int32_t> dpos, dbegin;
  int q_heads, D, max_rows = 0;
  cuda::QueryView View() const {
    cuda::QueryView v;
    v.q = q.p;
    v.positions = dpos.p;
    v.seq_row_begin = dbegin.p;
    v.num_rows = static_cast<int>(pos.size());
    v.q_heads = q_heads;
    v.max_rows_per_seq = max_rows;
    return v;
  }
};

inline QueryBatch MakeQueries(std::mt19937_64& rng, int q_heads, int D, bool bf16,
                              const std::vector<std::vector<int32_t>>& positions_per_seq) {
  QueryBatch qb;
  qb.q_heads = q_heads;
  qb.D = D;
  qb.begin.push_back(0);
  std::normal_distribution<double> nd;
  for (const auto& ps : positions_per_seq) {
    for (int32_t p : ps) {
      qb.pos.push_back(p);
      for (int i = 0; i < q_heads * D; ++i) {
        const uint16_t bits = ToBits(nd(rng), bf16);
        qb.q_host.push_back(bits);
        qb.q_values.push_back(FromBits(bits, bf16));
      }
    }
    qb.begin.push_back(static_cast<int32_t>(qb.pos.size()));
    qb.max_rows = std::max<int>(qb.max_rows, static_cast<int>(ps.size()));
  }
  qb.q = Dev<uint16_t>(qb.q_host);
  qb.dpos = Dev<int32_t>(qb.pos);
  qb.dbegin = Dev<int32_t>(qb.begin);
  return qb;
}

// Relative L2 error of O and max LSE error against the reference for the
// rows of sequence s; -inf rows exact; no NaN anywhere (outputs are poisoned
// with NaN before each run).
inline void ExpectMatches(const std::vector<float>& out, const std::vector<float>& lse, const QueryBatch& qb,
                          const PagedBatch& kvb, const AttentionOptions& o, double tol, const std::string& what) {
  const int H = qb.q_heads, D = qb.D;
  double num = 0, den = 0, lse_err = 0;
  for (size_t s = 0; s < kvb.seqs.size(); ++s) {
    const int r0 = qb.begin[s], r1 = qb.begin[s + 1];
    if (r0 == r1) continue;
    std::vector<double> qv(qb.q_values.begin() + (size_t)r0 * H * D, qb.q_values.begin() + (size_t)r1 * H * D);
    std::vector<int64_t> pos(qb.pos.begin() + r0, qb.pos.begin() + r1);
    auto ref = reference::Attention(qv, pos, H, kvb.seqs[s].dense, o);
    for (size_t i = 0; i < ref.out.size(); ++i) {
      const float g = out[(size_t)r0 * H * D + i];
      ASSERT_FALSE(std::isnan(g)) << what << ": output element not written (NaN) at seq " << s << " index " << i;
      num += (g - ref.out[i]) * (g - ref.out[i]);
      den += ref.out[i] * ref.out[i];
    }
    for (size_t i = 0; i < ref.lse.size(); ++i) {
      const float g = lse[(size_t)r0 * H + i];
      ASSERT_FALSE(std::isnan(g)) << what << ": lse not written";
      if (std::isinf(ref.lse[i])) {
        ASSERT_TRUE(std::isinf(g) && g < 0) << what << ": row sees no key, lse must be -inf, got " << g;
        for (int d = 0; d < D; ++d) ASSERT_EQ(out[((size_t)r0 * H + i) * D + d], 0.f) << what;
      } else {
        lse_err = std::max(lse_err, std::abs(g - ref.lse[i]) / std::max(1.0, std::abs(ref.lse[i])));
      }
    }
  }
  if (den > 0) {
    EXPECT_LT(std::sqrt(num / den), tol) << what << ": relative L2 error of O";
  }
  EXPECT_LT(lse_err, tol) << what << ": relative LSE error";
}

}  // namespace kvring::gpu_testing
