#include "kvring/attention/step/step_shape.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvring {

absl::Status CheckStepShape(const StepShape& s, const BlockLayout* layout) {
  if (s.q_heads == 0 || s.q_heads > kMaxQHeads) {
    return absl::InvalidArgumentError(absl::StrCat("q_heads must be in [1, ", kMaxQHeads, "]; it is ", s.q_heads));
  }
  if (s.head_dim == 0 || s.head_dim > kMaxHeadDim || s.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be a multiple of 8 in [8, ", kMaxHeadDim, "]; it is ", s.head_dim));
  }
  if (!IsFloatKvDType(s.q_dtype)) return absl::InvalidArgumentError("queries must be f32, f16 or bf16");
  const AttentionOptions& o = s.options;
  if (o.layer >= kMaxLayers) return absl::InvalidArgumentError(absl::StrCat("layer ", o.layer, " out of range"));
  if (o.window < 0) return absl::InvalidArgumentError("window must be >= 0");
  if (!std::isfinite(o.softmax_scale) || o.softmax_scale < 0) {
    return absl::InvalidArgumentError("softmax_scale must be finite and >= 0");
  }
  if (layout == nullptr) return absl::OkStatus();
  if (s.head_dim != layout->head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("query head_dim ", s.head_dim, " but the layout's is ", layout->head_dim));
  }
  if (s.q_heads % layout->kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("q_heads ", s.q_heads, " is not a multiple of kv_heads ", layout->kv_heads));
  }
  if (o.layer >= layout->layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", o.layer, " but the layout has ", layout->layers, " layers"));
  }
  return absl::OkStatus();
}

}  // namespace kvring
