#include "kvring/transport/loopback_transport.h"

#include <thread>

#include "gtest/gtest.h"
#include "kvring/transport/faulty_transport.h"

namespace kvring {
namespace {

std::vector<uint8_t> Bytes(std::initializer_list<int> v) { return std::vector<uint8_t>(v.begin(), v.end()); }

TEST(LoopbackTransportTest, DeliversInOrderPerPeerAndTag) {
  auto g = LoopbackTransport::CreateGroup(2);
  ASSERT_TRUE(g[0]->Send(1, 7, Bytes({1, 2}), absl::Seconds(1)).ok());
  ASSERT_TRUE(g[0]->Send(1, 7, Bytes({3}), absl::Seconds(1)).ok());
  ASSERT_TRUE(g[0]->Send(1, 8, Bytes({9}), absl::Seconds(1)).ok());
  std::vector<uint8_t> buf(4);
  auto n = g[1]->Recv(0, 8, absl::MakeSpan(buf), absl::Seconds(1));
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 1u);
  EXPECT_EQ(buf[0], 9);
  n = g[1]->Recv(0, 7, absl::MakeSpan(buf), absl::Seconds(1));
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 2u);
  EXPECT_EQ(buf[1], 2);
  n = g[1]->Recv(0, 7, absl::MakeSpan(buf), absl::Seconds(1));
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(buf[0], 3);
}

TEST(LoopbackTransportTest, PostedReceiveCompletesWhenTheSendArrives) {
  auto g = LoopbackTransport::CreateGroup(3);
  std::vector<uint8_t> buf(8);
  auto rq = g[2]->Irecv(1, 5, absl::MakeSpan(buf));
  ASSERT_TRUE(rq.ok());
  EXPECT_EQ((*rq)->Wait(absl::Milliseconds(10)).status().code(), absl::StatusCode::kDeadlineExceeded);
  std::thread sender([&] { ASSERT_TRUE(g[1]->Send(2, 5, Bytes({4, 5, 6}), absl::Seconds(1)).ok()); });
  auto n = (*rq)->Wait(absl::Seconds(5));
  sender.join();
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 3u);
  EXPECT_EQ(buf[2], 6);
}

TEST(LoopbackTransportTest, OversizeMessagesAndBadPeersAreErrors) {
  auto g = LoopbackTransport::CreateGroup(2);
  ASSERT_TRUE(g[0]->Send(1, 1, Bytes({1, 2, 3}), absl::Seconds(1)).ok());
  std::vector<uint8_t> small(2);
  EXPECT_EQ(g[1]->Recv(0, 1, absl::MakeSpan(small), absl::Seconds(1)).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(g[0]->Send(0, 1, Bytes({1}), absl::Seconds(1)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g[0]->Send(5, 1, Bytes({1}), absl::Seconds(1)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(FaultyTransportTest, InjectsFailDropAndCorrupt) {
  auto g = LoopbackTransport::CreateGroup(2);
  FaultyTransport f(std::move(g[0]));
  std::vector<uint8_t> buf(3);
  f.InjectOnSends(FaultyTransport::Fault::kFail, 1);
  EXPECT_EQ(f.Send(1, 1, Bytes({1, 2, 3}), absl::Seconds(1)).code(), absl::StatusCode::kUnavailable);
  f.InjectOnSends(FaultyTransport::Fault::kDrop, 1);
  EXPECT_TRUE(f.Send(1, 1, Bytes({1, 2, 3}), absl::Seconds(1)).ok());
  EXPECT_EQ(g[1]->Recv(0, 1, absl::MakeSpan(buf), absl::Milliseconds(20)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  f.InjectOnSends(FaultyTransport::Fault::kCorrupt, 1);
  EXPECT_TRUE(f.Send(1, 1, Bytes({1, 2, 3}), absl::Seconds(1)).ok());
  ASSERT_TRUE(g[1]->Recv(0, 1, absl::MakeSpan(buf), absl::Seconds(1)).ok());
  EXPECT_NE(buf, Bytes({1, 2, 3}));
  EXPECT_TRUE(f.Send(1, 1, Bytes({1, 2, 3}), absl::Seconds(1)).ok());  // faults used up
  ASSERT_TRUE(g[1]->Recv(0, 1, absl::MakeSpan(buf), absl::Seconds(1)).ok());
  EXPECT_EQ(buf, Bytes({1, 2, 3}));
  EXPECT_EQ(f.faults_injected(), 3);
}

}  // namespace
}  // namespace kvring
