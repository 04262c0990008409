// The device page pool (the CUDA backend's HBM pages).
#include <algorithm>
#include <vector>

#include "gpu_test_util.h"
#include "kvring/cache/device_page_pool.h"

namespace kvring {
namespace {

using namespace gpu_testing;

TEST(DevicePagePoolTest, AllocatesDistinctDevicePagesAcrossSlabs) {
  KVRING_REQUIRE_GPU();
  auto pool = DevicePagePool::Create({.page_bytes = 1 << 20, .num_pages = 10, .device = 0, .slab_bytes = 3 << 20});
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<void*> addrs;
  for (int i = 0; i < 10; ++i) {
    auto p = (*pool)->Allocate();
    ASSERT_TRUE(p.ok());
    addrs.push_back((*pool)->page_address(*p));
    CUDA_OK(cudaMemset((*pool)->page_address(*p), i, 1 << 20));
  }
  EXPECT_EQ((*pool)->Allocate().status().code(), absl::StatusCode::kResourceExhausted);
  std::sort(addrs.begin(), addrs.end());
  EXPECT_EQ(std::unique(addrs.begin(), addrs.end()), addrs.end());
  EXPECT_EQ((*pool)->memory_kind(), MemoryKind::kDevice);
}

}  // namespace
}  // namespace kvring
