// Dense float64 reference attention: the definition every kernel and every
// distributed path is checked against. Deliberately simple (a direct
// softmax over all visible keys, in double).
#pragma once

#include <cstdint>
#include <vector>

#include "kvring/attention/tensors.h"

namespace kvring::reference {

// Dense KV of one sequence for one layer: K, V [num_keys, kv_heads, head_dim]
// with the absolute position of each key.
struct DenseKv {
  uint32_t kv_heads = 0, head_dim = 0;
  std::vector<double> k, v;
  std::vector<int64_t> positions;
  uint32_t num_keys() const { return static_cast<uint32_t>(positions.size()); }
};

struct DenseOutput {
  std::vector<double> out;  // [num_rows, q_heads, head_dim]
  std::vector<double> lse;  // [num_rows, q_heads], -inf when no key is visible
};

// q: [num_rows, q_heads, head_dim] doubles; q_pos: [num_rows].
DenseOutput Attention(const std::vector<double>& q, const std::vector<int64_t>& q_pos, uint32_t q_heads,
                      const DenseKv& kv, const AttentionOptions& options);

// Dense copy of layer `layer` of a sequence's paged blocks (dequantized).
DenseKv FromBlocks(const PagedKv& kv, uint32_t sequence, uint32_t layer);

}  // namespace kvring::reference
