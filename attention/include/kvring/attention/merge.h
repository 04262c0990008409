// MergePartials: the exact combination of attention partials.
//
//   LSE = log(sum_s exp(LSE_s)),  O = sum_s exp(LSE_s - LSE) * O_s
//
// computed stably (shifted by the max LSE). Partials with LSE = -inf (saw no
// key) contribute nothing; if every partial is -inf the row is O = 0,
// LSE = -inf. The result does not depend on the order of the partials beyond
// rounding. `out` may alias inputs[0] (in-place accumulate). All partials have
// the shape [num_rows, q_heads, head_dim] / [num_rows, q_heads].
#pragma once

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvring/attention/tensors.h"

namespace kvring {

absl::Status MergePartials(absl::Span<const ConstPartial> inputs, uint32_t num_rows, uint32_t q_heads,
                           uint32_t head_dim, PartialOutput out);

// acc <- merge(acc, other), in place.
void MergeInto(PartialOutput acc, ConstPartial other, uint32_t num_rows, uint32_t q_heads, uint32_t head_dim);

}  // namespace kvring
