// The HBM tier: device page pool, and demotion to / promotion from the host
// tier, bit-exact.
#include <random>

#include "gpu_test_util.h"
#include "kvring/cache/device_block_tier.h"

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

TEST(DeviceBlockTierTest, EvictedBlocksAreDemotedToHostAndPromotedBackBitExact) {
  KVRING_REQUIRE_GPU();
  const BlockLayout L{16, 2, 2, 64, DType::kBF16};  // 16 KiB
  BlockStoreOptions ho;
  ho.page_bytes = L.bytes();
  ho.num_pages = 64;
  ho.register_memory = [](void* p, size_t n) {
    return cudaHostRegister(p, n, cudaHostRegisterDefault) == cudaSuccess ? absl::OkStatus()
                                                                          : absl::InternalError("cudaHostRegister");
  };
  ho.unregister_memory = [](void* p) { cudaHostUnregister(p); };
  auto host = BlockStore::Create(ho);
  ASSERT_TRUE(host.ok());
  DeviceBlockTierOptions o;
  o.pool.page_bytes = L.bytes();
  o.pool.num_pages = 6;
  o.staging_pages = 2;
  auto tier = DeviceBlockTier::Create(o, host->get());
  ASSERT_TRUE(tier.ok()) << tier.status();
  std::mt19937_64 rng(1);
  std::vector<std::vector<uint8_t>> payloads(20, std::vector<uint8_t>(L.bytes()));
  for (auto& p : payloads)
    for (auto& b : p) b = static_cast<uint8_t>(rng());
  auto key = [](int i) { return BlockKey{uint64_t(i) * 977 + 1, uint64_t(i)}; };
  for (int i = 0; i < 20; ++i) {
    PutArgs a;
    a.ns = 1;
    a.key = key(i);
    a.meta.layout = L;
    auto r = (*tier)->Put(a, payloads[i].data(), false, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(*r);
  }
  ASSERT_TRUE((*tier)->Drain().ok());
  const DeviceTierStats st = (*tier)->stats();
  EXPECT_LE(st.blocks, 6u);
  EXPECT_GE(st.demotions_done, 14u);
  EXPECT_EQ((*host)->stats().blocks, st.demotions_done);
  // Every block is readable from HBM (promoted when needed) and bit-exact.
  std::vector<uint8_t> back(L.bytes());
  for (int i = 0; i < 20; ++i) {
    auto b = (*tier)->Acquire(1, key(i), nullptr);
    ASSERT_TRUE(b.ok()) << i << ": " << b.status();
    CUDA_OK(cudaMemcpy(back.data(), b->device_ptr(), back.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(back, payloads[i]) << "block " << i;
  }
  EXPECT_GT((*tier)->stats().promotions, 0u);
  // Held blocks are never evicted.
  auto held = (*tier)->Acquire(1, key(19), nullptr);
  ASSERT_TRUE(held.ok());
  for (int i = 0; i < 12; ++i) ASSERT_TRUE((*tier)->Acquire(1, key(i), nullptr).ok());
  CUDA_OK(cudaMemcpy(back.data(), held->device_ptr(), back.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(back, payloads[19]);
  EXPECT_EQ((*tier)->Acquire(2, key(1), nullptr).status().code(), absl::StatusCode::kNotFound);  // other namespace
}

}  // namespace
}  // namespace kvring
