// HostPagePool: the host-DRAM tier's page pool (see page_pool.h for the
// contract). One mmap'd region of num_pages * page_bytes, optionally mlock'd
// and backed by transparent huge pages; `register_memory` lets a GPU build pin
// it (cudaHostRegister) without cache/ depending on CUDA.
#pragma once

#include <functional>
#include <memory>

#include "kvring/cache/page_pool.h"

namespace kvring {

struct HostPagePoolOptions {
  // Bytes per page; must be a multiple of 64 and > 0. Default: 256 KiB.
  size_t page_bytes = 256 << 10;
  // Number of pages; > 0. Default: 1024 (256 MiB).
  size_t num_pages = 1024;
  // mlock the region so it is never swapped (needs RLIMIT_MEMLOCK). A failure
  // is an error. Default: false.
  bool lock_memory = false;
  // Ask for transparent huge pages (madvise). Best effort. Default: true.
  bool huge_pages = true;
  // Fault every page in at Create() so no Put pays for first-touch page
  // faults and zeroing (costs start-up time, about 1 s per 10 GiB).
  // Default: true.
  bool prefault = true;
  // Called once with the region after mapping (e.g. cudaHostRegister) and
  // `unregister_memory` before unmapping. An error fails Create().
  std::function<absl::Status(void*, size_t)> register_memory;
  std::function<void(void*)> unregister_memory;
};

class HostPagePool final : public PagePool {
 public:
  static absl::StatusOr<std::unique_ptr<HostPagePool>> Create(const HostPagePoolOptions& options);
  ~HostPagePool() override;
  HostPagePool(const HostPagePool&) = delete;
  HostPagePool& operator=(const HostPagePool&) = delete;

  absl::StatusOr<PageId> Allocate() override { return free_list_.Allocate(); }
  absl::Status Free(PageId page) override { return free_list_.Free(page); }
  void* page_address(PageId page) const override { return base_ + static_cast<size_t>(page) * page_bytes_; }
  uint8_t* page(PageId page) const { return base_ + static_cast<size_t>(page) * page_bytes_; }
  size_t page_bytes() const override { return page_bytes_; }
  size_t num_pages() const override { return free_list_.num_pages(); }
  size_t free_pages() const override { return free_list_.free_pages(); }
  MemoryKind memory_kind() const override { return registered_ ? MemoryKind::kPinnedHost : MemoryKind::kHost; }
  uint8_t* base() const { return base_; }
  size_t region_bytes() const { return region_bytes_; }

 private:
  HostPagePool(uint8_t* base, size_t region_bytes, size_t page_bytes, size_t num_pages);
  uint8_t* base_;
  size_t region_bytes_;
  size_t page_bytes_;
  bool registered_ = false;
  std::function<void(void*)> unregister_;
  PageFreeList free_list_;
};

}  // namespace kvring
