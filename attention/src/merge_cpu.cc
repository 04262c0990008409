#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvring/attention/merge.h"

namespace kvring {

absl::Status MergePartials(absl::Span<const ConstPartial> inputs, uint32_t num_rows, uint32_t q_heads,
                           uint32_t head_dim, PartialOutput out) {
  if (out.out == nullptr || out.lse == nullptr) return absl::InvalidArgumentError("merge output buffers are null");
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].out == nullptr || inputs[i].lse == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("partial ", i, " has null buffers"));
    }
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const size_t rows = size_t{num_rows} * q_heads;
  std::vector<float> weights(inputs.size());
  std::vector<float> tmp(head_dim);
  for (size_t r = 0; r < rows; ++r) {
    float mx = kNegInf;
    for (const ConstPartial& p : inputs) {
      const float l = p.lse[r];
      if (std::isnan(l)) return absl::InvalidArgumentError("a partial's LSE is NaN");
      mx = std::max(mx, l);
    }
    if (mx == kNegInf) {
      for (uint32_t d = 0; d < head_dim; ++d) out.out[r * head_dim + d] = 0;
      out.lse[r] = kNegInf;
      continue;
    }
    // Accumulate in double: the weights can differ by many orders of magnitude.
    double total = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const float l = inputs[i].lse[r];
      weights[i] = l == kNegInf ? 0.0f : static_cast<float>(std::exp(static_cast<double>(l) - mx));
      total += weights[i];
    }
    std::fill(tmp.begin(), tmp.end(), 0.0f);
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (weights[i] == 0) continue;
      const float w = static_cast<float>(weights[i] / total);
      const float* o = inputs[i].out + r * head_dim;
      for (uint32_t d = 0; d < head_dim; ++d) tmp[d] += w * o[d];
    }
    for (uint32_t d = 0; d < head_dim; ++d) out.out[r * head_dim + d] = tmp[d];  // may alias an input
    out.lse[r] = static_cast<float>(mx + std::log(total));
  }
  return absl::OkStatus();
}

void MergeInto(PartialOutput acc, ConstPartial other, uint32_t num_rows, uint32_t q_heads, uint32_t head_dim) {
  const ConstPartial parts[2] = {ConstPartial{acc.out, acc.lse}, other};
  (void)MergePartials(parts, num_rows, q_heads, head_dim, acc);
}

}  // namespace kvring
