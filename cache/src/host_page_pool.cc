#include "kvring/cache/host_page_pool.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvring {

PageFreeList::PageFreeList(size_t num_pages) : num_pages_(num_pages) {
  absl::MutexLock lock(&mu_);
  free_.reserve(num_pages);
  // Hand out low ids first (pop from the back).
  for (size_t i = num_pages; i > 0; --i) free_.push_back(static_cast<PageId>(i - 1));
  allocated_.assign(num_pages, false);
}

absl::StatusOr<PageId> PageFreeList::Allocate() {
  absl::MutexLock lock(&mu_);
  if (free_.empty())
    return absl::ResourceExhaustedError(absl::StrCat("page pool full: all ", num_pages_, " pages in use"));
  const PageId p = free_.back();
  free_.pop_back();
  allocated_[p] = true;
  return p;
}

absl::Status PageFreeList::Free(PageId page) {
  absl::MutexLock lock(&mu_);
  if (page >= num_pages_)
    return absl::InvalidArgumentError(absl::StrCat("page id ", page, " out of range [0, ", num_pages_, ")"));
  if (!allocated_[page])
    return absl::FailedPreconditionError(absl::StrCat("page ", page, " is not allocated (double free?)"));
  allocated_[page] = false;
  free_.push_back(page);
  return absl::OkStatus();
}

size_t PageFreeList::free_pages() const {
  absl::MutexLock lock(&mu_);
  return free_.size();
}

HostPagePool::HostPagePool(uint8_t* base, size_t region_bytes, size_t page_bytes, size_t num_pages)
    : base_(base), region_bytes_(region_bytes), page_bytes_(page_bytes), free_list_(num_pages) {}

absl::StatusOr<std::unique_ptr<HostPagePool>> HostPagePool::Create(const HostPagePoolOptions& o) {
  if (o.page_bytes == 0 || o.page_bytes % 64 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("page_bytes must be a positive multiple of 64, got ", o.page_bytes));
  }
  if (o.num_pages == 0 || o.num_pages >= kNoPage) {
    return absl::InvalidArgumentError(absl::StrCat("num_pages must be in [1, 2^32-1), got ", o.num_pages));
  }
  if (o.page_bytes > (size_t{1} << 40) / o.num_pages) {
    return absl::InvalidArgumentError("page pool larger than 1 TiB");
  }
  const size_t bytes = o.page_bytes * o.num_pages;
  void* mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mmap of ", bytes, " bytes failed: ", std::strerror(errno)));
  }
  if (o.huge_pages) ::madvise(mem, bytes, MADV_HUGEPAGE);
  if (o.prefault) {
    // Touch one byte per 4 KiB page (after madvise, so huge pages can back it).
    auto* p = static_cast<volatile uint8_t*>(mem);
    for (size_t off = 0; off < bytes; off += 4096) p[off] = 0;
  }
  if (o.lock_memory && ::mlock(mem, bytes) != 0) {
    const std::string err = std::strerror(errno);
    ::munmap(mem, bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("mlock of ", bytes, " bytes failed: ", err, " (raise RLIMIT_MEMLOCK)"));
  }
  std::unique_ptr<HostPagePool> pool(new HostPagePool(static_cast<uint8_t*>(mem), bytes, o.page_bytes, o.num_pages));
  if (o.register_memory) {
    absl::Status s = o.register_memory(mem, bytes);
    if (!s.ok()) return s;  // the destructor unmaps
    pool->registered_ = true;
    pool->unregister_ = o.unregister_memory;
  }
  return pool;
}

HostPagePool::~HostPagePool() {
  if (registered_ && unregister_) unregister_(base_);
  ::munmap(base_, region_bytes_);
}

}  // namespace kvring
