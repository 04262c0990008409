#include "kvring/cache/device_block_tier.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvring/common/cuda_status.h"

namespace kvring {
namespace {
absl::Status Cuda(cudaError_t e, const std::string& what) { return CudaStatus(e, what); }
}  // namespace

// ------------------------------------------------------------ DeviceBlock

DeviceBlock& DeviceBlock::operator=(DeviceBlock&& o) noexcept {
  if (this != &o) {
    Release();
    tier_ = o.tier_;
    key_ = o.key_;
    ptr_ = o.ptr_;
    meta_ = o.meta_;
    o.tier_ = nullptr;
  }
  return *this;
}

void DeviceBlock::Release() {
  if (tier_ != nullptr) {
    tier_->ReleaseHold(key_);
    tier_ = nullptr;
  }
}

// ------------------------------------------------------------ DeviceBlockTier

DeviceBlockTier::DeviceBlockTier(const DeviceBlockTierOptions& o, std::unique_ptr<DevicePagePool> pool,
                                 BlockStore* host)
    : options_(o), pool_(std::move(pool)), host_(host), page_owner_(pool_->num_pages()), lru_(pool_->num_pages()) {}

absl::StatusOr<std::unique_ptr<DeviceBlockTier>> DeviceBlockTier::Create(const DeviceBlockTierOptions& o,
                                                                         BlockStore* host) {
  if (host == nullptr) return absl::InvalidArgumentError("the HBM tier needs a host tier to demote to");
  if (o.staging_pages == 0) return absl::InvalidArgumentError("staging_pages must be > 0");
  auto pool = DevicePagePool::Create(o.pool);
  if (!pool.ok()) return pool.status();
  std::unique_ptr<DeviceBlockTier> t(new DeviceBlockTier(o, std::move(*pool), host));
  if (absl::Status s = Cuda(cudaStreamCreateWithFlags(&t->demote_stream_, cudaStreamNonBlocking), "stream"); !s.ok())
    return s;
  void* st = nullptr;
  if (absl::Status s =
          Cuda(cudaHostAlloc(&st, o.staging_pages * o.pool.page_bytes, cudaHostAllocDefault), "cudaHostAlloc");
      !s.ok()) {
    return s;
  }
  t->staging_ = static_cast<uint8_t*>(st);
  absl::MutexLock l(&t->mu_);
  for (size_t i = 0; i < o.staging_pages; ++i) t->free_staging_.push_back(i);
  return t;
}

DeviceBlockTier::~DeviceBlockTier() {
  (void)Drain();
  if (demote_stream_) cudaStreamDestroy(demote_stream_);
  if (staging_) cudaFreeHost(staging_);
}

absl::Status DeviceBlockTier::StartDemotionLocked() {
  if (free_staging_.empty()) return absl::ResourceExhaustedError("no staging buffer free");
  std::optional<SlotId> v = lru_.Victim();
  if (!v.has_value()) return absl::ResourceExhaustedError("HBM tier full: every block is held");
  const PageId page = *v;
  const ScopedKey key = page_owner_[page];
  Entry& e = entries_[key];
  const size_t slot = free_staging_.back();
  cudaEvent_t done = nullptr;
  absl::Status s = Cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "demotion event");
  if (s.ok()) {
    s = Cuda(cudaMemcpyAsync(staging_ + slot * pool_->page_bytes(), pool_->page_address(page), e.meta.payload_bytes,
                             cudaMemcpyDeviceToHost, demote_stream_),
             "demotion copy");
  }
  if (s.ok()) s = Cuda(cudaEventRecord(done, demote_stream_), "demotion event record");
  if (!s.ok()) {
    if (done != nullptr) (void)cudaEventDestroy(done);  // the error reported is the one above
    return s;
  }
  free_staging_.pop_back();
  lru_.Pin(page);  // not a victim again while it is copied out
  e.demoting = true;
  inflight_.push_back(Demotion{key, page, slot, done});
  ++stats_.demotions_started;
  return absl::OkStatus();
}

absl::Status DeviceBlockTier::FinishDemotionsLocked(absl::MutexLock& lock, bool wait_oldest, bool wait_all) {
  absl::Status first = absl::OkStatus();
  bool must_wait = wait_oldest || wait_all;
  while (!inflight_.empty()) {
    Demotion d = inflight_.front();
    cudaError_t copy = cudaEventQuery(d.done);
    if (copy == cudaErrorNotReady) {
      if (!must_wait) break;
      mu_.Unlock();
      copy = cudaEventSynchronize(d.done);
      mu_.Lock();
    }
    inflight_.pop_front();
    if (!wait_all) must_wait = false;
    (void)cudaEventDestroy(d.done);  // a completed event; its destruction cannot fail usefully
    auto it = entries_.find(d.key);
    if (copy != cudaSuccess) {
      // The copy out failed: the block stays in HBM; nothing is lost.
      free_staging_.push_back(d.staging);
      it->second.demoting = false;
      ++stats_.demotion_errors;
      if (it->second.holds == 0) lru_.Unpin(d.page);
      if (first.ok()) first = Cuda(copy, "demotion copy");
      continue;
    }
    PutArgs a;
    a.tenant = it->second.meta.owner;
    a.ns = d.key.ns;
    a.key = d.key.key;
    a.parent = it->second.parent;
    a.meta = it->second.meta;
    const size_t n = it->second.meta.payload_bytes;
    const uint8_t* src = staging_ + d.staging * pool_->page_bytes();
    // Hand the block to the host tier unlocked (it may demote to disk).
    mu_.Unlock();
    absl::StatusOr<PutResult> r = host_->Put(a, absl::MakeConstSpan(src, n));
    mu_.Lock();
    free_staging_.push_back(d.staging);
    it = entries_.find(d.key);
    Entry& e = it->second;
    e.demoting = false;
    if (!r.ok()) {
      // Keep it in HBM: nothing is lost; the caller sees the error.
      ++stats_.demotion_errors;
      if (e.holds == 0) lru_.Unpin(d.page);
      if (first.ok()) first = r.status();
      continue;
    }
    ++stats_.demotions_done;
    if (e.holds > 0) {
      continue;  // read while demoting: it stays in HBM too (its hold release re-admits it)
    }
    lru_.Remove(d.page, /*evicted=*/true);
    page_owner_[d.page] = ScopedKey{};
    (void)pool_->Free(d.page);
    entries_.erase(it);
  }
  return first;
}

absl::StatusOr<PageId> DeviceBlockTier::AllocateLocked(absl::MutexLock& lock) {
  for (int attempt = 0; attempt < 64; ++attempt) {
    absl::StatusOr<PageId> p = pool_->Allocate();
    if (p.ok()) return p;
    if (!inflight_.empty()) {
      absl::Status s = FinishDemotionsLocked(lock, /*wait_oldest=*/true, false);
      if (!s.ok()) return s;
      continue;
    }
    if (absl::Status s = StartDemotionLocked(); !s.ok()) return s;
  }
  return absl::ResourceExhaustedError("HBM tier: could not free a page");
}

absl::StatusOr<bool> DeviceBlockTier::Put(const PutArgs& a, const void* src, bool src_on_device, cudaStream_t stream) {
  const uint64_t bytes = EncodedBytes(a.meta.layout, a.meta.encoding);
  if (bytes > pool_->page_bytes()) return absl::InvalidArgumentError("block larger than an HBM page");
  if (a.key.is_zero() || src == nullptr) return absl::InvalidArgumentError("zero key or null source");
  const ScopedKey sk{a.ns, a.key};
  absl::MutexLock lock(&mu_);
  ++stats_.puts;
  if (absl::Status s = FinishDemotionsLocked(lock, false, false); !s.ok()) return s;
  if (entries_.count(sk)) return false;
  absl::StatusOr<PageId> page = AllocateLocked(lock);
  if (!page.ok()) return page.status();
  if (entries_.count(sk)) {  // raced while unlocked
    (void)pool_->Free(*page);
    return false;
  }
  cudaError_t e = cudaMemcpyAsync(pool_->page_address(*page), src, bytes,
                                  src_on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) {
    (void)pool_->Free(*page);
    return Cuda(e, "copy into HBM");
  }
  Entry& en = entries_[sk];
  en.page = *page;
  en.meta = a.meta;
  en.meta.payload_bytes = static_cast<uint32_t>(bytes);
  en.meta.owner = a.tenant;
  en.parent = a.parent;
  page_owner_[*page] = sk;
  lru_.Admit(*page, {});
  // Keep a few pages free: start demotions early (they finish on later calls).
  while (pool_->free_pages() < options_.low_watermark_pages && !free_staging_.empty() && StartDemotionLocked().ok()) {
  }
  return true;
}

absl::StatusOr<DeviceBlock> DeviceBlockTier::Acquire(NamespaceId ns, const BlockKey& key, cudaStream_t stream) {
  const ScopedKey sk{ns, key};
  absl::MutexLock lock(&mu_);
  auto grant = [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (e.holds++ == 0 && !e.demoting) lru_.Pin(e.page);
    lru_.Touch(e.page);
    DeviceBlock b;
    b.tier_ = this;
    b.key_ = sk;
    b.ptr_ = pool_->page_address(e.page);
    b.meta_ = e.meta;
    return b;
  };
  auto it = entries_.find(sk);
  if (it != entries_.end()) {
    ++stats_.hits;
    return grant(it->second);
  }
  ++stats_.misses;
  // Promote from the host tier.
  mu_.Unlock();
  absl::StatusOr<PinnedBlock> hb = host_->Acquire(ns, key);
  mu_.Lock();
  if (!hb.ok()) return hb.status();
  it = entries_.find(sk);
  if (it != entries_.end()) return grant(it->second);
  absl::StatusOr<PageId> page = AllocateLocked(lock);
  if (!page.ok()) return page.status();
  cudaError_t e = cudaMemcpyAsync(pool_->page_address(*page), hb->payload().data(), hb->payload().size(),
                                  cudaMemcpyHostToDevice, stream);
  // The host hold must outlive the copy.
  mu_.Unlock();
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  mu_.Lock();
  if (e != cudaSuccess) {
    (void)pool_->Free(*page);
    return Cuda(e, "promotion copy");
  }
  Entry& en = entries_[sk];
  en.page = *page;
  en.meta = hb->meta();
  en.parent = hb->parent();
  page_owner_[*page] = sk;
  lru_.Admit(*page, {});
  ++stats_.promotions;
  return grant(en);
}

void DeviceBlockTier::ReleaseHold(const ScopedKey& key) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  if (--e.holds == 0 && !e.demoting) lru_.Unpin(e.page);
}

absl::Status DeviceBlockTier::Drain() {
  absl::MutexLock lock(&mu_);
  return FinishDemotionsLocked(lock, true, true);
}

DeviceTierStats DeviceBlockTier::stats() {
  absl::MutexLock lock(&mu_);
  DeviceTierStats s = stats_;
  s.blocks = entries_.size();
  s.free_pages = pool_->free_pages();
  return s;
}

}  // namespace kvring
