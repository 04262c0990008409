// Random inputs and reference comparison for the attention tests.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvring/attention/reference.h"
#include "kvring/attention/tensors.h"
#include "kvring/layout/float_convert.h"

namespace kvring::testing {

// Stores `v` as dtype `t` at element i of `buf` and returns the value the
// stored bits mean (so references see exactly what kernels see).
inline double StoreAs(DType t, void* buf, size_t i, double v) {
  switch (t) {
    case DType::kF32: {
      float f = static_cast<float>(v);
      static_cast<float*>(buf)[i] = f;
      return f;
    }
    case DType::kBF16: {
      uint16_t h = FloatToBf16(static_cast<float>(v));
      static_cast<uint16_t*>(buf)[i] = h;
      return Bf16ToFloat(h);
    }
    case DType::kF16: {
      uint16_t h = FloatToF16(static_cast<float>(v));
      static_cast<uint16_t*>(buf)[i] = h;
      return F16ToFloat(h);
    }
    default:
      return 0;
  }
}

// A sequence's KV as blocks of `layout`: tokens [0, num_tokens), random
// values (normal, per-channel scale `channel_scale` for K to mimic outlier
// channels when non-empty).
struct SeqKv {
  BlockLayout layout;
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<KvBlockRef> refs;  // in position order
  int64_t num_tokens = 0;
};

inline SeqKv RandomSequence(const BlockLayout& layout, int64_t num_tokens, std::mt19937_64& rng, int64_t start = 0) {
  SeqKv s;
  s.layout = layout;
  s.num_tokens = num_tokens;
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int64_t pos = 0; pos < num_tokens; pos += layout.block_tokens) {
    const uint32_t n = static_cast<uint32_t>(std::min<int64_t>(layout.block_tokens, num_tokens - pos));
    s.blocks.emplace_back(layout.bytes(), 0);
    auto& b = s.blocks.back();
    for (uint32_t l = 0; l < layout.layers; ++l)
      for (uint32_t kv = 0; kv < 2; ++kv)
        for (uint32_t h = 0; h < layout.kv_heads; ++h)
          for (uint32_t t = 0; t < n; ++t)
            for (uint32_t d = 0; d < layout.head_dim; ++d)
              StoreAs(layout.dtype, b.data(), layout.index(l, kv, h, t, d), nd(rng));
  }
  for (size_t i = 0; i < s.blocks.size(); ++i) {
    const int64_t pos = static_cast<int64_t>(i) * layout.block_tokens;
    s.refs.push_back(KvBlockRef{s.blocks[i].data(), start + pos,
                                static_cast<uint32_t>(std::min<int64_t>(layout.block_tokens, num_tokens - pos))});
  }
  return s;
}

struct Queries {
  std::vector<uint8_t> data;
  std::vector<double> values;  // what the stored bits mean
  std::vector<int64_t> positions;
  std::vector<uint32_t> seq_ids;
  QueryTensor view;
};

inline Queries RandomQueries(DType dtype, uint32_t rows, uint32_t q_heads, uint32_t head_dim,
                             std::vector<int64_t> positions, std::mt19937_64& rng, std::vector<uint32_t> seq_ids = {}) {
  Queries q;
  const size_t n = size_t{rows} * q_heads * head_dim;
  q.data.resize(n * DTypeSize(dtype));
  q.values.resize(n);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (size_t i = 0; i < n; ++i) q.values[i] = StoreAs(dtype, q.data.data(), i, nd(rng));
  q.positions = std::move(positions);
  q.seq_ids = std::move(seq_ids);
  q.view = QueryTensor{q.data.data(),
                       dtype,
                       rows,
                       q_heads,
                       head_dim,
                       q.positions.data(),
                       q.seq_ids.empty() ? nullptr : q.seq_ids.data()};
  return q;
}

// Rows of `q` that attend to sequence `seq`, as doubles.
inline std::vector<double> RowsOf(const Queries& q, const std::vector<uint32_t>& rows, uint32_t heads, uint32_t dim) {
  std::vector<double> out;
  for (uint32_t r : rows)
    out.insert(out.end(), q.values.begin() + size_t{r} * heads * dim, q.values.begin() + size_t{r + 1} * heads * dim);
  return out;
}

// Relative L2 error of `got` (fp32) against the reference, and exactness of
// -inf LSEs. Also asserts the output is not all zeros where keys were seen
// and that nothing is NaN (outputs are poisoned with NaN before each run).
inline void ExpectClose(const float* out, const float* lse, const reference::DenseOutput& ref, double tol,
                        const std::string& what) {
  double num = 0, den = 0, lse_err = 0;
  bool any_visible = false;
  for (size_t i = 0; i < ref.out.size(); ++i) {
    ASSERT_FALSE(std::isnan(out[i])) << what << ": output " << i << " not written (NaN)";
    const double d = out[i] - ref.out[i];
    num += d * d;
    den += ref.out[i] * ref.out[i];
  }
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    ASSERT_FALSE(std::isnan(lse[i])) << what << ": lse " << i << " not written (NaN)";
    if (std::isinf(ref.lse[i])) {
      ASSERT_TRUE(std::isinf(lse[i]) && lse[i] < 0)
          << what << ": row " << i << " sees no key, lse must be -inf, got " << lse[i];
    } else {
      any_visible = true;
      lse_err = std::max(lse_err, std::abs(lse[i] - ref.lse[i]) / std::max(1.0, std::abs(ref.lse[i])));
    }
  }
  if (any_visible) {
    ASSERT_GT(den, 0) << what << ": reference output is all zeros";
    double got_norm = 0;
    for (size_t i = 0; i < ref.out.size(); ++i) got_norm += double(out[i]) * out[i];
    ASSERT_GT(got_norm, 0) << what << ": output is all zeros";
    EXPECT_LT(std::sqrt(num / den), tol) << what << ": relative L2 error of O";
  }
  EXPECT_LT(lse_err, tol) << what << ": relative error of LSE";
}

inline void Poison(PartialResult& p) {
  std::fill(p.out.begin(), p.out.end(), std::numeric_limits<float>::quiet_NaN());
  std::fill(p.lse.begin(), p.lse.end(), std::numeric_limits<float>::quiet_NaN());
}

// Concatenates dense KV pieces (one sequence).
inline reference::DenseKv DenseOf(const BlockLayout& layout, const std::vector<KvBlockRef>& refs, uint32_t layer,
                                  KvEncoding enc = {}) {
  std::vector<uint32_t> begin{0, static_cast<uint32_t>(refs.size())};
  PagedKv kv{layout, enc, refs, begin};
  return reference::FromBlocks(kv, 0, layer);
}

}  // namespace kvring::testing
