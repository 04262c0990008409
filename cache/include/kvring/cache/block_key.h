// BlockKey: the 128-bit content address of a KV block, and the chained hash
// that computes it. The exact bytes hashed are specified in docs/KEYS.md; the
// spec is deterministic across processes, machines, languages and restarts.
//
//   key_{-1} = XXH3-128("kvring/v1\0" || ctx)            (the root, per context)
//   key_i    = XXH3-128(key_{i-1} || u32 n || tokens_i || ctx)
//   ctx      = str(model_id) || str(namespace) || layout
//
// Two tenants hashing the same tokens get different keys unless both hash
// under the same (shared) namespace. BlockKeyHasher is immutable after
// construction and safe to share between threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvring/layout/block_layout.h"

namespace kvring {

struct BlockKey {
  uint64_t lo = 0;
  uint64_t hi = 0;

  bool is_zero() const { return lo == 0 && hi == 0; }
  // 32 lowercase hex digits, `hi` first.
  std::string ToHex() const;
  static absl::StatusOr<BlockKey> FromHex(std::string_view hex);

  friend bool operator==(const BlockKey& a, const BlockKey& b) { return a.lo == b.lo && a.hi == b.hi; }
  friend bool operator!=(const BlockKey& a, const BlockKey& b) { return !(a == b); }
  friend bool operator<(const BlockKey& a, const BlockKey& b) { return a.hi != b.hi ? a.hi < b.hi : a.lo < b.lo; }
  template <typename H>
  friend H AbslHashValue(H h, const BlockKey& k) {
    return H::combine(std::move(h), k.lo, k.hi);
  }
};

// A 64-bit id for a namespace name (XXH3-64 of the name, docs/KEYS.md). The
// store scopes every block by it, so a key computed under another namespace
// never matches.
using NamespaceId = uint64_t;
NamespaceId NamespaceIdOf(std::string_view namespace_name);

// The key of block `index` of attention sequence `sequence_id` when a node
// builds the block itself from appended K/V (decode in place): the daemon
// does not see token ids, so the key names the block's place instead of its
// tokens (docs/KEYS.md, "Sequence blocks"). Every replica computes the same
// key. Sequence ids are unique within a namespace.
BlockKey SequenceBlockKey(NamespaceId ns, std::string_view sequence_id, uint64_t index, const BlockLayout& layout);

// Keys of one (model, namespace, layout) context.
class BlockKeyHasher {
 public:
  BlockKeyHasher(std::string model_id, std::string namespace_name, BlockLayout layout);

  const std::string& model_id() const { return model_id_; }
  const std::string& namespace_name() const { return namespace_; }
  NamespaceId namespace_id() const { return namespace_id_; }
  const BlockLayout& layout() const { return layout_; }

  // key_{-1}: the parent of the first block of every sequence.
  BlockKey Root() const { return root_; }
  // The key of a block of `tokens` whose parent is `parent`.
  BlockKey Next(const BlockKey& parent, absl::Span<const uint32_t> tokens) const;
  // Keys of the full blocks of `tokens` (a trailing partial block gets none),
  // starting from `parent` (Root() for a sequence start).
  std::vector<BlockKey> Chain(absl::Span<const uint32_t> tokens) const { return ChainFrom(root_, tokens); }
  std::vector<BlockKey> ChainFrom(const BlockKey& parent, absl::Span<const uint32_t> tokens) const;

 private:
  std::string model_id_;
  std::string namespace_;
  NamespaceId namespace_id_;
  BlockLayout layout_;
  std::string ctx_;  // the serialized context suffix
  BlockKey root_;
};

}  // namespace kvring
