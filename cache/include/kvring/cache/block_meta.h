// Value types that describe a stored block: who owns it, how it is encoded,
// and the scoped key the store files it under.
#pragma once

#include <cstdint>

#include "kvring/cache/block_key.h"
#include "kvring/layout/block_layout.h"
#include "kvring/layout/kv_encoding.h"

namespace kvring {

using TenantId = uint32_t;

// A block key inside one namespace. The store never matches a key across
// namespaces, so a key computed under another tenant's namespace is a miss.
struct ScopedKey {
  NamespaceId ns = 0;
  BlockKey key;
  friend bool operator==(const ScopedKey& a, const ScopedKey& b) { return a.ns == b.ns && a.key == b.key; }
  template <typename H>
  friend H AbslHashValue(H h, const ScopedKey& k) {
    return H::combine(std::move(h), k.ns, k.key.lo, k.key.hi);
  }
};

struct BlockMeta {
  BlockLayout layout;
  KvEncoding encoding;
  uint32_t payload_bytes = 0;  // == EncodedBytes(layout, encoding)
  uint64_t checksum = 0;       // XXH3-64 of the payload
  TenantId owner = 0;          // the tenant whose Put created it
};

// XXH3-64 of a payload (the block checksum, docs/KEYS.md).
uint64_t PayloadChecksum(const void* data, size_t len);

}  // namespace kvring
