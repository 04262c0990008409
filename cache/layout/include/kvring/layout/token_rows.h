// Token rows of a block: the K and V of a block's first tokens on one layer,
// copied out of the block layout ([layer][K|V][kv_head][token][head_dim],
// block_layout.h) into the token-major rows an append carries
// ([token][kv_head][head_dim], K and V apart). What a node reopening a block
// and a client copying an open block onto another replica both append.
// Host code; a pure function.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvring/layout/block_layout.h"

namespace kvring {

// Copies tokens [0, count) of `layer` of `block` (L.bytes() bytes) into `k`
// and `v`, count * L.kv_heads * L.head_dim elements of L.dtype each.
inline void CopyTokenRows(const BlockLayout& L, const uint8_t* block, uint32_t layer, uint32_t count, uint8_t* k,
                          uint8_t* v) {
  const size_t esz = DTypeSize(L.dtype), row = size_t{L.head_dim} * esz;
  for (uint32_t t = 0; t < count; ++t) {
    for (uint32_t h = 0; h < L.kv_heads; ++h) {
      const size_t at = (size_t{t} * L.kv_heads + h) * row;
      std::memcpy(k + at, block + L.index(layer, 0, h, t, 0) * esz, row);
      std::memcpy(v + at, block + L.index(layer, 1, h, t, 0) * esz, row);
    }
  }
}

}  // namespace kvring
