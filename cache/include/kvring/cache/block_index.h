// BlockIndex: scoped key -> block entry, with tenant pins and prefix lookup.
//
// The index records every block a store holds in any tier (host page or cold
// tier), the block's parent key (zero for the first block of a sequence), and
// whether the block is *anchored*: all of its ancestors are held here too.
// Anchoring makes LookupPrefix O(log n) probes instead of n: for keys that are
// an ordered subsequence of one chain (what every kvring client sends), "held
// and anchored" is monotone along the chain, so a binary search finds its
// frontier; a linear scan then extends over any held-but-unanchored tail, so
// the answer is exactly the length of the longest held prefix.
// LookupPrefixLinear() is the plain scan, kept as the reference.
//
// Thread safety: none (thread-compatible). BlockStore guards it with its
// mutex. Entry pointers returned by Find() stay valid only until the next
// Insert or Erase.
#pragma once

#include <cstdint>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvring/cache/block_meta.h"
#include "kvring/cache/page_pool.h"

namespace kvring {

class BlockIndex {
 public:
  struct Entry {
    BlockMeta meta;
    BlockKey parent;        // zero: first block of a sequence
    PageId page = kNoPage;  // host-tier copy, if any
    bool in_cold = false;   // a copy is in the cold tier
    bool anchored = false;  // every ancestor is in this index (maintained)
    uint32_t pins = 0;      // sum of tenant pins
    absl::InlinedVector<std::pair<TenantId, uint32_t>, 1> pins_by_tenant;

    uint32_t TenantPins(TenantId t) const;
  };

  BlockIndex() = default;
  BlockIndex(const BlockIndex&) = delete;
  BlockIndex& operator=(const BlockIndex&) = delete;

  Entry* Find(const ScopedKey& key);
  const Entry* Find(const ScopedKey& key) const;
  size_t size() const { return entries_.size(); }

  // Adds `key` (ALREADY_EXISTS if present; INVALID_ARGUMENT for a zero key or
  // a block that names itself as parent). Anchors it and any descendants
  // that become anchored through it.
  absl::StatusOr<Entry*> Insert(const ScopedKey& key, const BlockKey& parent, const BlockMeta& meta);
  // Removes `key` (NOT_FOUND; FAILED_PRECONDITION while a tenant pins it).
  // Descendants lose their anchor.
  absl::Status Erase(const ScopedKey& key);

  // Adds one pin by `tenant`. Returns true when the entry went from 0 pins to
  // 1. NOT_FOUND for an unknown key.
  absl::StatusOr<bool> Pin(const ScopedKey& key, TenantId tenant);
  // Removes one pin by `tenant`. Returns true when the entry's last pin went.
  // FAILED_PRECONDITION when `tenant` holds no pin on it (double unpin).
  absl::StatusOr<bool> Unpin(const ScopedKey& key, TenantId tenant);

  // Length of the longest prefix of `keys` held in namespace `ns` (see the
  // class comment for the contract on `keys`).
  size_t LookupPrefix(NamespaceId ns, absl::Span<const BlockKey> keys) const;
  size_t LookupPrefixLinear(NamespaceId ns, absl::Span<const BlockKey> keys) const;

  // Number of held children of `key` (blocks naming it as parent).
  size_t HeldChildren(const ScopedKey& key) const;
  // Calls fn(child key) for each held child of `key`.
  template <typename Fn>
  void ForEachChild(const ScopedKey& key, Fn&& fn) const {
    auto it = children_.find(key);
    if (it == children_.end()) return;
    for (const BlockKey& c : it->second) fn(c);
  }

  // Checks the anchoring invariant over the whole index (tests; O(n * depth)).
  absl::Status CheckInvariants() const;

  template <typename Fn>
  void ForEach(Fn&& fn) const {
    for (const auto& [k, e] : entries_) fn(k, e);
  }

 private:
  void AnchorSubtree(const ScopedKey& root);
  void UnanchorSubtree(const ScopedKey& root);

  absl::flat_hash_map<ScopedKey, Entry> entries_;
  // parent -> held children, whether or not the parent itself is held.
  absl::flat_hash_map<ScopedKey, absl::InlinedVector<BlockKey, 1>> children_;
};

}  // namespace kvring
