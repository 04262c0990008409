// BlockStore: the paged KV-block store of one node.
//
// Blocks live in host pages (HostPagePool) and, when a ColdTier is given,
// are demoted there on eviction and promoted back on a hit. Each block is
// filed under a ScopedKey (namespace + BlockKey); lookups never cross
// namespaces. Pins are per tenant, with per-tenant quotas on pinned bytes;
// only blocks nobody pins or reads are evicted, in the order the
// EvictionPolicy chooses.
//
// Thread safety: every public method is safe to call from many threads.
// `mu_` guards the index, the policy, the per-page hold counts, the page
// owners and the tenant table. Payload copies (Put's copy in, Read's copy
// out) and cold-tier I/O run outside `mu_`: a page being written is not yet
// in the index, and a page being read or demoted carries a hold that keeps it
// from being evicted or reused.
//
// Errors: INVALID_ARGUMENT for malformed requests, NOT_FOUND for unknown
// keys, RESOURCE_EXHAUSTED for quota or capacity, FAILED_PRECONDITION for
// pin misuse, DATA_LOSS for a checksum mismatch, and the cold tier's own
// status when demotion fails. On any error the store is unchanged.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kvring/cache/block_index.h"
#include "kvring/cache/cold_tier.h"
#include "kvring/cache/eviction_policy.h"
#include "kvring/cache/host_page_pool.h"

namespace kvring {

struct BlockStoreOptions {
  // Bytes per page = the largest block payload accepted. Default: 256 KiB.
  size_t page_bytes = 256 << 10;
  // Host-tier capacity in pages. Default: 1024.
  size_t num_pages = 1024;
  // Eviction policy name (MakeEvictionPolicy). Default: "lru".
  std::string eviction_policy = "lru";
  // mlock the host pages. Default: false.
  bool lock_memory = false;
  // With a cold tier: also write every new block to it before Put returns,
  // so a restart recovers every acknowledged block (costs the cold write on
  // the Put path). Default: false (blocks reach the cold tier on eviction).
  bool cold_write_through = false;
  // Fault the host pages in at Create() (HostPagePoolOptions::prefault).
  // Default: true.
  bool prefault = true;
  // Optional pinning hook for the host region (cudaHostRegister).
  std::function<absl::Status(void*, size_t)> register_memory;
  std::function<void(void*)> unregister_memory;
};

// One budget per tenant: the bytes it pins in the store and the bytes of its
// open sequence blocks (held outside the store's index by an attention
// backend: ScratchPage, ChargeOpenBytes) count together against it.
struct TenantQuota {
  // Most bytes the tenant may hold at once: pinned blocks plus open
  // sequence blocks. Default: unlimited.
  uint64_t max_pinned_bytes = UINT64_MAX;
};

struct TenantUsage {
  uint64_t pinned_bytes = 0;
  uint64_t open_bytes = 0;    // open sequence blocks (charged by attention backends)
  uint64_t owned_blocks = 0;  // blocks this tenant put, in any tier
  uint64_t owned_bytes = 0;
};

struct BlockStoreStats {
  uint64_t blocks = 0;  // held in any tier
  uint64_t host_blocks = 0;
  uint64_t cold_only_blocks = 0;
  uint64_t pinned_blocks = 0;
  uint64_t free_pages = 0;
  uint64_t num_pages = 0;
  uint64_t page_bytes = 0;
  uint64_t puts = 0, put_dedups = 0, hits = 0, misses = 0, cold_hits = 0;
  uint64_t evictions = 0, demotions = 0, drops = 0, promotions = 0, demotion_errors = 0;
  uint64_t lookups = 0;
  uint64_t unpromoted_reads = 0;  // cold reads served from a copy: every host page was held
  uint64_t scratch_pages = 0;     // host pages lent out as ScratchPages (open sequence blocks)
};

struct PutArgs {
  TenantId tenant = 0;
  NamespaceId ns = 0;
  BlockKey key;
  BlockKey parent;   // zero for the first block of a sequence
  BlockMeta meta;    // layout, encoding, payload_bytes; checksum 0 = compute
  bool pin = false;  // leave it pinned by `tenant` (charged to its quota)
};

struct PutResult {
  bool inserted = false;  // false: the block was already held (deduplicated)
};

class BlockStore;

// A read hold on a block's host copy: the payload stays valid and the block
// unevictable until the handle is destroyed. Movable, not copyable. Must not
// outlive its store. A block read from the cold tier while every host page
// is held by other reads comes as a copy of its own (no page held), so a
// read never needs all of its blocks resident at once.
class PinnedBlock {
 public:
  PinnedBlock() = default;
  PinnedBlock(PinnedBlock&& other) noexcept;
  PinnedBlock& operator=(PinnedBlock&& other) noexcept;
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
  ~PinnedBlock();

  bool valid() const { return store_ != nullptr || data_ != nullptr; }
  const BlockMeta& meta() const { return meta_; }
  const BlockKey& parent() const { return parent_; }
  absl::Span<const uint8_t> payload() const { return {data_, meta_.payload_bytes}; }
  void Release();

 private:
  friend class BlockStore;
  BlockStore* store_ = nullptr;
  PageId page_ = kNoPage;
  const uint8_t* data_ = nullptr;
  std::vector<uint8_t> owned_;  // the payload, when no page holds it
  BlockMeta meta_;
  BlockKey parent_;
};

// A host page lent out of the store's host tier for bytes that live outside
// its index (an open sequence block being filled by appends), charged to a
// tenant's budget. The page counts against the host tier like a block (it
// was made room for by eviction) until the ScratchPage is destroyed, which
// gives the page and the charge back. Movable, not copyable; must not
// outlive its store. Its bytes are the holder's alone (not thread-safe).
class ScratchPage {
 public:
  ScratchPage() = default;
  ScratchPage(ScratchPage&& other) noexcept { *this = std::move(other); }
  ScratchPage& operator=(ScratchPage&& other) noexcept;
  ScratchPage(const ScratchPage&) = delete;
  ScratchPage& operator=(const ScratchPage&) = delete;
  ~ScratchPage() { Release(); }
  bool valid() const { return store_ != nullptr; }
  absl::Span<uint8_t> bytes() const { return {data_, size_}; }
  void Release();

 private:
  friend class BlockStore;
  BlockStore* store_ = nullptr;
  PageId page_ = kNoPage;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  TenantId tenant_ = 0;
};

class BlockStore {
 public:
  // `cold` (optional) becomes owned by the store. When given, Create() scans
  // it and indexes every block it holds (recovery after a restart).
  static absl::StatusOr<std::unique_ptr<BlockStore>> Create(const BlockStoreOptions& options,
                                                            std::unique_ptr<ColdTier> cold = nullptr);
  ~BlockStore();
  BlockStore(const BlockStore&) = delete;
  BlockStore& operator=(const BlockStore&) = delete;

  absl::StatusOr<PutResult> Put(const PutArgs& args, absl::Span<const uint8_t> payload) ABSL_LOCKS_EXCLUDED(mu_);
  // Longest held prefix of `keys` (BlockIndex::LookupPrefix's contract).
  size_t LookupPrefix(NamespaceId ns, absl::Span<const BlockKey> keys) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether each key is held (any order, any chains).
  std::vector<bool> Contains(NamespaceId ns, absl::Span<const BlockKey> keys) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether Acquire of every key would stay in host memory: each is in the
  // host tier or not held at all (none needs a read from the cold tier). A
  // hint: a block may be demoted right after.
  bool InMemoryOrAbsent(NamespaceId ns, absl::Span<const BlockKey> keys) ABSL_LOCKS_EXCLUDED(mu_);
  // How many of `keys` are in the host tier and how many only in the cold
  // tier (the rest are not held). A snapshot.
  struct TierCounts {
    uint64_t host = 0, cold = 0;
  };
  TierCounts CountTiers(NamespaceId ns, absl::Span<const BlockKey> keys) ABSL_LOCKS_EXCLUDED(mu_);
  // A read hold on the block, promoting it from the cold tier if needed.
  absl::StatusOr<PinnedBlock> Acquire(NamespaceId ns, const BlockKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies the payload into `dst` (INVALID_ARGUMENT if too small).
  absl::Status Read(NamespaceId ns, const BlockKey& key, absl::Span<uint8_t> dst, BlockMeta* meta)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Pin(TenantId tenant, NamespaceId ns, const BlockKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Unpin(TenantId tenant, NamespaceId ns, const BlockKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the block from every tier (FAILED_PRECONDITION while pinned).
  absl::Status Erase(NamespaceId ns, const BlockKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // Erases every block of the given namespaces from every tier, pinned or
  // not (a deleted tenant's namespace); returns how many. Works in batches,
  // taking the store's lock for each, so requests are served in between.
  absl::StatusOr<uint64_t> PurgeNamespaces(const absl::flat_hash_set<NamespaceId>& namespaces) ABSL_LOCKS_EXCLUDED(mu_);

  // A zero-filled host page of `bytes` (<= page_bytes) for `tenant`'s open
  // sequence block: room is made by eviction as for a Put, and `bytes` are
  // charged to the tenant's budget. RESOURCE_EXHAUSTED when the tenant's
  // budget or the host tier (every page pinned, read or lent) is spent.
  absl::StatusOr<ScratchPage> AcquireScratch(TenantId tenant, size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Charges (or gives back) open-block bytes held elsewhere (a GPU backend's
  // HBM pages) to the tenant's budget; RESOURCE_EXHAUSTED over it.
  absl::Status ChargeOpenBytes(TenantId tenant, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void RefundOpenBytes(TenantId tenant, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  void SetTenantQuota(TenantId tenant, const TenantQuota& quota) ABSL_LOCKS_EXCLUDED(mu_);
  TenantUsage GetTenantUsage(TenantId tenant) ABSL_LOCKS_EXCLUDED(mu_);
  BlockStoreStats stats() ABSL_LOCKS_EXCLUDED(mu_);
  ColdTier* cold_tier() const { return cold_.get(); }
  size_t page_bytes() const { return pool_->page_bytes(); }
  const std::string& eviction_policy_name() const { return policy_name_; }

  // Verifies index invariants and that page accounting adds up (tests).
  absl::Status CheckInvariants() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class PinnedBlock;
  friend class ScratchPage;
  struct TenantState {
    TenantQuota quota;
    TenantUsage usage;
  };
  BlockStore(const BlockStoreOptions& options, std::unique_ptr<HostPagePool> pool,
             std::unique_ptr<EvictionPolicy> policy, std::unique_ptr<ColdTier> cold);

  absl::Status Recover() ABSL_LOCKS_EXCLUDED(mu_);
  // Frees a page or makes room by evicting; may release and re-take `mu_`
  // while a victim is demoted to the cold tier.
  absl::StatusOr<PageId> AcquirePageLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An eviction victim with no copy below (no cold tier, or it could not
  // take the block) leaves the store: policy, owner's usage, index, page.
  absl::Status DropEvictedLocked(PageId victim, const ScopedKey& vk, const BlockIndex::Entry& e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HoldLocked(PageId page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseHoldLocked(PageId page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseRead(PageId page) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseScratch(PageId page, TenantId tenant, size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // RESOURCE_EXHAUSTED when `bytes` more would put the tenant over budget.
  absl::Status CheckBudgetLocked(TenantId tenant, uint64_t bytes, const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One pin of `tenant` off the entry (its pinned bytes, and the page's hold
  // when it was the last pin).
  absl::Status UnpinLocked(TenantId tenant, const ScopedKey& key, BlockIndex::Entry* e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PinLocked(TenantId tenant, const ScopedKey& key, BlockIndex::Entry* e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SlotInfo SlotInfoLocked(const ScopedKey& key, const BlockIndex::Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreePageLocked(PageId page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases an unpinned entry from the index, the cold tier and the host tier.
  absl::Status EraseLocked(const ScopedKey& key, BlockIndex::Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const BlockStoreOptions options_;
  const std::string policy_name_;
  std::unique_ptr<HostPagePool> pool_;
  std::unique_ptr<ColdTier> cold_;

  absl::Mutex mu_;
  BlockIndex index_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<EvictionPolicy> policy_ ABSL_GUARDED_BY(mu_);
  // Per page: holds = tenant pins of its block (0/1: "pinned") + readers +
  // an in-flight demotion. A page with holds > 0 is never evicted or reused.
  std::vector<uint32_t> holds_ ABSL_GUARDED_BY(mu_);
  std::vector<ScopedKey> page_owner_ ABSL_GUARDED_BY(mu_);
  // Pages whose block was erased while readers held them: freed at the last
  // release.
  std::vector<bool> orphaned_ ABSL_GUARDED_BY(mu_);
  // Pages lent out as ScratchPages.
  std::vector<bool> scratch_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<TenantId, TenantState> tenants_ ABSL_GUARDED_BY(mu_);
  BlockStoreStats counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring
