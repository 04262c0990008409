#include "kvring/cache/block_index.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvring {

uint32_t BlockIndex::Entry::TenantPins(TenantId t) const {
  for (const auto& [tenant, n] : pins_by_tenant) {
    if (tenant == t) return n;
  }
  return 0;
}

BlockIndex::Entry* BlockIndex::Find(const ScopedKey& key) {
  auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : &it->second;
}

const BlockIndex::Entry* BlockIndex::Find(const ScopedKey& key) const {
  auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : &it->second;
}

absl::StatusOr<BlockIndex::Entry*> BlockIndex::Insert(const ScopedKey& key, const BlockKey& parent,
                                                      const BlockMeta& meta) {
  if (key.key.is_zero()) return absl::InvalidArgumentError("block key must not be zero");
  if (parent == key.key) return absl::InvalidArgumentError("a block cannot be its own parent");
  if (entries_.contains(key)) return absl::AlreadyExistsError(absl::StrCat("block ", key.key.ToHex(), " already held"));
  // A cycle needs the new block to have children held here already (put
  // before it) and to be an ancestor of its own parent: walk up from the
  // parent only then (a chain put in order never walks).
  if (!parent.is_zero() && children_.contains(key)) {
    BlockKey p = parent;
    for (size_t steps = 0; !p.is_zero() && steps <= entries_.size(); ++steps) {
      const Entry* pe = Find(ScopedKey{key.ns, p});
      if (pe == nullptr) break;
      if (pe->parent == key.key) {
        return absl::InvalidArgumentError(absl::StrCat("block ", key.key.ToHex(), " with parent ", parent.ToHex(),
                                                       " would close a cycle of parent links"));
      }
      p = pe->parent;
    }
  }
  auto [it, inserted] = entries_.try_emplace(key);
  Entry& e = it->second;
  e.meta = meta;
  e.parent = parent;
  if (parent.is_zero()) {
    e.anchored = true;
  } else {
    children_[ScopedKey{key.ns, parent}].push_back(key.key);
    const Entry* p = Find(ScopedKey{key.ns, parent});
    e.anchored = p != nullptr && p->anchored;
  }
  if (e.anchored) AnchorSubtree(key);
  return Find(key);
}

absl::Status BlockIndex::Erase(const ScopedKey& key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return absl::NotFoundError(absl::StrCat("block ", key.key.ToHex(), " not held"));
  if (it->second.pins > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", key.key.ToHex(), " is pinned (", it->second.pins, " pins)"));
  }
  const BlockKey parent = it->second.parent;
  const bool was_anchored = it->second.anchored;
  entries_.erase(it);
  if (!parent.is_zero()) {
    auto cit = children_.find(ScopedKey{key.ns, parent});
    if (cit != children_.end()) {
      auto& v = cit->second;
      v.erase(std::remove(v.begin(), v.end(), key.key), v.end());
      if (v.empty()) children_.erase(cit);
    }
  }
  if (was_anchored) UnanchorSubtree(key);
  return absl::OkStatus();
}

void BlockIndex::AnchorSubtree(const ScopedKey& root) {
  std::vector<BlockKey> stack{root.key};
  while (!stack.empty()) {
    const BlockKey k = stack.back();
    stack.pop_back();
    auto cit = children_.find(ScopedKey{root.ns, k});
    if (cit == children_.end()) continue;
    for (const BlockKey& c : cit->second) {
      Entry* ce = Find(ScopedKey{root.ns, c});
      if (ce != nullptr && !ce->anchored) {
        ce->anchored = true;
        stack.push_back(c);
      }
    }
  }
}

void BlockIndex::UnanchorSubtree(const ScopedKey& root) {
  std::vector<BlockKey> stack{root.key};
  while (!stack.empty()) {
    const BlockKey k = stack.back();
    stack.pop_back();
    auto cit = children_.find(ScopedKey{root.ns, k});
    if (cit == children_.end()) continue;
    for (const BlockKey& c : cit->second) {
      Entry* ce = Find(ScopedKey{root.ns, c});
      if (ce != nullptr && ce->anchored) {
        ce->anchored = false;
        stack.push_back(c);
      }
    }
  }
}

absl::StatusOr<bool> BlockIndex::Pin(const ScopedKey& key, TenantId tenant) {
  Entry* e = Find(key);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("block ", key.key.ToHex(), " not held"));
  bool found = false;
  for (auto& [t, n] : e->pins_by_tenant) {
    if (t == tenant) {
      ++n;
      found = true;
      break;
    }
  }
  if (!found) e->pins_by_tenant.emplace_back(tenant, 1);
  return ++e->pins == 1;
}

absl::StatusOr<bool> BlockIndex::Unpin(const ScopedKey& key, TenantId tenant) {
  Entry* e = Find(key);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("block ", key.key.ToHex(), " not held"));
  for (auto it = e->pins_by_tenant.begin(); it != e->pins_by_tenant.end(); ++it) {
    if (it->first == tenant) {
      if (--it->second == 0) e->pins_by_tenant.erase(it);
      return --e->pins == 0;
    }
  }
  return absl::FailedPreconditionError(
      absl::StrCat("block ", key.key.ToHex(), " is not pinned by tenant ", tenant, " (double unpin?)"));
}

size_t BlockIndex::LookupPrefix(NamespaceId ns, absl::Span<const BlockKey> keys) const {
  // Binary search for the first key that is not (held and anchored).
  size_t lo = 0, hi = keys.size();
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    const Entry* e = Find(ScopedKey{ns, keys[mid]});
    if (e != nullptr && e->anchored)
      lo = mid + 1;
    else
      hi = mid;
  }
  // Extend over held blocks whose own ancestors are missing elsewhere.
  while (lo < keys.size() && Find(ScopedKey{ns, keys[lo]}) != nullptr) ++lo;
  return lo;
}

size_t BlockIndex::LookupPrefixLinear(NamespaceId ns, absl::Span<const BlockKey> keys) const {
  size_t i = 0;
  while (i < keys.size() && Find(ScopedKey{ns, keys[i]}) != nullptr) ++i;
  return i;
}

size_t BlockIndex::HeldChildren(const ScopedKey& key) const {
  auto it = children_.find(key);
  return it == children_.end() ? 0 : it->second.size();
}

absl::Status BlockIndex::CheckInvariants() const {
  for (const auto& [k, e] : entries_) {
    // anchored <=> every ancestor held.
    bool all_held = true;
    BlockKey p = e.parent;
    size_t steps = 0;
    while (!p.is_zero()) {
      const Entry* pe = Find(ScopedKey{k.ns, p});
      if (pe == nullptr) {
        all_held = false;
        break;
      }
      p = pe->parent;
      if (++steps > entries_.size()) return absl::InternalError("parent cycle in index");
    }
    if (all_held != e.anchored) {
      return absl::InternalError(
          absl::StrCat("block ", k.key.ToHex(), " anchored=", e.anchored, " but ancestors held=", all_held));
    }
    uint32_t sum = 0;
    for (const auto& [t, n] : e.pins_by_tenant) sum += n;
    if (sum != e.pins) return absl::InternalError("pin counts disagree");
  }
  return absl::OkStatus();
}

}  // namespace kvring
