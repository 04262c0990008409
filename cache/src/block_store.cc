#include "kvring/cache/block_store.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvring/common/status_macros.h"
#include "xxhash.h"

namespace kvring {

uint64_t PayloadChecksum(const void* data, size_t len) { return XXH3_64bits(data, len); }

// ---------------------------------------------------------------- PinnedBlock

PinnedBlock::PinnedBlock(PinnedBlock&& o) noexcept
    : store_(o.store_),
      page_(o.page_),
      data_(o.data_),
      owned_(std::move(o.owned_)),
      meta_(o.meta_),
      parent_(o.parent_) {
  o.store_ = nullptr;
  o.data_ = nullptr;
}

PinnedBlock& PinnedBlock::operator=(PinnedBlock&& o) noexcept {
  if (this != &o) {
    Release();
    store_ = o.store_;
    page_ = o.page_;
    data_ = o.data_;
    owned_ = std::move(o.owned_);  // a moved vector keeps its buffer: data_ stays right
    meta_ = o.meta_;
    parent_ = o.parent_;
    o.store_ = nullptr;
    o.data_ = nullptr;
  }
  return *this;
}

PinnedBlock::~PinnedBlock() { Release(); }

void PinnedBlock::Release() {
  if (store_ != nullptr) {
    store_->ReleaseRead(page_);
    store_ = nullptr;
  }
  data_ = nullptr;
  owned_ = {};
}

// ---------------------------------------------------------------- ScratchPage

ScratchPage& ScratchPage::operator=(ScratchPage&& o) noexcept {
  if (this != &o) {
    Release();
    store_ = o.store_;
    page_ = o.page_;
    data_ = o.data_;
    size_ = o.size_;
    tenant_ = o.tenant_;
    o.store_ = nullptr;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void ScratchPage::Release() {
  if (store_ != nullptr) store_->ReleaseScratch(page_, tenant_, size_);
  store_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

// ----------------------------------------------------------------- BlockStore

BlockStore::BlockStore(const BlockStoreOptions& options, std::unique_ptr<HostPagePool> pool,
                       std::unique_ptr<EvictionPolicy> policy, std::unique_ptr<ColdTier> cold)
    : options_(options),
      policy_name_(std::string(policy->name())),
      pool_(std::move(pool)),
      cold_(std::move(cold)),
      policy_(std::move(policy)),
      holds_(pool_->num_pages(), 0),
      page_owner_(pool_->num_pages()),
      orphaned_(pool_->num_pages(), false),
      scratch_(pool_->num_pages(), false) {}

BlockStore::~BlockStore() = default;

absl::StatusOr<std::unique_ptr<BlockStore>> BlockStore::Create(const BlockStoreOptions& options,
                                                               std::unique_ptr<ColdTier> cold) {
  HostPagePoolOptions po;
  po.page_bytes = options.page_bytes;
  po.num_pages = options.num_pages;
  po.lock_memory = options.lock_memory;
  po.prefault = options.prefault;
  po.register_memory = options.register_memory;
  po.unregister_memory = options.unregister_memory;
  KVRING_ASSIGN_OR_RETURN(std::unique_ptr<HostPagePool> pool, HostPagePool::Create(po));
  KVRING_ASSIGN_OR_RETURN(std::unique_ptr<EvictionPolicy> policy,
                          MakeEvictionPolicy(options.eviction_policy, options.num_pages));
  std::unique_ptr<BlockStore> store(new BlockStore(options, std::move(pool), std::move(policy), std::move(cold)));
  if (store->cold_ != nullptr) KVRING_RETURN_IF_ERROR(store->Recover());
  return store;
}

absl::Status BlockStore::Recover() {
  absl::MutexLock lock(&mu_);
  absl::Status inner = absl::OkStatus();
  KVRING_RETURN_IF_ERROR(cold_->Scan([&](const ColdBlockInfo& info) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto e = index_.Insert(info.key, info.parent, info.meta);
    if (!e.ok()) {
      if (!absl::IsAlreadyExists(e.status()) && inner.ok()) inner = e.status();
      return;
    }
    (*e)->in_cold = true;
    TenantUsage& u = tenants_[info.meta.owner].usage;
    ++u.owned_blocks;
    u.owned_bytes += info.meta.payload_bytes;
  }));
  return inner;
}

SlotInfo BlockStore::SlotInfoLocked(const ScopedKey& key, const BlockIndex::Entry& e) {
  SlotInfo s;
  s.fingerprint = key.key.lo ^ (key.key.hi * 0x9E3779B97F4A7C15ull) ^ key.ns;
  s.bytes = e.meta.payload_bytes;
  if (!e.parent.is_zero()) {
    const BlockIndex::Entry* p = index_.Find(ScopedKey{key.ns, e.parent});
    if (p != nullptr) s.parent_slot = p->page;
  }
  index_.ForEachChild(key, [&](const BlockKey& c) {
    mu_.AssertHeld();  // (held by the caller; the analysis does not see into the callback)
    const BlockIndex::Entry* ce = index_.Find(ScopedKey{key.ns, c});
    if (ce != nullptr && ce->page != kNoPage) s.child_slots.push_back(ce->page);
  });
  return s;
}

void BlockStore::FreePageLocked(PageId page) {
  holds_[page] = 0;
  orphaned_[page] = false;
  page_owner_[page] = ScopedKey{};
  absl::Status s = pool_->Free(page);
  (void)s;  // a page the store owns; failure would be a store bug caught by CheckInvariants
}

absl::Status BlockStore::CheckBudgetLocked(TenantId tenant, uint64_t bytes, const char* what) {
  const TenantState& t = tenants_[tenant];
  const uint64_t held = t.usage.pinned_bytes + t.usage.open_bytes;
  if (bytes > t.quota.max_pinned_bytes || held > t.quota.max_pinned_bytes - bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant ", tenant, ": ", what, " ", bytes, " more bytes would exceed its quota (", t.usage.pinned_bytes,
        " bytes pinned + ", t.usage.open_bytes, " in open sequence blocks, of ", t.quota.max_pinned_bytes, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ScratchPage> BlockStore::AcquireScratch(TenantId tenant, size_t bytes) {
  if (bytes == 0 || bytes > pool_->page_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("an open block of ", bytes, " bytes does not fit a host page of ", pool_->page_bytes()));
  }
  PageId page;
  {
    absl::MutexLock lock(&mu_);
    KVRING_RETURN_IF_ERROR(CheckBudgetLocked(tenant, bytes, "opening a sequence block of"));
    absl::StatusOr<PageId> p = AcquirePageLocked();
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat("no host memory for an open sequence block: ", p.status().message()));
    }
    page = *p;
    holds_[page] = 1;
    scratch_[page] = true;
    tenants_[tenant].usage.open_bytes += bytes;
  }
  ScratchPage s;
  s.store_ = this;
  s.page_ = page;
  s.data_ = pool_->page(page);
  s.size_ = bytes;
  s.tenant_ = tenant;
  std::memset(s.data_, 0, bytes);
  return s;
}

void BlockStore::ReleaseScratch(PageId page, TenantId tenant, size_t bytes) {
  absl::MutexLock lock(&mu_);
  scratch_[page] = false;
  FreePageLocked(page);
  tenants_[tenant].usage.open_bytes -= bytes;
}

absl::Status BlockStore::ChargeOpenBytes(TenantId tenant, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  KVRING_RETURN_IF_ERROR(CheckBudgetLocked(tenant, bytes, "opening a sequence block of"));
  tenants_[tenant].usage.open_bytes += bytes;
  return absl::OkStatus();
}

void BlockStore::RefundOpenBytes(TenantId tenant, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  uint64_t& open = tenants_[tenant].usage.open_bytes;
  open -= std::min(open, bytes);
}

void BlockStore::HoldLocked(PageId page) {
  if (holds_[page]++ == 0) policy_->Pin(page);
}

void BlockStore::ReleaseHoldLocked(PageId page) {
  if (--holds_[page] == 0) {
    if (orphaned_[page]) {
      FreePageLocked(page);
    } else {
      policy_->Unpin(page);
    }
  }
}

void BlockStore::ReleaseRead(PageId page) {
  absl::MutexLock lock(&mu_);
  ReleaseHoldLocked(page);
}

absl::Status BlockStore::DropEvictedLocked(PageId victim, const ScopedKey& vk, const BlockIndex::Entry& e) {
  policy_->Remove(victim, /*evicted=*/true);
  TenantUsage& u = tenants_[e.meta.owner].usage;
  --u.owned_blocks;
  u.owned_bytes -= e.meta.payload_bytes;
  KVRING_RETURN_IF_ERROR(index_.Erase(vk));  // (e is gone from here on)
  FreePageLocked(victim);
  ++counters_.drops;
  return absl::OkStatus();
}

absl::StatusOr<PageId> BlockStore::AcquirePageLocked() {
  const size_t max_attempts = 2 * pool_->num_pages() + 8;
  for (size_t attempt = 0; attempt < max_attempts; ++attempt) {
    absl::StatusOr<PageId> fresh = pool_->Allocate();
    if (fresh.ok()) return *fresh;
    std::optional<SlotId> v = policy_->Victim();
    if (!v.has_value()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host tier full: all ", pool_->num_pages(), " pages are pinned, being read or being written"));
    }
    const PageId victim = *v;
    const ScopedKey vk = page_owner_[victim];
    BlockIndex::Entry* e = index_.Find(vk);
    if (e == nullptr || e->page != victim || holds_[victim] != 0) {
      return absl::InternalError(absl::StrCat("eviction policy returned page ", victim, " that is not evictable"));
    }
    ++counters_.evictions;
    if (cold_ == nullptr) {  // no lower tier: drop
      KVRING_RETURN_IF_ERROR(DropEvictedLocked(victim, vk, *e));
      continue;
    }
    if (e->in_cold) {  // the cold copy is current: drop the host copy
      e->page = kNoPage;
      policy_->Remove(victim, true);
      FreePageLocked(victim);
      continue;
    }
    // Demote: hold the page so nothing reuses it, write it out unlocked.
    const ColdBlockInfo info{vk, e->parent, e->meta};
    HoldLocked(victim);
    mu_.Unlock();
    absl::Status s = cold_->Write(info, absl::MakeConstSpan(pool_->page(victim), info.meta.payload_bytes));
    mu_.Lock();
    e = index_.Find(vk);
    const bool still_ours = e != nullptr && e->page == victim;
    if (!s.ok()) {
      // The cold tier cannot take it (disk full, I/O error): the block is
      // dropped as it would be without a cold tier, so the host tier keeps
      // taking new blocks; the cold tier resumes by itself when it can.
      ++counters_.demotion_errors;
      if (!still_ours || holds_[victim] != 1) {
        ReleaseHoldLocked(victim);  // erased meanwhile, or a reader or pinner arrived
        continue;
      }
      KVRING_RETURN_IF_ERROR(DropEvictedLocked(victim, vk, *e));
      continue;
    }
    if (!still_ours) {
      // Erased while we wrote it: remove the copy we just made.
      absl::Status es = cold_->Erase(vk);
      (void)es;
      ReleaseHoldLocked(victim);
      continue;
    }
    e->in_cold = true;
    ++counters_.demotions;
    if (holds_[victim] == 1) {
      e->page = kNoPage;
      policy_->Remove(victim, true);
      FreePageLocked(victim);
    } else {
      ReleaseHoldLocked(victim);  // a reader or pinner arrived; it stays resident
    }
  }
  return absl::ResourceExhaustedError("host tier full: could not make room after repeated evictions");
}

absl::Status BlockStore::PinLocked(TenantId tenant, const ScopedKey& key, BlockIndex::Entry* e) {
  TenantState& t = tenants_[tenant];
  const uint64_t bytes = e->meta.payload_bytes;
  KVRING_RETURN_IF_ERROR(CheckBudgetLocked(tenant, bytes, "pinning"));
  KVRING_ASSIGN_OR_RETURN(bool first, index_.Pin(key, tenant));
  t.usage.pinned_bytes += bytes;
  if (first && e->page != kNoPage) HoldLocked(e->page);
  return absl::OkStatus();
}

absl::StatusOr<PutResult> BlockStore::Put(const PutArgs& a, absl::Span<const uint8_t> payload) {
  const char* why = nullptr;
  if (!a.meta.layout.IsValid(&why)) return absl::InvalidArgumentError(absl::StrCat("bad block layout: ", why));
  if (a.key.is_zero()) return absl::InvalidArgumentError("block key must not be zero");
  const uint64_t expected = EncodedBytes(a.meta.layout, a.meta.encoding);
  if (payload.size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload is ", payload.size(), " bytes but its layout and encoding need ", expected));
  }
  if (payload.size() > pool_->page_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("block of ", payload.size(), " bytes exceeds the page size of ", pool_->page_bytes()));
  }
  const uint64_t checksum = PayloadChecksum(payload.data(), payload.size());
  if (a.meta.checksum != 0 && a.meta.checksum != checksum) {
    return absl::DataLossError(
        absl::StrCat("payload checksum mismatch for block ", a.key.ToHex(), ": the bytes were corrupted on the way"));
  }
  BlockMeta meta = a.meta;
  meta.payload_bytes = static_cast<uint32_t>(payload.size());
  meta.checksum = checksum;
  meta.owner = a.tenant;
  const ScopedKey sk{a.ns, a.key};

  absl::MutexLock lock(&mu_);
  ++counters_.puts;
  auto dedup = [&](BlockIndex::Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<PutResult> {
    if (e->meta.payload_bytes != meta.payload_bytes || !(e->meta.layout == meta.layout)) {
      return absl::AlreadyExistsError(absl::StrCat("block ", a.key.ToHex(), " is held with another layout"));
    }
    if (a.pin) KVRING_RETURN_IF_ERROR(PinLocked(a.tenant, sk, e));
    if (e->page != kNoPage) policy_->Touch(e->page);
    ++counters_.put_dedups;
    return PutResult{false};
  };
  if (BlockIndex::Entry* e = index_.Find(sk)) return dedup(e);
  auto quota_ok = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (!a.pin) return absl::OkStatus();
    return CheckBudgetLocked(a.tenant, meta.payload_bytes, "pinning");
  };
  KVRING_RETURN_IF_ERROR(quota_ok());
  KVRING_ASSIGN_OR_RETURN(const PageId page, AcquirePageLocked());
  // The page is ours alone (not in the index or the policy): copy unlocked.
  mu_.Unlock();
  std::memcpy(pool_->page(page), payload.data(), payload.size());
  absl::Status through = absl::OkStatus();
  if (options_.cold_write_through && cold_ != nullptr) {
    through = cold_->Write(ColdBlockInfo{sk, a.parent, meta}, absl::MakeConstSpan(pool_->page(page), payload.size()));
  }
  mu_.Lock();
  if (!through.ok()) {
    FreePageLocked(page);
    return absl::Status(through.code(), absl::StrCat("writing block ", a.key.ToHex(),
                                                     " through to the cold tier: ", through.message()));
  }
  if (BlockIndex::Entry* e = index_.Find(sk)) {  // a concurrent Put won
    FreePageLocked(page);
    return dedup(e);
  }
  if (absl::Status q = quota_ok(); !q.ok()) {
    FreePageLocked(page);
    return q;
  }
  absl::StatusOr<BlockIndex::Entry*> ins = index_.Insert(sk, a.parent, meta);
  if (!ins.ok()) {
    FreePageLocked(page);
    return ins.status();
  }
  BlockIndex::Entry* e = *ins;
  e->page = page;
  e->in_cold = options_.cold_write_through && cold_ != nullptr;
  page_owner_[page] = sk;
  holds_[page] = 0;
  policy_->Admit(page, SlotInfoLocked(sk, *e));
  TenantUsage& u = tenants_[a.tenant].usage;
  ++u.owned_blocks;
  u.owned_bytes += meta.payload_bytes;
  if (a.pin) KVRING_RETURN_IF_ERROR(PinLocked(a.tenant, sk, e));
  return PutResult{true};
}

size_t BlockStore::LookupPrefix(NamespaceId ns, absl::Span<const BlockKey> keys) {
  absl::MutexLock lock(&mu_);
  ++counters_.lookups;
  return index_.LookupPrefix(ns, keys);
}

std::vector<bool> BlockStore::Contains(NamespaceId ns, absl::Span<const BlockKey> keys) {
  absl::MutexLock lock(&mu_);
  ++counters_.lookups;
  std::vector<bool> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) out[i] = index_.Find(ScopedKey{ns, keys[i]}) != nullptr;
  return out;
}

bool BlockStore::InMemoryOrAbsent(NamespaceId ns, absl::Span<const BlockKey> keys) {
  absl::MutexLock lock(&mu_);
  for (const BlockKey& k : keys) {
    const BlockIndex::Entry* e = index_.Find(ScopedKey{ns, k});
    if (e != nullptr && e->page == kNoPage) return false;
  }
  return true;
}

BlockStore::TierCounts BlockStore::CountTiers(NamespaceId ns, absl::Span<const BlockKey> keys) {
  TierCounts t;
  absl::MutexLock lock(&mu_);
  for (const BlockKey& k : keys) {
    const BlockIndex::Entry* e = index_.Find(ScopedKey{ns, k});
    if (e == nullptr) continue;
    if (e->page == kNoPage) {
      ++t.cold;
    } else {
      ++t.host;
    }
  }
  return t;
}

absl::StatusOr<PinnedBlock> BlockStore::Acquire(NamespaceId ns, const BlockKey& key) {
  const ScopedKey sk{ns, key};
  absl::MutexLock lock(&mu_);
  auto handle = [&](BlockIndex::Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    HoldLocked(e->page);
    policy_->Touch(e->page);
    PinnedBlock b;
    b.store_ = this;
    b.page_ = e->page;
    b.data_ = pool_->page(e->page);
    b.meta_ = e->meta;
    b.parent_ = e->parent;
    return b;
  };
  BlockIndex::Entry* e = index_.Find(sk);
  if (e == nullptr) {
    ++counters_.misses;
    return absl::NotFoundError(absl::StrCat("block ", key.ToHex(), " not held"));
  }
  ++counters_.hits;
  if (e->page != kNoPage) return handle(e);
  if (cold_ == nullptr || !e->in_cold) return absl::InternalError("indexed block has no copy in any tier");

  // Promote from the cold tier.
  ColdBlockInfo info;
  std::vector<uint8_t> buf;
  mu_.Unlock();
  absl::Status rs = cold_->Read(sk, &info, &buf);
  mu_.Lock();
  if (!rs.ok()) {
    return absl::Status(rs.code(), absl::StrCat("reading block ", key.ToHex(), " from the cold tier: ", rs.message()));
  }
  e = index_.Find(sk);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("block ", key.ToHex(), " was erased"));
  if (e->page != kNoPage) return handle(e);
  if (buf.size() != e->meta.payload_bytes || info.meta.checksum != e->meta.checksum ||
      PayloadChecksum(buf.data(), buf.size()) != e->meta.checksum) {
    return absl::DataLossError(absl::StrCat("block ", key.ToHex(), " from the cold tier fails its checksum"));
  }
  absl::StatusOr<PageId> free_page = AcquirePageLocked();
  if (absl::IsResourceExhausted(free_page.status())) {
    // Every host page is held by reads in flight: this read gets a copy of
    // its own and the block stays cold.
    ++counters_.unpromoted_reads;
    PinnedBlock b;
    b.owned_ = std::move(buf);
    b.data_ = b.owned_.data();
    b.meta_ = e->meta;
    b.parent_ = e->parent;
    return b;
  }
  if (!free_page.ok()) return free_page.status();
  const PageId page = *free_page;
  e = index_.Find(sk);
  if (e == nullptr || e->page != kNoPage) {
    FreePageLocked(page);
    if (e == nullptr) return absl::NotFoundError(absl::StrCat("block ", key.ToHex(), " was erased"));
    return handle(e);
  }
  std::memcpy(pool_->page(page), buf.data(), buf.size());
  e->page = page;
  page_owner_[page] = sk;
  holds_[page] = 0;
  policy_->Admit(page, SlotInfoLocked(sk, *e));
  if (e->pins > 0) HoldLocked(page);
  ++counters_.promotions;
  ++counters_.cold_hits;
  return handle(e);
}

absl::Status BlockStore::Read(NamespaceId ns, const BlockKey& key, absl::Span<uint8_t> dst, BlockMeta* meta) {
  KVRING_ASSIGN_OR_RETURN(PinnedBlock b, Acquire(ns, key));
  if (dst.size() < b.meta().payload_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("destination of ", dst.size(), " bytes is smaller than the block (", b.meta().payload_bytes, ")"));
  }
  std::memcpy(dst.data(), b.payload().data(), b.payload().size());
  if (meta != nullptr) *meta = b.meta();
  return absl::OkStatus();
}

absl::Status BlockStore::Pin(TenantId tenant, NamespaceId ns, const BlockKey& key) {
  const ScopedKey sk{ns, key};
  absl::MutexLock lock(&mu_);
  BlockIndex::Entry* e = index_.Find(sk);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("block ", key.ToHex(), " not held"));
  return PinLocked(tenant, sk, e);
}

absl::Status BlockStore::Unpin(TenantId tenant, NamespaceId ns, const BlockKey& key) {
  const ScopedKey sk{ns, key};
  absl::MutexLock lock(&mu_);
  BlockIndex::Entry* e = index_.Find(sk);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("block ", key.ToHex(), " not held"));
  return UnpinLocked(tenant, sk, e);
}

absl::Status BlockStore::UnpinLocked(TenantId tenant, const ScopedKey& key, BlockIndex::Entry* e) {
  KVRING_ASSIGN_OR_RETURN(bool last, index_.Unpin(key, tenant));
  tenants_[tenant].usage.pinned_bytes -= e->meta.payload_bytes;
  if (last && e->page != kNoPage) ReleaseHoldLocked(e->page);
  return absl::OkStatus();
}

absl::Status BlockStore::Erase(NamespaceId ns, const BlockKey& key) {
  const ScopedKey sk{ns, key};
  absl::MutexLock lock(&mu_);
  BlockIndex::Entry* e = index_.Find(sk);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("block ", key.ToHex(), " not held"));
  if (e->pins > 0) return absl::FailedPreconditionError(absl::StrCat("block ", key.ToHex(), " is pinned"));
  return EraseLocked(sk, e);
}

absl::StatusOr<uint64_t> BlockStore::PurgeNamespaces(const absl::flat_hash_set<NamespaceId>& namespaces) {
  if (namespaces.empty()) return uint64_t{0};
  std::vector<ScopedKey> keys;
  {
    absl::MutexLock lock(&mu_);
    index_.ForEach([&](const ScopedKey& k, const BlockIndex::Entry&) {
      if (namespaces.contains(k.ns)) keys.push_back(k);
    });
  }
  // In batches, so that requests are served in between.
  constexpr size_t kBatch = 256;
  uint64_t purged = 0;
  for (size_t b = 0; b < keys.size(); b += kBatch) {
    absl::MutexLock lock(&mu_);
    for (size_t i = b; i < std::min(keys.size(), b + kBatch); ++i) {
      BlockIndex::Entry* e = index_.Find(keys[i]);
      if (e == nullptr) continue;
      // Pins die with the namespace.
      while (e->pins > 0) KVRING_RETURN_IF_ERROR(UnpinLocked(e->pins_by_tenant.front().first, keys[i], e));
      KVRING_RETURN_IF_ERROR(EraseLocked(keys[i], e));
      ++purged;
    }
  }
  return purged;
}

absl::Status BlockStore::EraseLocked(const ScopedKey& sk, BlockIndex::Entry* e) {
  const PageId page = e->page;
  const bool in_cold = e->in_cold;
  const BlockMeta meta = e->meta;
  if (in_cold) KVRING_RETURN_IF_ERROR(cold_->Erase(sk));
  KVRING_RETURN_IF_ERROR(index_.Erase(sk));
  if (page != kNoPage) {
    policy_->Remove(page, /*evicted=*/false);
    if (holds_[page] == 0)
      FreePageLocked(page);
    else
      orphaned_[page] = true;
  }
  TenantUsage& u = tenants_[meta.owner].usage;
  --u.owned_blocks;
  u.owned_bytes -= meta.payload_bytes;
  return absl::OkStatus();
}

void BlockStore::SetTenantQuota(TenantId tenant, const TenantQuota& quota) {
  absl::MutexLock lock(&mu_);
  tenants_[tenant].quota = quota;
}

TenantUsage BlockStore::GetTenantUsage(TenantId tenant) {
  absl::MutexLock lock(&mu_);
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? TenantUsage{} : it->second.usage;
}

BlockStoreStats BlockStore::stats() {
  absl::MutexLock lock(&mu_);
  BlockStoreStats s = counters_;
  s.blocks = index_.size();
  index_.ForEach([&](const ScopedKey&, const BlockIndex::Entry& e) {
    if (e.page != kNoPage)
      ++s.host_blocks;
    else
      ++s.cold_only_blocks;
    if (e.pins > 0) ++s.pinned_blocks;
  });
  s.free_pages = pool_->free_pages();
  for (bool x : scratch_) s.scratch_pages += x;
  s.num_pages = pool_->num_pages();
  s.page_bytes = pool_->page_bytes();
  return s;
}

absl::Status BlockStore::CheckInvariants() {
  absl::MutexLock lock(&mu_);
  KVRING_RETURN_IF_ERROR(index_.CheckInvariants());
  size_t host = 0;
  absl::Status bad = absl::OkStatus();
  index_.ForEach([&](const ScopedKey& k, const BlockIndex::Entry& e) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (e.page == kNoPage) {
      if (!e.in_cold && bad.ok()) bad = absl::InternalError(absl::StrCat("block ", k.key.ToHex(), " in no tier"));
      return;
    }
    ++host;
    if (!(page_owner_[e.page] == k) && bad.ok()) bad = absl::InternalError("page owner mismatch");
    if (e.pins > 0 && holds_[e.page] == 0 && bad.ok()) bad = absl::InternalError("pinned block's page has no hold");
  });
  KVRING_RETURN_IF_ERROR(bad);
  size_t orphans = 0, scratch = 0;
  for (bool o : orphaned_) orphans += o;
  for (bool x : scratch_) scratch += x;
  const size_t used = pool_->num_pages() - pool_->free_pages();
  if (used != host + orphans + scratch) {
    return absl::InternalError(
        absl::StrCat("pages in use ", used, " != host blocks ", host, " + orphans ", orphans, " + scratch ", scratch));
  }
  return absl::OkStatus();
}

}  // namespace kvring
