// Multi-process cluster tests: real kvring-coordinator and kvringd
// processes, real gRPC, real RocksDB, real UCX over loopback.
#include <random>

#include "absl/strings/str_cat.h"
#include "cluster_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvring/attention/reference.h"
#include "kvring/cache/quantize.h"
#include "kvring/control/request_validation.h"
#include "kvring/layout/float_convert.h"
#include "step_test_util.h"

namespace kvring {
namespace {

using testing::Cluster;
using testing::ClusterOptions;

using testing::Blocks;
using testing::MakeChain;
using testing::SmallLayout;

TEST(ClusterTest, MultiNodePutGetLookupOverUcxAndGrpc) {
  Cluster cl(ClusterOptions{.nodes = 3});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("alpha");
  ASSERT_TRUE(token.ok()) << token.status();
  for (bool ucx : {true, false}) {
    auto c = cl.Connect(*token, "", ucx);
    ASSERT_TRUE(c.ok()) << c.status();
    Blocks b = MakeChain(**c, SmallLayout(), "m", ucx ? 1 : 2, 40);
    auto put = (*c)->Put(b.data);
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->inserted, 40u);
    EXPECT_EQ(put->replicas_written, 80u);  // R = 2
    auto n = (*c)->LookupPrefix(b.keys);
    ASSERT_TRUE(n.ok());
    EXPECT_EQ(*n, 40u);
    auto got = (*c)->Get(b.keys);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(got[i].status.ok()) << i << ": " << got[i].status;
      EXPECT_EQ(got[i].payload, b.payloads[i]);
    }
    // A longer chain: the prefix ends where the stored blocks end.
    Blocks longer = MakeChain(**c, SmallLayout(), "m", ucx ? 1 : 2, 50);
    EXPECT_EQ(*(*c)->LookupPrefix(longer.keys), 40u);
  }
  auto c = cl.Connect(*token);
  auto stats = (*c)->Stats();
  uint64_t total = 0;
  for (const auto& s : stats) {
    ASSERT_TRUE(s.status.ok()) << s.status;
    total += s.blocks;
    EXPECT_GT(s.blocks, 0u) << s.node_id << " holds nothing: placement is not spreading";
  }
  EXPECT_EQ(total, 160u);  // 80 distinct blocks x R
}

TEST(ClusterTest, GetIntoOneBufferLandsEveryBlockInItsPlaceWithBlocksMissing) {
  // Destinations that follow one another in memory (an array of blocks): the
  // reply lands in them directly. Keys not held in between (every 5th) shift
  // the blocks after them, which are then moved to their places; scattered
  // destinations go through the landing buffer. Over UCX and gRPC. (One
  // node: a node's share of hash-placed keys is otherwise scattered.)
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("alpha");
  ASSERT_TRUE(token.ok()) << token.status();
  for (bool ucx : {true, false}) {
    auto c = cl.Connect(*token, "", ucx);
    ASSERT_TRUE(c.ok()) << c.status();
    const size_t n = 30, bytes = SmallLayout().bytes();
    Blocks b = MakeChain(**c, SmallLayout(), "m", ucx ? 3 : 4, n);
    std::vector<BlockData> held;
    for (size_t i = 0; i < n; ++i) {
      if (i % 5 != 2) held.push_back(b.data[i]);
    }
    ASSERT_TRUE((*c)->Put(held).ok());
    for (bool contiguous : {true, false}) {
      std::vector<uint8_t> buf(n * bytes * 2, 0xee);
      std::vector<absl::Span<uint8_t>> dsts;
      for (size_t i = 0; i < n; ++i)
        dsts.push_back(absl::MakeSpan(buf.data() + i * bytes * (contiguous ? 1 : 2), bytes));
      auto r = (*c)->GetInto(b.keys, dsts);
      ASSERT_EQ(r.size(), n);
      for (size_t i = 0; i < n; ++i) {
        if (i % 5 == 2) {
          EXPECT_TRUE(absl::IsNotFound(r[i].status)) << i << ": " << r[i].status;
          continue;
        }
        ASSERT_TRUE(r[i].status.ok()) << i << ": " << r[i].status;
        EXPECT_EQ(std::vector<uint8_t>(dsts[i].begin(), dsts[i].end()), b.payloads[i])
            << "block " << i << (contiguous ? " (one buffer)" : " (scattered)") << (ucx ? " over UCX" : " over gRPC");
      }
    }
  }
}

TEST(ClusterTest, PassQAttendAcrossFourDaemonsEqualsTheCpuReference) {
  Cluster cl(ClusterOptions{.nodes = 4, .replication = 1});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("attn");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  const BlockLayout L{16, 2, 8, 64, DType::kBF16};
  const size_t nblocks = 300;  // chunks of 64 blocks: 5 chunks over 4 daemons
  Blocks b = MakeChain(**c, L, "attn-model", 7, nblocks);
  ASSERT_TRUE((*c)->PutSequence("session-1", 0, b.data).ok());
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const uint32_t rows = 3, q_heads = 32;
  std::vector<uint16_t> q(size_t{rows} * q_heads * 64);
  std::vector<double> qd(q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] = FloatToBf16(nd(rng));
    qd[i] = Bf16ToFloat(q[i]);
  }
  std::vector<int64_t> pos = {static_cast<int64_t>(nblocks * 16 - 1), 2000, 77};
  QueryTensor qt{q.data(), DType::kBF16, rows, q_heads, 64, pos.data(), nullptr};
  AttentionOptions o;
  o.layer = 1;
  AttendReport rep;
  auto out = (*c)->Attend("session-1", L, nblocks * 16, qt, o, &rep);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_GE(rep.shards, 2);
  EXPECT_EQ(rep.blocks, nblocks);
  // The report's split of the call: routing, then the slowest shard's round
  // trip, which holds every node's own time, and the transport within it.
  EXPECT_GT(rep.plan_seconds, 0);
  EXPECT_GT(rep.round_trip_seconds, 0);
  EXPECT_GE(rep.round_trip_seconds, rep.node_seconds);
  EXPECT_LE(rep.plan_seconds + rep.round_trip_seconds, rep.seconds);
  EXPECT_GT(rep.transport_seconds, 0);
  EXPECT_LT(rep.transport_seconds, rep.round_trip_seconds);
  std::vector<KvBlockRef> refs;
  for (size_t i = 0; i < nblocks; ++i)
    refs.push_back(KvBlockRef{b.payloads[i].data(), static_cast<int64_t>(i * 16), 16});
  std::vector<uint32_t> begin{0, static_cast<uint32_t>(nblocks)};
  auto dense = reference::FromBlocks(PagedKv{L, {}, refs, begin}, 0, 1);
  auto ref = reference::Attention(qd, pos, q_heads, dense, o);
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.out.size(); ++i) {
    num += (out->out[i] - ref.out[i]) * (out->out[i] - ref.out[i]);
    den += ref.out[i] * ref.out[i];
  }
  ASSERT_GT(den, 0);
  EXPECT_LT(std::sqrt(num / den), 2e-5);
  for (size_t i = 0; i < ref.lse.size(); ++i)
    EXPECT_NEAR(out->lse[i], ref.lse[i], 1e-4 * std::max(1.0, std::abs(ref.lse[i])));
  // An unknown sequence is a clear error.
  auto missing = (*c)->Attend("no-such-session", L, 160, qt, o);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();  // what every replica said
}

// A prompt stored once by the prefix cache (hash-placed blocks) starts a
// pass-Q sequence: a replica of the sequence's chunk that holds a block
// records it by key, the others are sent its bytes; the sequence attends
// exactly like the chain, and its delete leaves the prefix cache whole.
TEST(ClusterTest, ASequenceStartedFromAPrefixChainAttendsLikeTheChainAndSharesWhatANodeHolds) {
  Cluster cl(ClusterOptions{.nodes = 4, .replication = 2});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("prefix");
  auto other = cl.CreateTenant("other");
  ASSERT_TRUE(token.ok() && other.ok());
  auto c = cl.Connect(*token);
  auto o2 = cl.Connect(*other);
  ASSERT_TRUE(c.ok() && o2.ok());
  const BlockLayout L{16, 2, 8, 64, DType::kBF16};
  const size_t nblocks = 300;  // 5 chunks of 64 blocks
  Blocks b = MakeChain(**c, L, "prefix-model", 11, nblocks);
  ASSERT_TRUE((*c)->Put(b.data).ok());
  auto rep = (*c)->StartSequenceFromPrefix("from-prompt", L, b.keys);
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_EQ(rep->blocks, nblocks);
  EXPECT_EQ(rep->tokens, nblocks * 16);
  EXPECT_EQ(rep->blocks_shared + rep->blocks_copied, 2 * nblocks);  // every replica of every block
  EXPECT_GT(rep->blocks_shared, 0u);
  EXPECT_GT(rep->blocks_copied, 0u);
  EXPECT_EQ(rep->bytes_copied, rep->blocks_copied * L.bytes());

  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const uint32_t rows = 2, q_heads = 16;
  std::vector<uint16_t> q(size_t{rows} * q_heads * 64);
  std::vector<double> qd(q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] = FloatToBf16(nd(rng));
    qd[i] = Bf16ToFloat(q[i]);
  }
  std::vector<int64_t> pos = {static_cast<int64_t>(nblocks * 16 - 1), 1234};
  QueryTensor qt{q.data(), DType::kBF16, rows, q_heads, 64, pos.data(), nullptr};
  AttentionOptions opt;
  opt.layer = 1;
  auto out = (*c)->Attend("from-prompt", L, nblocks * 16, qt, opt);
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<KvBlockRef> refs;
  for (size_t i = 0; i < nblocks; ++i)
    refs.push_back(KvBlockRef{b.payloads[i].data(), static_cast<int64_t>(i * 16), 16});
  std::vector<uint32_t> begin{0, static_cast<uint32_t>(nblocks)};
  auto ref = reference::Attention(qd, pos, q_heads, reference::FromBlocks(PagedKv{L, {}, refs, begin}, 0, 1), opt);
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.out.size(); ++i) {
    num += (out->out[i] - ref.out[i]) * (out->out[i] - ref.out[i]);
    den += ref.out[i] * ref.out[i];
  }
  ASSERT_GT(den, 0);
  EXPECT_LT(std::sqrt(num / den), 2e-5);

  // Started once: a second start of the same id is refused, nothing changed.
  EXPECT_EQ((*c)->StartSequenceFromPrefix("from-prompt", L, b.keys).status().code(), absl::StatusCode::kAlreadyExists);
  // A chain the cache holds only the start of: the sequence starts with what it holds.
  Blocks part = MakeChain(**c, L, "prefix-model", 12, 40);
  ASSERT_TRUE((*c)->Put(absl::MakeConstSpan(part.data).subspan(0, 25)).ok());
  auto partial = (*c)->StartSequenceFromPrefix("from-part", L, part.keys);
  ASSERT_TRUE(partial.ok()) << partial.status();
  EXPECT_EQ(partial->blocks, 25u);
  EXPECT_EQ(partial->tokens, 25u * 16);
  // Another tenant with the same keys finds nothing: its sequence does not start.
  auto theirs = (*o2)->StartSequenceFromPrefix("stolen", L, b.keys);
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_EQ(theirs->blocks, 0u);
  auto listed = (*o2)->ListSequences({"stolen"});
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty() || listed->front().tokens == 0);
  // Bad input.
  EXPECT_EQ((*c)->StartSequenceFromPrefix("empty", L, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->StartSequenceFromPrefix("", L, b.keys).status().code(), absl::StatusCode::kInvalidArgument);
  // Deleting the sequence leaves the prefix cache's blocks, bytes intact.
  ASSERT_TRUE((*c)->DeleteSequence("from-prompt").ok());
  EXPECT_EQ(*(*c)->LookupPrefix(b.keys), nblocks);
  std::vector<GetResult> back = (*c)->Get(b.keys);
  for (size_t i = 0; i < nblocks; ++i) {
    ASSERT_TRUE(back[i].status.ok()) << i << ": " << back[i].status;
    EXPECT_EQ(back[i].payload, b.payloads[i]) << i;
  }
}

// Decode in place across shards: a batch of three sequences is prefilled
// by appended chunks and then decoded token by token through the client;
// the engine keeps no KV. Chunks of 4 blocks make the appends cross chunk
// (and so shard) boundaries; R=2 puts every append on two shards.
// Decode in place over 4 daemons with R=2, checked against the reference;
// `daemon_flags` vary how the daemons serve it.
void DecodeInPlaceAcrossFourDaemons(std::vector<std::string> daemon_flags) {
  Cluster cl(ClusterOptions{.nodes = 4,
                            .replication = 2,
                            .extra_daemon_flags = std::move(daemon_flags),
                            .extra_coordinator_flags = {"--sequence_chunk_blocks=4"}});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("decode");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  testing::StepSim sim(SmallLayout(), 8, 5);
  auto run = [&](uint32_t layer, const std::vector<testing::StepSim::Part>& parts, AttendReport* rep) {
    auto b = sim.Build(layer, parts);
    auto out = (*c)->Step(b.step, rep);
    if (!out.ok()) return out.status();
    sim.Commit(b);
    auto [err, lse_err] = sim.Check(b, *out);
    EXPECT_GE(err, 0) << "NaN in the output";
    EXPECT_LT(err, 2e-5) << "layer " << layer;
    EXPECT_LT(lse_err, 1e-4) << "layer " << layer;
    return absl::OkStatus();
  };
  // Prefill chunks: 150 tokens (3 chunks of 64 tokens), 40, and 1; each row
  // attends causally to the chunk's own tokens.
  AttendReport rep;
  for (uint32_t l = 0; l < 2; ++l) {
    ASSERT_TRUE(run(l, {{"a", 150, 150}, {"b", 40, 40}, {"c", 1, 1}}, &rep).ok());
    EXPECT_EQ(rep.appended_tokens, 2u * 191) << "every token on two replicas";
  }
  // 20 decode steps of the batch, both layers.
  for (int step = 0; step < 20; ++step) {
    for (uint32_t l = 0; l < 2; ++l) {
      absl::Status s = run(l, {{"a", 1, 1}, {"b", 1, 1}, {"c", 1, 1}}, &rep);
      ASSERT_TRUE(s.ok()) << "step " << step << ": " << s;
    }
  }
  EXPECT_GE(rep.shards, 2);
  // A long chunk: 200 tokens across four chunks in one step (a shard may
  // take non-adjacent parts of it: appends are then sent first).
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(run(l, {{"a", 4, 200}}, &rep).ok());
  EXPECT_EQ(sim.tokens("a", 1), 370u);
  // Blocks filled by appends were stored like Puts: every node holds some.
  uint64_t blocks = 0;
  for (const NodeStats& s : (*c)->Stats()) blocks += s.blocks;
  EXPECT_GE(blocks, 2u * (370 / 16 + 60 / 16 + 21 / 16));
  // Appends that do not continue the tail are refused, and nothing changes.
  auto bad = sim.Build(0, {{"b", 1, 1}});
  bad.step.sequences[0].context_tokens += 3;
  EXPECT_FALSE((*c)->Step(bad.step).ok());
  ASSERT_TRUE(run(0, {{"b", 1, 1}}, &rep).ok());
}

TEST(ClusterTest, DecodeInPlaceAcrossFourDaemonsWithReplicasEqualsTheReference) { DecodeInPlaceAcrossFourDaemons({}); }

// The same with decode steps (up to 4 rows) served on the daemons' UCX
// threads, and the prefill chunks on their handler threads.
TEST(ClusterTest, DecodeStepsServedOnTheUcxThreadEqualTheReference) {
  DecodeInPlaceAcrossFourDaemons({"--ucx_inline_attend_rows=4"});
}

TEST(ClusterTest, KillNineOneDaemonWithR2AndEveryAcknowledgedBlockIsStillReadable) {
  Cluster cl(ClusterOptions{.nodes = 3, .replication = 2});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("durable");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  Blocks b = MakeChain(**c, SmallLayout(), "m", 11, 120);
  auto put = (*c)->Put(b.data);
  ASSERT_TRUE(put.ok()) << put.status();
  cl.KillDaemon(1);  // no goodbye, no flush
  auto got = (*c)->Get(b.keys);
  int ok = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].status.ok() && got[i].payload == b.payloads[i]) ++ok;
    EXPECT_NE(got[i].node_id, "node1");
  }
  EXPECT_EQ(ok, 120) << "acknowledged blocks lost after kill -9";
  ASSERT_TRUE(cl.WaitForNodesUp(2));
  // Writes go on with the survivors.
  Blocks more = MakeChain(**c, SmallLayout(), "m", 12, 20);
  ASSERT_TRUE((*c)->Put(more.data).ok());
  for (const auto& r : (*c)->Get(more.keys)) EXPECT_TRUE(r.status.ok()) << r.status;
}

// The lifecycle calls across a daemon restart (write-through: a sequence's
// full blocks and records survive, its open blocks do not). 2 daemons, R=2,
// a sequence and a fork of it; daemon 1 restarts; the next appends find its
// tails missing and repair them from daemon 0; then truncating, appending,
// forking and deleting go on and every sequence attends exactly.
TEST(ClusterTest, SequenceLifecycleGoesOnAcrossADaemonRestart) {
  Cluster cl(ClusterOptions{
      .nodes = 2, .replication = 2, .write_through = true, .extra_coordinator_flags = {"--sequence_chunk_blocks=2"}});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("restart");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  testing::StepSim sim(SmallLayout(), 4, 51);
  int repairs = 0;
  // Every layer; a failed step is retried (the map catching up with the
  // restart) and must succeed; every answer exact.
  auto step = [&](const std::vector<testing::StepSim::Part>& parts) {
    return testing::StepEveryLayerRetrying(**c, sim, parts, absl::StatusCode::kOk, &repairs);
  };
  ASSERT_TRUE(step({{"s", 2, 40}}).ok());  // blocks 0-1 full, block 2 open (8 tokens)
  ASSERT_TRUE((*c)->ForkSequence("s", "f", 36).ok());
  sim.Fork("s", "f", 36);
  ASSERT_TRUE(step({{"f", 1, 3}}).ok());
  cl.KillDaemon(1);
  ASSERT_TRUE(cl.StartDaemon(1));
  ASSERT_TRUE(cl.WaitForNodesUp(2));
  ASSERT_EQ(repairs, 0);
  absl::Status s = step({{"s", 1, 5}, {"f", 1, 2}});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_GT(repairs, 0) << "daemon 1 restarted without its open blocks: the appends must have repaired them";
  // Back into a sealed block, then other tokens.
  auto cut = (*c)->TruncateSequence("s", 20);
  ASSERT_TRUE(cut.ok()) << cut.status();
  sim.Truncate("s", 20);
  s = step({{"s", 2, 7}});
  ASSERT_TRUE(s.ok()) << s;
  // A fork made after the restart, beside the one made before.
  auto fork = (*c)->ForkSequence("s", "g", 16);
  ASSERT_TRUE(fork.ok()) << fork.status();
  sim.Fork("s", "g", 16);
  s = step({{"g", 1, 1}, {"f", 2, 0}, {"s", 1, 0}});
  ASSERT_TRUE(s.ok()) << s;
  // Deleting the old fork leaves its source and the new fork exact.
  ASSERT_TRUE((*c)->DeleteSequence("f").ok());
  s = step({{"s", 1, 1}, {"g", 1, 1}});
  ASSERT_TRUE(s.ok()) << s;
  auto listed = (*c)->ListSequences({});
  ASSERT_TRUE(listed.ok()) << listed.status();
  for (const SequenceListing& l : *listed) EXPECT_NE(l.sequence_id, "f");
}

TEST(ClusterTest, DaemonRestartRecoversTheColdTier) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1, .write_through = true});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("restart");
  ASSERT_TRUE(token.ok());
  Blocks b;
  {
    auto c = cl.Connect(*token);
    ASSERT_TRUE(c.ok());
    b = MakeChain(**c, SmallLayout(), "m", 21, 64);
    ASSERT_TRUE((*c)->Put(b.data).ok());
    ASSERT_TRUE((*c)->PutSequence("s", 0, absl::MakeConstSpan(b.data).subspan(0, 8)).ok());
  }
  cl.KillDaemon(0);
  ASSERT_TRUE(cl.WaitForNodesUp(0));
  ASSERT_TRUE(cl.StartDaemon(0));
  ASSERT_TRUE(cl.WaitForNodesUp(1));
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*(*c)->LookupPrefix(b.keys), 64u);
  auto got = (*c)->Get(b.keys);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << got[i].status;
    EXPECT_EQ(got[i].payload, b.payloads[i]);
  }
  // The sequence table came back too: Attend works over the recovered blocks.
  std::vector<uint16_t> q(2 * 4 * 64, FloatToBf16(0.5f));
  std::vector<int64_t> pos = {127, 50};
  QueryTensor qt{q.data(), DType::kBF16, 2, 4, 64, pos.data(), nullptr};
  auto out = (*c)->Attend("s", SmallLayout(), 8 * 16, qt, {});
  EXPECT_TRUE(out.ok()) << out.status();
  EXPECT_NE(cl.Log("node0.log").find("recovered 64 blocks"), std::string::npos) << cl.Log("node0.log");
}

// Raw gRPC with malformed requests: each gets a clear error and the daemon
// keeps serving.
TEST(ClusterTest, MalformedRequestsGetClearErrorsAndTheDaemonKeepsServing) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1, .page_bytes = "1M"});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("fuzzy");
  ASSERT_TRUE(token.ok());
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  auto stub =
      v1::Node::NewStub(grpc::CreateCustomChannel(cl.daemon_address(0), grpc::InsecureChannelCredentials(), args));
  auto call_put = [&](const v1::PutRequest& req, const std::string& tok) {
    grpc::ClientContext ctx;
    if (!tok.empty()) ctx.AddMetadata("authorization", "Bearer " + tok);
    v1::PutResponse resp;
    grpc::Status s = stub->Put(&ctx, req, &resp);
    return std::make_pair(s, resp);
  };
  v1::PutRequest good;
  good.mutable_header()->set_version(1);
  auto* blk = good.add_blocks();
  blk->mutable_block()->mutable_key()->set_lo(5);
  LayoutToProto(SmallLayout(), blk->mutable_block()->mutable_layout());
  blk->mutable_block()->set_payload_bytes(static_cast<uint32_t>(SmallLayout().bytes()));
  blk->set_payload(std::string(SmallLayout().bytes(), 'x'));

  struct Case {
    const char* name;
    std::function<void(v1::PutRequest&)> mutate;
    std::string token;
    grpc::StatusCode code;
    const char* needle;
  };
  std::vector<Case> cases = {
      {"no token", [](v1::PutRequest&) {}, "", grpc::StatusCode::UNAUTHENTICATED, "authorization"},
      {"unknown tenant", [](v1::PutRequest&) {}, "not-a-real-token-at-all", grpc::StatusCode::UNAUTHENTICATED,
       "unknown"},
      {"bad version", [](v1::PutRequest& r) { r.mutable_header()->set_version(7); }, *token,
       grpc::StatusCode::FAILED_PRECONDITION, "version 7"},
      {"foreign namespace", [](v1::PutRequest& r) { r.mutable_header()->set_namespace_("tenant/other"); }, *token,
       grpc::StatusCode::PERMISSION_DENIED, "may not use namespace"},
      {"wrong payload size", [](v1::PutRequest& r) { r.mutable_blocks(0)->set_payload("short"); }, *token,
       grpc::StatusCode::INVALID_ARGUMENT, "payload has 5 bytes"},
      {"bad head_dim",
       [](v1::PutRequest& r) { r.mutable_blocks(0)->mutable_block()->mutable_layout()->set_head_dim(13); }, *token,
       grpc::StatusCode::INVALID_ARGUMENT, "head_dim"},
      {"bad dtype", [](v1::PutRequest& r) { r.mutable_blocks(0)->mutable_block()->mutable_layout()->set_dtype(9); },
       *token, grpc::StatusCode::INVALID_ARGUMENT, "dtype"},
      {"zero key", [](v1::PutRequest& r) { r.mutable_blocks(0)->mutable_block()->clear_key(); }, *token,
       grpc::StatusCode::INVALID_ARGUMENT, "key"},
      {"bad quantize", [](v1::PutRequest& r) { r.set_quantize("int4"); }, *token, grpc::StatusCode::INVALID_ARGUMENT,
       "unknown KV codec 'int4'"},
      {"huge quantize", [](v1::PutRequest& r) { r.set_quantize(std::string(100000, 'z')); }, *token,
       grpc::StatusCode::INVALID_ARGUMENT, "(100000 bytes)"},
      {"oversize block",
       [](v1::PutRequest& r) {
         BlockLayout big{64, 16, 8, 128, DType::kBF16};  // 4 MiB > the 1 MiB page
         LayoutToProto(big, r.mutable_blocks(0)->mutable_block()->mutable_layout());
         r.mutable_blocks(0)->mutable_block()->set_payload_bytes(static_cast<uint32_t>(big.bytes()));
         r.mutable_blocks(0)->set_payload(std::string(big.bytes(), 'y'));
       },
       *token, grpc::StatusCode::INVALID_ARGUMENT, "exceeds"},
      {"huge count",
       [](v1::PutRequest& r) {
         for (int i = 0; i < 2000; ++i) r.add_blocks();
       },
       *token, grpc::StatusCode::INVALID_ARGUMENT, "limit"},
  };
  for (const Case& k : cases) {
    v1::PutRequest r = good;
    k.mutate(r);
    auto [s, resp] = call_put(r, k.token);
    EXPECT_EQ(s.error_code(), k.code) << k.name << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(k.needle), std::string::npos) << k.name << ": " << s.error_message();
  }
  // Checksum mismatch: the block is refused with DATA_LOSS, per block.
  v1::PutRequest bad_sum = good;
  bad_sum.mutable_blocks(0)->mutable_block()->set_checksum(12345);
  auto [s1, r1] = call_put(bad_sum, *token);
  ASSERT_TRUE(s1.ok()) << s1.error_message();
  EXPECT_EQ(r1.results(0).status().code(), static_cast<int>(absl::StatusCode::kDataLoss));
  // Malformed Attend shapes.
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + *token);
    v1::AttendRequest a;
    a.mutable_header()->set_version(1);
    v1::AttendSequence* as = a.add_sequences();
    as->set_sequence_id("s");
    as->set_tokens(16);
    as->set_rows(2);
    as->add_ranges()->set_end(1);
    a.set_num_rows(2);
    a.set_q_heads(4);
    a.set_head_dim(64);
    a.set_q_dtype(2);
    a.set_queries(std::string(100, 'q'));
    a.add_positions(1);
    a.add_positions(2);
    v1::AttendResponse resp;
    grpc::Status s = stub->Attend(&ctx, a, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("queries have 100 bytes"), std::string::npos) << s.error_message();
  }
  // Still serving: the good request works.
  auto [s2, r2] = call_put(good, *token);
  ASSERT_TRUE(s2.ok()) << s2.error_message();
  EXPECT_EQ(r2.results(0).status().code(), 0) << r2.results(0).status().message();
  EXPECT_TRUE(cl.daemon(0).alive());
}

TEST(ClusterTest, ATenantNeverSeesAnotherTenantsBlocks) {
  Cluster cl(ClusterOptions{.nodes = 2, .replication = 1});
  ASSERT_TRUE(cl.Start());
  auto ta = cl.CreateTenant("tenant-a", {"shared/sys"});
  auto tb = cl.CreateTenant("tenant-b", {"shared/sys"});
  auto tc = cl.CreateTenant("tenant-c");
  ASSERT_TRUE(ta.ok() && tb.ok() && tc.ok());
  auto a = cl.Connect(*ta);
  auto b = cl.Connect(*tb);
  ASSERT_TRUE(a.ok() && b.ok());
  Blocks ab = MakeChain(**a, SmallLayout(), "m", 31, 10);
  ASSERT_TRUE((*a)->Put(ab.data).ok());
  // B with the same tokens computes different keys: nothing.
  Blocks bb = MakeChain(**b, SmallLayout(), "m", 31, 10);
  EXPECT_NE(ab.keys[0], bb.keys[0]);
  EXPECT_EQ(*(*b)->LookupPrefix(bb.keys), 0u);
  // B with A's exact keys (guessed or leaked): still nothing, the daemon files
  // blocks under the authenticated tenant's namespace.
  EXPECT_EQ(*(*b)->LookupPrefix(ab.keys), 0u);
  for (const auto& r : (*b)->Get(ab.keys)) EXPECT_EQ(r.status.code(), absl::StatusCode::kNotFound) << r.status;
  // B asking for A's namespace by name is refused outright.
  auto b_in_a = cl.Connect(*tb, (*a)->namespace_name());
  EXPECT_EQ(b_in_a.status().code(), absl::StatusCode::kPermissionDenied) << b_in_a.status();
  // A shared namespace is shared by its members, and only them.
  auto as = cl.Connect(*ta, "shared/sys");
  auto bs = cl.Connect(*tb, "shared/sys");
  ASSERT_TRUE(as.ok() && bs.ok());
  Blocks sys = MakeChain(**as, SmallLayout(), "m", 41, 6);
  ASSERT_TRUE((*as)->Put(sys.data).ok());
  Blocks sys_b = MakeChain(**bs, SmallLayout(), "m", 41, 6);
  EXPECT_EQ(sys.keys, sys_b.keys);
  EXPECT_EQ(*(*bs)->LookupPrefix(sys_b.keys), 6u);
  EXPECT_EQ(cl.Connect(*tc, "shared/sys").status().code(), absl::StatusCode::kPermissionDenied);
  auto c = cl.Connect(*tc);
  EXPECT_EQ(*(*c)->LookupPrefix(sys.keys), 0u);
}

TEST(ClusterTest, CoordinatorRestartMovesTheMapForwardAndLosesNoBlock) {
  Cluster cl(ClusterOptions{.nodes = 2, .replication = 2});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("coord");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  Blocks b = MakeChain(**c, SmallLayout(), "m", 51, 30);
  ASSERT_TRUE((*c)->Put(b.data).ok());
  auto before = cl.Map();
  ASSERT_TRUE(before.ok());
  cl.KillCoordinator();
  // The data path does not need the coordinator.
  for (const auto& r : (*c)->Get(b.keys)) EXPECT_TRUE(r.status.ok()) << r.status;
  ASSERT_TRUE(cl.StartCoordinator());
  ASSERT_TRUE(cl.WaitForNodesUp(2));
  auto after = cl.Map();
  ASSERT_TRUE(after.ok());
  EXPECT_GT(after->version(), before->version());
  // Tenants survived the restart (the token still works) and so did every block.
  auto c2 = cl.Connect(*token);
  ASSERT_TRUE(c2.ok()) << c2.status();
  for (const auto& r : (*c2)->Get(b.keys)) EXPECT_TRUE(r.status.ok()) << r.status;
}

}  // namespace
}  // namespace kvring

namespace kvring {
namespace {

double RelL2(absl::Span<const float> a, absl::Span<const double> b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : 1e9;
}

// A sequence built by appends is stored in the tenant's encoding (or the
// client's, which overrides it) block by block as each fills; steps read the
// quantized blocks and the plain, still-open tail in one answer.
TEST(ClusterTest, AppendedSequencesAreSealedInTheTenantsOrTheClientsEncoding) {
  Cluster cl(ClusterOptions{.nodes = 2, .replication = 1, .extra_coordinator_flags = {"--sequence_chunk_blocks=4"}});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("q8", {}, 0, "int8/kivi");
  ASSERT_TRUE(token.ok()) << token.status();
  auto c = cl.Connect(*token);                     // the tenant's int8
  auto cp = cl.Connect(*token, "", true, "none");  // plain, by the client's choice
  ASSERT_TRUE(c.ok() && cp.ok());
  testing::StepSim sim(SmallLayout(), 8, 5), plain_sim(SmallLayout(), 8, 6);
  auto run = [](Client& client, testing::StepSim& sm, uint32_t layer, const std::vector<testing::StepSim::Part>& parts,
                double* err) {
    auto b = sm.Build(layer, parts);
    auto out = client.Step(b.step);
    if (!out.ok()) return out.status();
    sm.Commit(b);
    *err = sm.Check(b, *out).first;
    return absl::OkStatus();
  };
  double err = 0;
  for (uint32_t l = 0; l < 2; ++l) {
    ASSERT_TRUE(run(**c, sim, l, {{"q", 100, 100}}, &err).ok());
    EXPECT_LT(err, 2e-5) << "the prefill chunk reads its own open blocks: plain";
    ASSERT_TRUE(run(**cp, plain_sim, l, {{"p", 100, 100}}, &err).ok());
    EXPECT_LT(err, 2e-5);
  }
  for (int step = 0; step < 8; ++step) {
    for (uint32_t l = 0; l < 2; ++l) {
      absl::Status s = run(**c, sim, l, {{"q", 1, 1}}, &err);
      ASSERT_TRUE(s.ok()) << "step " << step << ": " << s;
      EXPECT_LT(err, 3e-2) << "int8 codes of 6 blocks, the plain tail";
      EXPECT_GT(err, 1e-6) << "it read codes, not plain blocks";
      s = run(**cp, plain_sim, l, {{"p", 1, 1}}, &err);
      ASSERT_TRUE(s.ok()) << "step " << step << ": " << s;
      EXPECT_LT(err, 2e-5);
    }
  }
}

TEST(ClusterTest, NodesQuantizeAtPutForTheTenantOrTheRequestAndAttendReadsTheCodes) {
  Cluster cl(ClusterOptions{.nodes = 2, .replication = 1});
  ASSERT_TRUE(cl.Start());
  // A tenant whose blocks are stored as int8 (K per channel, V per token).
  EXPECT_EQ(cl.CreateTenant("bogus", {}, 0, "int4").status().code(), absl::StatusCode::kInvalidArgument);
  auto token = cl.CreateTenant("q8", {}, 0, "int8/kivi");
  ASSERT_TRUE(token.ok()) << token.status();
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  const BlockLayout L{16, 2, 8, 64, DType::kBF16};
  Blocks b = MakeChain(**c, L, "qm", 5, 40);
  ASSERT_TRUE((*c)->Put(b.data).ok());
  ASSERT_TRUE((*c)->PutSequence("s", 0, b.data).ok());
  const KvEncoding want{KvCodec::kInt8, ScaleMode::kKChannelVToken};
  auto got = (*c)->Get(b.keys);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << got[i].status;
    EXPECT_TRUE(got[i].meta.encoding == want);
    EXPECT_EQ(got[i].payload.size(), EncodedBytes(L, want));
    EXPECT_LT(got[i].payload.size(), L.bytes() * 6 / 10);
    std::vector<uint8_t> plain;
    ASSERT_TRUE(DequantizeBlock(L, got[i].meta.encoding, got[i].payload, &plain).ok());
    std::vector<float> x(L.elements());
    std::vector<double> y(L.elements());
    for (uint64_t e = 0; e < L.elements(); ++e) {
      x[e] = PlainElement(L, plain.data(), e);
      y[e] = PlainElement(L, b.payloads[i].data(), e);
    }
    EXPECT_LT(RelL2(x, y), 1.5e-2);
  }
  // Attend reads the int8 codes on the nodes; the answer is within int8 error
  // of attention over the plain blocks.
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  const uint32_t rows = 2, q_heads = 16;
  std::vector<uint16_t> q(size_t{rows} * q_heads * 64);
  std::vector<double> qd(q.size());
  for (size_t i = 0; i < q.size(); ++i) qd[i] = Bf16ToFloat(q[i] = FloatToBf16(nd(rng)));
  std::vector<int64_t> pos = {639, 300};
  QueryTensor qt{q.data(), DType::kBF16, rows, q_heads, 64, pos.data(), nullptr};
  AttentionOptions o;
  auto out = (*c)->Attend("s", L, 40 * 16, qt, o);
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<KvBlockRef> refs;
  for (size_t i = 0; i < 40; ++i) refs.push_back(KvBlockRef{b.payloads[i].data(), static_cast<int64_t>(i * 16), 16});
  std::vector<uint32_t> begin{0, 40};
  auto ref = reference::Attention(qd, pos, q_heads, reference::FromBlocks(PagedKv{L, {}, refs, begin}, 0, o.layer), o);
  const double err = RelL2(out->out, ref.out);
  EXPECT_LT(err, 3e-2);
  EXPECT_GT(err, 1e-6);  // it really read codes, not the plain blocks
  // The request overrides the tenant default: fp8 per token, or plain.
  auto c8 = cl.Connect(*token, "", true, "fp8/per-token");
  ASSERT_TRUE(c8.ok());
  Blocks f = MakeChain(**c8, L, "qm", 6, 4);
  ASSERT_TRUE((*c8)->Put(f.data).ok());
  for (const auto& r : (*c8)->Get(f.keys)) {
    ASSERT_TRUE(r.status.ok());
    EXPECT_TRUE((r.meta.encoding == KvEncoding{KvCodec::kFp8E4M3, ScaleMode::kPerToken}));
  }
  auto cp = cl.Connect(*token, "", true, "none");
  Blocks p = MakeChain(**cp, L, "qm", 7, 2);
  ASSERT_TRUE((*cp)->Put(p.data).ok());
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ((*cp)->Get(absl::MakeConstSpan(&p.keys[i], 1))[0].payload, p.payloads[i]);
  // A bad request encoding (refused by the client's typed option; the
  // daemon's own check of the wire string is in MalformedRequests...) and a
  // block holding NaN are refused with reasons.
  auto bad = cl.Connect(*token, "", true, "int4");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  Blocks n = MakeChain(**c, L, "qm", 9, 1);
  reinterpret_cast<uint16_t*>(n.payloads[0].data())[123] = 0x7fc0;  // bf16 NaN
  auto put = (*c)->Put(n.data);
  ASSERT_FALSE(put.ok());
  EXPECT_THAT(std::string(put.status().message()), ::testing::HasSubstr("finite"));
}

}  // namespace
}  // namespace kvring
