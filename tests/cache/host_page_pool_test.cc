#include "kvring/cache/host_page_pool.h"

#include <cstring>
#include <set>

#include "gtest/gtest.h"

namespace kvring {
namespace {

TEST(HostPagePoolTest, AllocatesEveryPageOnceThenReportsExhaustion) {
  auto pool = HostPagePool::Create({.page_bytes = 4096, .num_pages = 64});
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::set<PageId> ids;
  std::set<void*> addrs;
  for (int i = 0; i < 64; ++i) {
    auto p = (*pool)->Allocate();
    ASSERT_TRUE(p.ok());
    ids.insert(*p);
    addrs.insert((*pool)->page_address(*p));
    std::memset((*pool)->page(*p), i, 4096);  // every page is writable
  }
  EXPECT_EQ(ids.size(), 64u);
  EXPECT_EQ(addrs.size(), 64u);
  EXPECT_EQ((*pool)->free_pages(), 0u);
  auto none = (*pool)->Allocate();
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE((*pool)->Free(17).ok());
  auto again = (*pool)->Allocate();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 17u);
}

TEST(HostPagePoolTest, DoubleFreeAndBadIdsAreErrors) {
  auto pool = HostPagePool::Create({.page_bytes = 64, .num_pages = 4});
  ASSERT_TRUE(pool.ok());
  auto p = (*pool)->Allocate();
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE((*pool)->Free(*p).ok());
  EXPECT_EQ((*pool)->Free(*p).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*pool)->Free(4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*pool)->free_pages(), 4u);
}

TEST(HostPagePoolTest, RejectsBadOptions) {
  EXPECT_EQ(HostPagePool::Create({.page_bytes = 100, .num_pages = 4}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HostPagePool::Create({.page_bytes = 64, .num_pages = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HostPagePoolTest, RegistrationHookRunsAndItsErrorFailsCreate) {
  void* seen = nullptr;
  size_t seen_len = 0;
  bool unregistered = false;
  {
    HostPagePoolOptions o{.page_bytes = 64, .num_pages = 8};
    o.register_memory = [&](void* p, size_t n) {
      seen = p;
      seen_len = n;
      return absl::OkStatus();
    };
    o.unregister_memory = [&](void*) { unregistered = true; };
    auto pool = HostPagePool::Create(o);
    ASSERT_TRUE(pool.ok());
    EXPECT_EQ(seen, (*pool)->base());
    EXPECT_EQ(seen_len, 512u);
    EXPECT_EQ((*pool)->memory_kind(), MemoryKind::kPinnedHost);
  }
  EXPECT_TRUE(unregistered);
  HostPagePoolOptions bad{.page_bytes = 64, .num_pages = 8};
  bad.register_memory = [](void*, size_t) { return absl::UnavailableError("no driver"); };
  EXPECT_EQ(HostPagePool::Create(bad).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvring
