#include "kvring/attention/reference.h"

#include <cmath>
#include <limits>

#include "kvring/layout/float_convert.h"
#include "kvring/layout/fp8.h"

namespace kvring::reference {

DenseOutput Attention(const std::vector<double>& q, const std::vector<int64_t>& q_pos, uint32_t q_heads,
                      const DenseKv& kv, const AttentionOptions& o) {
  const uint32_t D = kv.head_dim;
  const uint32_t G = q_heads / kv.kv_heads;
  const uint32_t rows = static_cast<uint32_t>(q_pos.size());
  const double scale = o.softmax_scale > 0 ? o.softmax_scale : 1.0 / std::sqrt(static_cast<double>(D));
  DenseOutput r;
  r.out.assign(size_t{rows} * q_heads * D, 0.0);
  r.lse.assign(size_t{rows} * q_heads, -std::numeric_limits<double>::infinity());
  std::vector<double> s(kv.num_keys());
  for (uint32_t row = 0; row < rows; ++row) {
    for (uint32_t h = 0; h < q_heads; ++h) {
      const uint32_t kh = h / G;
      const double* qv = &q[(size_t{row} * q_heads + h) * D];
      double mx = -std::numeric_limits<double>::infinity();
      std::vector<uint32_t> vis;
      for (uint32_t j = 0; j < kv.num_keys(); ++j) {
        const int64_t kp = kv.positions[j];
        if (o.causal && kp > q_pos[row]) continue;
        if (o.window > 0 && kp <= q_pos[row] - o.window) continue;
        double dot = 0;
        const double* kk = &kv.k[(size_t{j} * kv.kv_heads + kh) * D];
        for (uint32_t d = 0; d < D; ++d) dot += qv[d] * kk[d];
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
        vis.push_back(j);
      }
      if (vis.empty()) continue;
      double sum = 0;
      for (uint32_t j : vis) sum += std::exp(s[j] - mx);
      double* out = &r.out[(size_t{row} * q_heads + h) * D];
      for (uint32_t j : vis) {
        const double p = std::exp(s[j] - mx) / sum;
        const double* vv = &kv.v[(size_t{j} * kv.kv_heads + kh) * D];
        for (uint32_t d = 0; d < D; ++d) out[d] += p * vv[d];
      }
      r.lse[size_t{row} * q_heads + h] = mx + std::log(sum);
    }
  }
  return r;
}

namespace {
double Element(const PagedKv& kv, const KvBlockRef& b, uint32_t layer, uint32_t which, uint32_t head, uint32_t t,
               uint32_t d) {
  const BlockLayout& L = kv.layout;
  const uint64_t i = L.index(layer, which, head, t, d);
  if (!kv.encoding.quantized()) {
    switch (L.dtype) {
      case DType::kF32:
        return reinterpret_cast<const float*>(b.data)[i];
      case DType::kBF16:
        return Bf16ToFloat(reinterpret_cast<const uint16_t*>(b.data)[i]);
      case DType::kF16:
        return F16ToFloat(reinterpret_cast<const uint16_t*>(b.data)[i]);
      default:
        return 0;
    }
  }
  const uint8_t c = b.data[i];
  const float* scales = reinterpret_cast<const float*>(b.data + L.elements());
  const double s = scales[ScaleIndex(L, kv.encoding.scales, layer, which, head, t, d)];
  const double v = kv.encoding.codec == KvCodec::kFp8E4M3 ? Fp8E4M3ToFloat(c) : static_cast<int8_t>(c);
  return v * s;
}
}  // namespace

DenseKv FromBlocks(const PagedKv& kv, uint32_t sequence, uint32_t layer) {
  DenseKv d;
  d.kv_heads = kv.layout.kv_heads;
  d.head_dim = kv.layout.head_dim;
  for (uint32_t bi = kv.seq_begin[sequence]; bi < kv.seq_begin[sequence + 1]; ++bi) {
    const KvBlockRef& b = kv.blocks[bi];
    for (uint32_t t = 0; t < b.num_tokens; ++t) {
      d.positions.push_back(b.start_pos + t);
      for (uint32_t h = 0; h < d.kv_heads; ++h) {
        for (uint32_t x = 0; x < d.head_dim; ++x) {
          d.k.push_back(Element(kv, b, layer, 0, h, t, x));
        }
      }
      for (uint32_t h = 0; h < d.kv_heads; ++h) {
        for (uint32_t x = 0; x < d.head_dim; ++x) {
          d.v.push_back(Element(kv, b, layer, 1, h, t, x));
        }
      }
    }
  }
  return d;
}

}  // namespace kvring::reference
