// DevicePagePool: the HBM tier's page pool (page_pool.h's contract): pages
// cut from cudaMalloc'd slabs (1 GiB each by default, so a large pool does
// not need one contiguous allocation). page_address() is a device address.
// Thread-safe. The destructor frees the slabs; no page may be in use then.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kvring/cache/page_pool.h"

namespace kvring {

struct DevicePagePoolOptions {
  size_t page_bytes = 2 << 20;  // Default: 2 MiB (one Llama-3-8B block of 16 tokens)
  size_t num_pages = 512;
  int device = 0;
  size_t slab_bytes = 1ull << 30;  // Default: 1 GiB per cudaMalloc
};

class DevicePagePool final : public PagePool {
 public:
  static absl::StatusOr<std::unique_ptr<DevicePagePool>> Create(const DevicePagePoolOptions& options);
  ~DevicePagePool() override;
  absl::StatusOr<PageId> Allocate() override { return free_list_.Allocate(); }
  absl::Status Free(PageId page) override { return free_list_.Free(page); }
  void* page_address(PageId page) const override {
    return slabs_[page / pages_per_slab_] + static_cast<size_t>(page % pages_per_slab_) * page_bytes_;
  }
  size_t page_bytes() const override { return page_bytes_; }
  size_t num_pages() const override { return free_list_.num_pages(); }
  size_t free_pages() const override { return free_list_.free_pages(); }
  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }
  int device() const { return device_; }

 private:
  DevicePagePool(size_t page_bytes, size_t num_pages, size_t pages_per_slab, int device)
      : page_bytes_(page_bytes), pages_per_slab_(pages_per_slab), device_(device), free_list_(num_pages) {}
  size_t page_bytes_, pages_per_slab_;
  int device_;
  std::vector<uint8_t*> slabs_;
  PageFreeList free_list_;
};

}  // namespace kvring
