// Helpers shared by the block store tests.
#pragma once

#include <cstdint>
#include <vector>

#include "kvring/cache/block_store.h"

namespace kvring::testing {

inline BlockLayout SmallLayout() { return BlockLayout{4, 1, 2, 8, DType::kF16}; }  // 256 bytes

inline BlockKey KeyOf(uint64_t i) { return BlockKey{i * 0x9E3779B97F4A7C15ull + 11, (i << 1) | 1}; }

// Payload bytes determined by the key, so any reader can check them.
inline std::vector<uint8_t> PayloadFor(const BlockKey& k, size_t bytes) {
  std::vector<uint8_t> p(bytes);
  uint64_t x = k.lo ^ k.hi;
  for (size_t i = 0; i < bytes; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = static_cast<uint8_t>(x >> 56);
  }
  return p;
}

inline PutArgs ArgsFor(uint64_t i, NamespaceId ns = 1, TenantId tenant = 1, bool first = false) {
  PutArgs a;
  a.tenant = tenant;
  a.ns = ns;
  a.key = KeyOf(i);
  a.parent = (first || i == 0) ? BlockKey{} : KeyOf(i - 1);
  a.meta.layout = SmallLayout();
  return a;
}

}  // namespace kvring::testing
