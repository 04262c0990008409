// DeviceBlockTier: KV blocks in HBM in front of the host BlockStore. Blocks
// are copied in (from host or device memory), read through DeviceBlock holds
// (a device pointer for the kernels), evicted in LRU order, and demoted to
// the host tier: the device-to-host copy runs asynchronously on the tier's
// stream into pinned staging buffers, and the block enters the host store
// when its copy completes. A block being demoted stays readable from HBM
// until then. A miss in HBM that hits the host tier is promoted (copied in)
// on the caller's stream. Demotions start early, whenever free pages fall
// under `low_watermark_pages`, so a Put rarely waits for one.
// Thread safety: all methods are thread-safe (one mutex; CUDA copies are
// enqueued under it, never waited on under it).
#pragma once

#include <cuda_runtime.h>

#include <deque>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kvring/cache/block_store.h"
#include "kvring/cache/device_page_pool.h"
#include "kvring/cache/lru_policy.h"

namespace kvring {

struct DeviceBlockTierOptions {
  DevicePagePoolOptions pool;
  // Pinned host staging buffers for demotions in flight. Default: 8.
  size_t staging_pages = 8;
  // Start demotions when free HBM pages fall below this. Default: 2.
  size_t low_watermark_pages = 2;
};

struct DeviceTierStats {
  uint64_t blocks = 0, free_pages = 0, puts = 0, hits = 0, misses = 0, promotions = 0, demotions_started = 0,
           demotions_done = 0, demotion_errors = 0;
};

class DeviceBlockTier;

// A read hold on a block in HBM: device_ptr() stays valid and the block
// unevictable until the handle goes. Movable; must not outlive its tier.
class DeviceBlock {
 public:
  DeviceBlock() = default;
  DeviceBlock(DeviceBlock&& o) noexcept { *this = std::move(o); }
  DeviceBlock& operator=(DeviceBlock&& o) noexcept;
  DeviceBlock(const DeviceBlock&) = delete;
  ~DeviceBlock() { Release(); }
  const void* device_ptr() const { return ptr_; }
  const BlockMeta& meta() const { return meta_; }
  void Release();

 private:
  friend class DeviceBlockTier;
  DeviceBlockTier* tier_ = nullptr;
  ScopedKey key_;
  const void* ptr_ = nullptr;
  BlockMeta meta_;
};

class DeviceBlockTier {
 public:
  // `host` (not owned) is the next tier and must outlive this one.
  static absl::StatusOr<std::unique_ptr<DeviceBlockTier>> Create(const DeviceBlockTierOptions& options,
                                                                 BlockStore* host);
  ~DeviceBlockTier();
  DeviceBlockTier(const DeviceBlockTier&) = delete;
  DeviceBlockTier& operator=(const DeviceBlockTier&) = delete;

  // Copies the block's payload (`src`: host memory, or device memory when
  // `src_on_device`) into HBM on `stream`; returns false when it was there.
  absl::StatusOr<bool> Put(const PutArgs& args, const void* src, bool src_on_device, cudaStream_t stream);
  absl::StatusOr<DeviceBlock> Acquire(NamespaceId ns, const BlockKey& key, cudaStream_t stream);
  // Completes every demotion in flight (blocks reach the host tier).
  absl::Status Drain();
  DeviceTierStats stats();
  DevicePagePool& pool() { return *pool_; }

 private:
  friend class DeviceBlock;
  struct Entry {
    PageId page = kNoPage;
    BlockMeta meta;
    BlockKey parent;
    uint32_t holds = 0;
    bool demoting = false;
  };
  struct Demotion {
    ScopedKey key;
    PageId page;
    size_t staging;
    cudaEvent_t done;
  };
  DeviceBlockTier(const DeviceBlockTierOptions& o, std::unique_ptr<DevicePagePool> pool, BlockStore* host);
  absl::StatusOr<PageId> AllocateLocked(absl::MutexLock& lock) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StartDemotionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finishes completed demotions (all in flight when `wait`), unlocking while
  // it waits and while it hands blocks to the host tier.
  absl::Status FinishDemotionsLocked(absl::MutexLock& lock, bool wait_oldest, bool wait_all)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseHold(const ScopedKey& key);

  const DeviceBlockTierOptions options_;
  std::unique_ptr<DevicePagePool> pool_;
  BlockStore* host_;
  cudaStream_t demote_stream_ = nullptr;
  uint8_t* staging_ = nullptr;  // pinned
  absl::Mutex mu_;
  absl::flat_hash_map<ScopedKey, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::vector<ScopedKey> page_owner_ ABSL_GUARDED_BY(mu_);
  LruPolicy lru_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> free_staging_ ABSL_GUARDED_BY(mu_);
  std::deque<Demotion> inflight_ ABSL_GUARDED_BY(mu_);
  DeviceTierStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring
