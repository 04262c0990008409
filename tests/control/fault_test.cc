// Fault tests with real processes: a daemon killed (SIGKILL) in the middle
// of a sustained put + attend load, a disk that fills up under the RocksDB
// tier, payload bytes never in the logs, per-tenant quotas under
// concurrent load. Each test states what "nothing lost" means for it and
// checks exactly that.
#include <atomic>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cluster_fixture.h"
#include "decode_through_death.h"
#include "gtest/gtest.h"
#include "kvring/attention/reference.h"
#include "kvring/control/request_validation.h"
#include "step_test_util.h"

namespace kvring {
namespace {

using testing::Blocks;
using testing::Cluster;
using testing::ClusterOptions;
using testing::MakeChain;
using testing::SmallLayout;

double RelL2(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

// R=2, 4 daemons. Three threads put fresh chains, two threads Attend over a
// stored sequence, all the time; daemon 2 is SIGKILLed a second in. Every
// Put the client acknowledged must read back bit for bit afterwards; every
// Attend must be the exact answer or an error, never a wrong answer.
TEST(FaultTest, KillNineUnderPutAndAttendLoadLosesNothingAndNeverAnswersWrong) {
  Cluster cl(ClusterOptions{.nodes = 4, .replication = 2});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("load");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  const BlockLayout L = SmallLayout();
  const size_t nblocks = 200;
  Blocks seq = MakeChain(**c, L, "seq", 1, nblocks);
  ASSERT_TRUE((*c)->PutSequence("long", 0, seq.data).ok());
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  const uint32_t q_heads = 8;
  std::vector<uint16_t> q(q_heads * 64);
  std::vector<double> qd(q.size());
  for (size_t i = 0; i < q.size(); ++i) qd[i] = Bf16ToFloat(q[i] = FloatToBf16(nd(rng)));
  std::vector<int64_t> pos = {static_cast<int64_t>(nblocks * 16)};
  std::vector<KvBlockRef> refs;
  for (size_t i = 0; i < nblocks; ++i)
    refs.push_back(KvBlockRef{seq.payloads[i].data(), static_cast<int64_t>(i * 16), 16});
  std::vector<uint32_t> begin{0, static_cast<uint32_t>(nblocks)};
  const auto ref = reference::Attention(qd, pos, q_heads, reference::FromBlocks(PagedKv{L, {}, refs, begin}, 0, 0), {});

  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<Blocks> acked;  // every chain whose Put returned OK
  std::atomic<int> put_ok{0}, put_err{0}, attend_ok{0}, attend_err{0}, attend_wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (uint32_t i = 0; !stop; ++i) {
        Blocks b = MakeChain(**c, L, "put", 1000 * (t + 1) + i, 8);
        if ((*c)->Put(b.data).ok()) {
          ++put_ok;
          std::lock_guard<std::mutex> l(mu);
          acked.push_back(std::move(b));
        } else {
          ++put_err;
        }
      }
    });
  }
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&] {
      QueryTensor qt{q.data(), DType::kBF16, 1, q_heads, 64, pos.data(), nullptr};
      while (!stop) {
        auto out = (*c)->Attend("long", L, nblocks * 16, qt, AttentionOptions{});
        if (!out.ok()) {
          ++attend_err;
          continue;
        }
        ++attend_ok;
        if (RelL2(out->out, ref.out) > 1e-4) ++attend_wrong;
      }
    });
  }
  absl::SleepFor(absl::Seconds(1));
  const int ok_before = put_ok.load();
  cl.KillDaemon(2);
  absl::SleepFor(absl::Seconds(3));
  stop = true;
  for (auto& th : threads) th.join();
  EXPECT_GT(ok_before, 0);
  EXPECT_GT(put_ok.load(), ok_before) << "puts did not go on after the kill";
  EXPECT_GT(attend_ok.load(), 0);
  EXPECT_EQ(attend_wrong.load(), 0) << "an Attend returned a wrong answer";
  // Every acknowledged block is readable, bit for bit, from the survivors.
  size_t checked = 0, bad = 0;
  for (const Blocks& b : acked) {
    auto got = (*c)->Get(b.keys);
    for (size_t i = 0; i < got.size(); ++i, ++checked) bad += !(got[i].status.ok() && got[i].payload == b.payloads[i]);
  }
  EXPECT_EQ(bad, 0u) << "of " << checked << " acknowledged blocks";
  // And the sequence still answers exactly.
  QueryTensor qt{q.data(), DType::kBF16, 1, q_heads, 64, pos.data(), nullptr};
  auto out = (*c)->Attend("long", L, nblocks * 16, qt, AttentionOptions{});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_LT(RelL2(out->out, ref.out), 1e-4);
  std::printf("[fault] puts ok %d, failed %d; attends ok %d, failed %d, wrong %d; %zu acknowledged blocks verified\n",
              put_ok.load(), put_err.load(), attend_ok.load(), attend_err.load(), attend_wrong.load(), checked);
}

// Decode in place under kill -9: an engine appends and attends a batch of
// two sequences layer by layer (R=2, W=1) while a daemon is killed. Steps
// fail over to the surviving replica (a failed step is retried as it was:
// appends are idempotent), no answer is ever wrong, and at the end every
// acknowledged token is still attended over exactly.
TEST(FaultTest, KillNineUnderAppendAndAttendLoadLosesNoAcknowledgedAppend) {
  Cluster cl(ClusterOptions{
      .nodes = 4, .replication = 2, .extra_coordinator_flags = {"--write_quorum=1", "--sequence_chunk_blocks=2"}});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("decode");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  testing::StepSim sim(SmallLayout(), 4, 9);
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, retried{0}, wrong{0}, gave_up{0};
  auto step = [&](uint32_t layer, const std::vector<testing::StepSim::Part>& parts) {
    auto b = sim.Build(layer, parts);
    for (int attempt = 0; attempt < 50; ++attempt) {
      auto out = (*c)->Step(b.step);
      if (out.ok()) {
        sim.Commit(b);
        auto [err, lse_err] = sim.Check(b, *out);
        if (err < 0 || err > 2e-5 || lse_err > 1e-4) ++wrong;
        ++ok;
        return true;
      }
      ++retried;
      if (attempt == 49) std::printf("[fault] gave up: %s\n", out.status().ToString().c_str());
      absl::SleepFor(absl::Milliseconds(50));
    }
    ++gave_up;
    return false;
  };
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(step(l, {{"x", 50, 50}, {"y", 1, 30}}));
  std::thread engine([&] {
    while (!stop) {
      for (uint32_t l = 0; l < 2; ++l) {
        if (!step(l, {{"x", 1, 1}, {"y", 1, 1}})) return;
      }
    }
  });
  absl::SleepFor(absl::Seconds(1));
  const int ok_before = ok.load();
  cl.KillDaemon(1);
  absl::SleepFor(absl::Seconds(3));
  stop = true;
  engine.join();
  EXPECT_GT(ok_before, 0);
  EXPECT_GT(ok.load(), ok_before + 4) << "steps did not go on after the kill";
  EXPECT_EQ(wrong.load(), 0) << "a step returned a wrong answer";
  EXPECT_EQ(gave_up.load(), 0);
  // Every acknowledged token, attended over from the survivors.
  for (uint32_t l = 0; l < 2; ++l) {
    auto b = sim.Build(l, {{"x", 2, 0}, {"y", 2, 0}});
    auto out = (*c)->Step(b.step);
    ASSERT_TRUE(out.ok()) << out.status();
    auto [err, lse_err] = sim.Check(b, *out);
    EXPECT_LT(err, 2e-5);
    EXPECT_GE(err, 0);
    EXPECT_LT(lse_err, 1e-4);
  }
  std::printf("[fault] decode steps ok %d, retried %d, wrong %d; %llu tokens of x acknowledged and verified\n",
              ok.load(), retried.load(), wrong.load(), static_cast<unsigned long long>(sim.tokens("x", 1)));
}

TEST(FaultTest, AfterANodesDeathTheTailIsRepairedAndDecodeGoesOnAtWriteQuorumR) {
  testing::DecodeThroughANodesDeath({.write_quorum = 2});
}
TEST(FaultTest, AfterANodesDeathTheTailIsRepairedAndDecodeGoesOnAtWriteQuorumOne) {
  testing::DecodeThroughANodesDeath({.write_quorum = 1});
}

// Write quorum 1: the tail's last tokens live on one replica. When that
// replica dies after the other lost its copy of the open block (a restart)
// and before an append repaired it, the next append fails with DATA_LOSS naming the first lost position, never
// a sequence no call can serve: the engine truncates there, appends again
// (regenerating the K/V), and the sequence attends exactly.
TEST(FaultTest, LostTailTokensAreDataLossWithAPositionAndTruncateRecovers) {
  Cluster cl(ClusterOptions{.nodes = 2,
                            .replication = 2,
                            .write_through = true,  // full blocks survive a restart; open blocks do not
                            .extra_coordinator_flags = {"--write_quorum=1", "--sequence_chunk_blocks=2"}});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("decode");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  testing::StepSim sim(SmallLayout(), 4, 21);
  auto step = [&](const std::vector<testing::StepSim::Part>& parts, absl::StatusCode stop_at) {
    return testing::StepEveryLayerRetrying(**c, sim, parts, stop_at);
  };
  ASSERT_TRUE(step({{"x", 4, 18}}, absl::StatusCode::kOk).ok());  // blocks 0-3 full, block 4 open (2 tokens)
  cl.KillDaemon(1);
  ASSERT_TRUE(step({{"x", 1, 1}}, absl::StatusCode::kOk).ok());  // W=1: on node0 alone
  ASSERT_TRUE(cl.StartDaemon(1));
  ASSERT_TRUE(cl.WaitForNodesUp(2));
  // 19 tokens, the 3 of block 4 only on node0 (node1 restarted without its open block, and no append since has
  // repaired it from node0): node0 dies.
  cl.KillDaemon(0);
  absl::Status lost = step({{"x", 1, 1}}, absl::StatusCode::kDataLoss);
  ASSERT_EQ(lost.code(), absl::StatusCode::kDataLoss) << lost;
  const std::string msg(lost.message());
  const size_t at = msg.find("first missing position ");
  ASSERT_NE(at, std::string::npos) << msg;
  const uint64_t first_lost = std::stoull(msg.substr(at + 23));
  EXPECT_EQ(first_lost, 16u) << msg;  // block 4 starts at token 16: its tokens were on node0 alone
  // The engine's recovery: truncate there, append again, attend exactly.
  auto cut = (*c)->TruncateSequence("x", first_lost);
  ASSERT_TRUE(cut.ok()) << cut.status();
  sim.Truncate("x", first_lost);
  ASSERT_TRUE(step({{"x", 2, 4}}, absl::StatusCode::kOk).ok());
  ASSERT_TRUE(step({{"x", 3, 1}}, absl::StatusCode::kOk).ok());
  EXPECT_EQ(sim.tokens("x", 0), 21u);
}

// The daemon's disk "fills up" (RLIMIT_FSIZE on its process) under a
// write-through RocksDB tier: the write error reaches the client as an
// error status, blocks stored before stay readable and intact, the failed
// blocks are never served, and the daemon keeps serving.
TEST(FaultTest, DiskFullReachesTheClientAndCorruptsNothing) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1, .write_through = true});
  ASSERT_TRUE(cl.StartCoordinator());
  ASSERT_TRUE(cl.StartDaemon(0, {"--cold_codec=none"}, /*file_size_limit=*/6 << 20));
  ASSERT_TRUE(cl.WaitForNodesUp(1));
  auto token = cl.CreateTenant("full");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  std::vector<Blocks> stored;
  absl::Status first_error;
  for (int i = 0; i < 200 && first_error.ok(); ++i) {  // 200 x 4 x 16 KiB = 12.5 MiB > the 6 MiB limit
    Blocks b = MakeChain(**c, SmallLayout(), "m", 100 + i, 4);
    auto r = (*c)->Put(b.data);
    if (r.ok())
      stored.push_back(std::move(b));
    else
      first_error = r.status();
  }
  ASSERT_FALSE(first_error.ok()) << "the file-size limit was never hit";
  EXPECT_FALSE(stored.empty());
  std::printf("[fault] disk full after %zu puts: %s\n", stored.size(), first_error.ToString().c_str());
  EXPECT_TRUE(cl.daemon(0).alive()) << "the daemon died on a disk error";
  for (const Blocks& b : stored) {
    auto got = (*c)->Get(b.keys);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(got[i].status.ok()) << got[i].status;
      EXPECT_EQ(got[i].payload, b.payloads[i]);
    }
  }
  // A block whose Put failed is not served as if it were stored.
  Blocks late = MakeChain(**c, SmallLayout(), "m", 9999, 2);
  auto r = (*c)->Put(late.data);
  EXPECT_FALSE(r.ok());
  for (const auto& g : (*c)->Get(late.keys)) EXPECT_FALSE(g.status.ok());
}

// Payload bytes never reach a daemon's log, even at debug level and on the
// error paths (bad checksum, bad sizes).
TEST(FaultTest, DaemonLogsNeverContainPayloadBytes) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1, .extra_daemon_flags = {"--log_level=debug"}});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("secret");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  const std::string marker = "KVRING-PAYLOAD-MARKER-7f3a";
  const BlockLayout L = SmallLayout();
  Blocks b = MakeChain(**c, L, "m", 5, 4);
  for (auto& p : b.payloads) {
    for (size_t i = 0; i + marker.size() <= p.size(); i += 512) std::memcpy(p.data() + i, marker.data(), marker.size());
  }
  ASSERT_TRUE((*c)->Put(b.data).ok());
  (void)(*c)->Get(b.keys);
  // Error paths: a wrong checksum and a truncated payload over raw gRPC.
  auto stub = v1::Node::NewStub(grpc::CreateChannel(cl.daemon_address(0), grpc::InsecureChannelCredentials()));
  for (int variant = 0; variant < 2; ++variant) {
    v1::PutRequest req;
    req.mutable_header()->set_version(1);
    auto* pb = req.add_blocks();
    pb->mutable_block()->mutable_key()->set_lo(77 + variant);
    LayoutToProto(L, pb->mutable_block()->mutable_layout());
    pb->mutable_block()->set_payload_bytes(static_cast<uint32_t>(L.bytes()));
    pb->mutable_block()->set_checksum(12345);
    std::string payload(reinterpret_cast<const char*>(b.payloads[0].data()), b.payloads[0].size());
    if (variant == 1) payload.resize(payload.size() / 2);
    pb->set_payload(payload);
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + *token);
    v1::PutResponse resp;
    (void)stub->Put(&ctx, req, &resp);
  }
  cl.StopDaemon(0);
  std::ifstream in(cl.dir() / "node0.log");
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_GT(log.size(), 100u) << "no log to check";
  EXPECT_EQ(log.find(marker), std::string::npos) << "payload bytes in the daemon log";
  EXPECT_EQ(log.find(absl::BytesToHexString(marker)), std::string::npos) << "payload bytes (hex) in the daemon log";
  EXPECT_EQ(log.find(absl::Base64Escape(marker.substr(0, 24))), std::string::npos)
      << "payload bytes (base64) in the log";
}

// A tenant's pinned-bytes quota holds under 8 concurrent writers: exactly
// quota / block bytes pinned puts succeed, the rest get RESOURCE_EXHAUSTED.
TEST(FaultTest, PinnedQuotaHoldsUnderConcurrentLoad) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1});
  ASSERT_TRUE(cl.Start());
  const BlockLayout L = SmallLayout();
  const uint64_t quota = 40 * L.bytes();
  auto token = cl.CreateTenant("quota", {}, quota);
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  std::atomic<int> ok{0}, exhausted{0}, other{0};
  std::vector<std::thread> th;
  for (int t = 0; t < 8; ++t) {
    th.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        Blocks b = MakeChain(**c, L, "q", 500 + t * 100 + i, 1);
        b.data[0].pin = true;
        auto r = (*c)->Put(b.data);
        if (r.ok())
          ++ok;
        else if (absl::IsResourceExhausted(r.status()))
          ++exhausted;
        else
          ++other;
      }
    });
  }
  for (auto& x : th) x.join();
  EXPECT_EQ(ok.load(), 40);
  EXPECT_EQ(exhausted.load(), 160 - 40);
  EXPECT_EQ(other.load(), 0);
  uint64_t pinned = 0;
  for (const auto& s : (*c)->Stats()) pinned += s.pinned_blocks;
  EXPECT_EQ(pinned, 40u);
}

}  // namespace
}  // namespace kvring
