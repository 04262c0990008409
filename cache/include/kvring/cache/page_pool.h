// PagePool: fixed-size pages cut from one large allocation.
//
// Contract: Allocate() and Free() are O(1) and never call malloc; a PageId is
// an index in [0, num_pages()). page_address() is stable for the pool's
// lifetime. All methods are thread-safe. Implementations: HostPagePool (host
// memory, optionally locked/registered for DMA) and DevicePagePool (HBM,
// attention/cuda), which hand out the same ids with the same semantics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvring {

using PageId = uint32_t;
inline constexpr PageId kNoPage = UINT32_MAX;

enum class MemoryKind { kHost, kPinnedHost, kDevice };

class PagePool {
 public:
  virtual ~PagePool() = default;
  // RESOURCE_EXHAUSTED when no page is free.
  virtual absl::StatusOr<PageId> Allocate() = 0;
  // INVALID_ARGUMENT for an id out of range; FAILED_PRECONDITION for a page
  // that is not allocated (double free). The pool is unchanged on error.
  virtual absl::Status Free(PageId page) = 0;
  // Address of the page (a device address for kDevice).
  virtual void* page_address(PageId page) const = 0;
  virtual size_t page_bytes() const = 0;
  virtual size_t num_pages() const = 0;
  virtual size_t free_pages() const = 0;
  virtual MemoryKind memory_kind() const = 0;
};

// The free list shared by the pool implementations: a stack of free ids and
// an allocated bit per page, under one mutex. O(1) both ways.
class PageFreeList {
 public:
  explicit PageFreeList(size_t num_pages);
  absl::StatusOr<PageId> Allocate();
  absl::Status Free(PageId page);
  size_t free_pages() const;
  size_t num_pages() const { return num_pages_; }

 private:
  const size_t num_pages_;
  mutable absl::Mutex mu_;
  std::vector<PageId> free_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> allocated_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring
