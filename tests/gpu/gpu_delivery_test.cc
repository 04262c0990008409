// Same-host delivery into GPU memory (CUDA IPC), against real processes: a
// coordinator and kvringd daemons with --gpu (and one without, in the mixed
// cluster) started from this build, and the client in this process writing
// into cudaMalloc memory. The daemons copy the blocks into the test's
// allocation themselves; the bytes are read back and compared with what was
// put. Also: a place outside the real allocation and a handle that does not
// open are refused, and the daemon keeps serving. Skips without a GPU.
#include <cuda_runtime.h>

#include "../control/cluster_fixture.h"
#include "kvring/common/cuda_ipc.h"
#include "kvring/common/process.h"
#include "kvring/protocol/wire.h"
#include "require_gpu.h"

namespace kvring {
namespace {

using testing::Blocks;
using testing::Cluster;
using testing::ClusterOptions;
using testing::MakeChain;

// 256 KiB blocks (the daemons have 1 MiB pages).
const BlockLayout kLayout{32, 2, 8, 128, DType::kBF16};

struct DeviceBuffer {
  uint8_t* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t bytes) : n(bytes) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) p = nullptr;
    if (p) cudaMemset(p, 0, bytes);
  }
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
  std::vector<uint8_t> Read(size_t off, size_t bytes) const {
    std::vector<uint8_t> h(bytes);
    cudaMemcpy(h.data(), p + off, bytes, cudaMemcpyDeviceToHost);
    return h;
  }
};

uint64_t DeliveredBytes(Client& c) {
  uint64_t n = 0;
  for (const NodeStats& s : c.Stats()) n += s.device_delivered_bytes;
  return n;
}

std::vector<std::string> GpuFlags() { return {"--gpu=0", "--hbm_bytes=64M"}; }

TEST(GpuDeliveryTest, GetIntoDeviceMemoryIsCopiedInPlaceByTheNodes) {
  KVRING_REQUIRE_GPU();
  ClusterOptions o{.nodes = 2, .replication = 1, .page_bytes = "1M"};
  o.extra_daemon_flags = GpuFlags();
  Cluster cl(o);
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("engine");
  ASSERT_TRUE(token.ok()) << token.status();
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok()) << c.status();
  const size_t n = 24;
  Blocks b = MakeChain(**c, kLayout, "m", 1, n);
  ASSERT_TRUE((*c)->Put(b.data).ok());
  // The engine's pool: one allocation, blocks placed out of order at an
  // offset, as a paged KV pool hands out pages.
  DeviceBuffer pool((n + 3) * kLayout.bytes());
  ASSERT_NE(pool.p, nullptr);
  std::vector<absl::Span<uint8_t>> dsts;
  for (size_t i = 0; i < n; ++i) {
    dsts.push_back(absl::MakeSpan(pool.p + ((i * 7) % n + 2) * kLayout.bytes(), kLayout.bytes()));
  }
  auto r = (*c)->GetInto(b.keys, dsts, /*on_device=*/true);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(r[i].status.ok()) << i << ": " << r[i].status;
    EXPECT_TRUE(r[i].delivered_in_place) << i;
    EXPECT_EQ(r[i].meta.payload_bytes, kLayout.bytes());
    EXPECT_EQ(pool.Read(dsts[i].data() - pool.p, kLayout.bytes()), b.payloads[i]) << "block " << i;
  }
  EXPECT_EQ(DeliveredBytes(**c), n * kLayout.bytes());
  // The same through pinned staging (device_delivery off): same bytes, none delivered.
  ClientOptions co;
  co.coordinator = cl.coordinator_address();
  co.token = *token;
  co.device_delivery = false;
  auto staged = Client::Connect(co);
  ASSERT_TRUE(staged.ok());
  DeviceBuffer other(n * kLayout.bytes());
  std::vector<absl::Span<uint8_t>> d2;
  for (size_t i = 0; i < n; ++i) d2.push_back(absl::MakeSpan(other.p + i * kLayout.bytes(), kLayout.bytes()));
  auto r2 = (*staged)->GetInto(b.keys, d2, true);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(r2[i].status.ok()) << r2[i].status;
    EXPECT_FALSE(r2[i].delivered_in_place);
    EXPECT_EQ(other.Read(i * kLayout.bytes(), kLayout.bytes()), b.payloads[i]);
  }
  EXPECT_EQ(DeliveredBytes(**c), n * kLayout.bytes());
}

TEST(GpuDeliveryTest, ACpuNodeInTheClusterAnswersWithPayloads) {
  KVRING_REQUIRE_GPU();
  ClusterOptions o{.nodes = 2, .replication = 1, .page_bytes = "1M"};
  Cluster cl(o);
  ASSERT_TRUE(cl.StartCoordinator());
  ASSERT_TRUE(cl.StartDaemon(0, GpuFlags()));
  ASSERT_TRUE(cl.StartDaemon(1));
  ASSERT_TRUE(cl.WaitForNodesUp(2));
  auto token = cl.CreateTenant("engine");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  const size_t n = 32;
  Blocks b = MakeChain(**c, kLayout, "m", 2, n);
  ASSERT_TRUE((*c)->Put(b.data).ok());
  DeviceBuffer pool(n * kLayout.bytes());
  std::vector<absl::Span<uint8_t>> dsts;
  for (size_t i = 0; i < n; ++i) dsts.push_back(absl::MakeSpan(pool.p + i * kLayout.bytes(), kLayout.bytes()));
  for (int round = 0; round < 2; ++round) {  // the second: the CPU node is no longer asked to deliver
    cudaMemset(pool.p, 0, pool.n);
    auto r = (*c)->GetInto(b.keys, dsts, true);
    std::map<std::string, int> in_place, staged;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(r[i].status.ok()) << r[i].status;
      (r[i].delivered_in_place ? in_place : staged)[r[i].node_id]++;
      EXPECT_EQ(pool.Read(i * kLayout.bytes(), kLayout.bytes()), b.payloads[i]) << "block " << i;
    }
    EXPECT_EQ(in_place.count("node1"), 0u);
    EXPECT_EQ(staged.count("node0"), 0u);
    EXPECT_GT(in_place["node0"], 0);
    EXPECT_GT(staged["node1"], 0);
  }
}

TEST(GpuDeliveryTest, PlacesOutsideTheAllocationAndForeignHandlesAreRefused) {
  KVRING_REQUIRE_GPU();
  ClusterOptions o{.nodes = 1, .replication = 1, .page_bytes = "1M"};
  o.extra_daemon_flags = GpuFlags();
  Cluster cl(o);
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("engine");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  Blocks b = MakeChain(**c, kLayout, "m", 3, 2);
  ASSERT_TRUE((*c)->Put(b.data).ok());
  // A raw request naming a real allocation of 1.5 blocks: block 0 fits at
  // 0, block 1 at one block's offset does not (the node sizes the mapping
  // itself; the capacity the caller claims is not trusted).
  DeviceBuffer small(kLayout.bytes() + kLayout.bytes() / 2);
  cudaIpcMemHandle_t h;
  ASSERT_EQ(cudaIpcGetMemHandle(&h, small.p), cudaSuccess);
  auto stub = v1::Node::NewStub(grpc::CreateChannel(cl.daemon_address(0), grpc::InsecureChannelCredentials()));
  auto get = [&](const std::string& handle) {
    v1::GetRequest req;
    req.mutable_header()->set_version(1);
    req.set_host_id(HostBootId().value());
    req.add_device_allocations()->set_ipc_handle(handle);
    for (int i = 0; i < 2; ++i) {
      KeyToProto(b.keys[i], req.add_keys());
      v1::DevicePlace* p = req.add_device_places();
      p->set_offset(i * kLayout.bytes());
      p->set_capacity(kLayout.bytes());
    }
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + *token);
    v1::GetResponse resp;
    grpc::Status s = stub->Get(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  };
  v1::GetResponse resp = get(IpcHandleBytes(h));
  EXPECT_TRUE(resp.delivered_to_device());
  ASSERT_EQ(resp.blocks_size(), 2);
  EXPECT_EQ(resp.blocks(0).status().code(), 0) << resp.blocks(0).status().message();
  EXPECT_EQ(resp.blocks(1).status().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(resp.blocks(1).status().message().find("does not fit"), std::string::npos)
      << resp.blocks(1).status().message();
  std::vector<uint8_t> got(kLayout.bytes());
  ASSERT_EQ(cudaMemcpy(got.data(), small.p, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, b.payloads[0]);
  // A handle that opens nothing: the node answers with payloads and says why.
  resp = get(std::string(kIpcHandleBytes, '\x5a'));
  EXPECT_FALSE(resp.delivered_to_device());
  EXPECT_NE(resp.device_refusal().find("cannot map"), std::string::npos) << resp.device_refusal();
  ASSERT_EQ(resp.blocks_size(), 2);
  EXPECT_EQ(resp.blocks(1).payload(), std::string(b.payloads[1].begin(), b.payloads[1].end()));
  // And it keeps serving, in place.
  DeviceBuffer pool(2 * kLayout.bytes());
  std::vector<absl::Span<uint8_t>> dsts = {absl::MakeSpan(pool.p, kLayout.bytes()),
                                           absl::MakeSpan(pool.p + kLayout.bytes(), kLayout.bytes())};
  auto r = (*c)->GetInto(b.keys, dsts, true);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(r[i].status.ok()) << r[i].status;
    EXPECT_TRUE(r[i].delivered_in_place);
    EXPECT_EQ(pool.Read(i * kLayout.bytes(), kLayout.bytes()), b.payloads[i]);
  }
}

}  // namespace
}  // namespace kvring
