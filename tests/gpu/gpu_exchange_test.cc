// Attend steps with the engine's tensors in GPU memory, against real
// processes: a coordinator and kvringd daemons with --gpu started from this
// build, and the client in this process. The GPU nodes read the queries and
// appended K/V and write their partials in the client's exchange buffer
// (CUDA IPC; kvring.proto DeviceExchange), and the client merges them on
// the device. Every step is checked against the float64 reference over the
// same (bf16) K/V, and against the same step through pinned staging
// (device_delivery off). A CPU node in the cluster refuses the exchange and
// is served through staging from the same buffer. Skips without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <memory>
#include <random>

#include "../control/cluster_fixture.h"
#include "absl/time/clock.h"
#include "gpu_test_util.h"
#include "kvring/attention/reference.h"
#include "kvring/common/stream_words.h"
#include "kvring/layout/float_convert.h"

namespace kvring {
namespace {

using gpu_testing::Dev;
using testing::Cluster;
using testing::ClusterOptions;

// Llama-3-8B heads on 2 layers, 16-token blocks.
constexpr uint32_t kQHeads = 32;
const BlockLayout kLayout{16, 2, 8, 128, DType::kBF16};

// The engine's side of a batch of sequences: their K/V (per layer, as
// doubles of the bf16 values it sent) and the steps it takes.
class Engine {
 public:
  explicit Engine(uint64_t seed) : rng_(seed) {}
  struct Part {
    std::string id;
    uint32_t rows = 0, append = 0;
  };
  struct Result {
    absl::Status status;
    AttendReport report;
    double call_seconds = 0;  // StepInto's own time on this thread
    std::vector<float> out, lse;
    std::vector<uint16_t> cast;  // AttendStep::out_cast, bf16
    std::vector<double> ref_out, ref_lse;
  };
  // One step on `layer` through `client`, with device tensors. `stream`
  // set: the step is ordered on it, and its inputs are written there only
  // after a 30 ms host function (a step that read them before the stream
  // got there would read zeros); the output is read through a copy queued
  // there after the step.
  Result Step(Client& client, uint32_t layer, const std::vector<Part>& parts, cudaStream_t stream = nullptr) {
    AttendStep st;
    st.layout = kLayout;
    st.options.layer = layer;
    st.device_buffers = true;
    const size_t kvrow = size_t{kLayout.kv_heads} * kLayout.head_dim, qrow = size_t{kQHeads} * kLayout.head_dim;
    std::vector<uint16_t> q, nk, nv;
    std::vector<int64_t> pos;
    std::normal_distribution<double> nd;
    for (const Part& p : parts) {
      auto& e = kv_[{p.id, layer}];
      const uint64_t before = e.positions.size();
      st.sequences.push_back(AttendSequence{p.id, before, p.rows, p.append});
      for (uint32_t t = 0; t < p.append; ++t) {
        e.positions.push_back(static_cast<int64_t>(before + t));
        for (size_t i = 0; i < kvrow; ++i) {
          nk.push_back(FloatToBf16(static_cast<float>(nd(rng_))));
          nv.push_back(FloatToBf16(static_cast<float>(nd(rng_))));
          e.k.push_back(Bf16ToFloat(nk.back()));
          e.v.push_back(Bf16ToFloat(nv.back()));
        }
      }
      for (uint32_t r = 0; r < p.rows; ++r) {
        pos.push_back(static_cast<int64_t>(before + p.append - p.rows + r));
        for (size_t i = 0; i < qrow; ++i) q.push_back(FloatToBf16(static_cast<float>(nd(rng_))));
      }
    }
    const uint32_t rows = static_cast<uint32_t>(pos.size());
    Dev<uint16_t> dq(q), dk(nk), dv(nv);
    Dev<float> dout(rows * qrow), dlse(size_t{rows} * kQHeads);
    dout.Poison();                     // NaN: every row must be written
    Dev<uint16_t> dcast(rows * qrow);  // the output in the model's dtype too
    dcast.Poison();
    st.out_cast = dcast.p;
    st.out_cast_dtype = DType::kBF16;
    // (the delayed copies' sources: pinned, so the copies are queued, not done at once)
    std::unique_ptr<uint16_t, decltype(&cudaFreeHost)> pinned(nullptr, &cudaFreeHost);
    if (stream != nullptr) {
      dq.Zero();
      dk.Zero();
      dv.Zero();
      void* h = nullptr;
      cudaMallocHost(&h, std::max<size_t>(1, (q.size() + nk.size() + nv.size()) * 2));
      pinned.reset(static_cast<uint16_t*>(h));
      uint16_t* hq = pinned.get();
      uint16_t* hk = hq + q.size();
      uint16_t* hv = hk + nk.size();
      std::copy(q.begin(), q.end(), hq);
      std::copy(nk.begin(), nk.end(), hk);
      std::copy(nv.begin(), nv.end(), hv);
      cudaDeviceSynchronize();  // (the zeros and the poison are in place)
      cudaLaunchHostFunc(
          stream, [](void*) { absl::SleepFor(absl::Milliseconds(30)); }, nullptr);
      cudaMemcpyAsync(dq.p, hq, q.size() * 2, cudaMemcpyHostToDevice, stream);
      cudaMemcpyAsync(dk.p, hk, nk.size() * 2, cudaMemcpyHostToDevice, stream);
      cudaMemcpyAsync(dv.p, hv, nv.size() * 2, cudaMemcpyHostToDevice, stream);
      st.stream_ordered = true;
      st.stream = stream;
    }
    st.q = QueryTensor{dq.p, DType::kBF16, rows, kQHeads, kLayout.head_dim, pos.data(), nullptr};
    st.new_k = dk.p;
    st.new_v = dv.p;
    Result r;
    const absl::Time t0 = absl::Now();
    r.status = client.StepInto(st, PartialOutput{dout.p, dlse.p}, &r.report);
    r.call_seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    if (!r.status.ok()) return r;
    if (stream != nullptr) {
      // Read through work queued after the step: it sees the output.
      Dev<float> cout(dout.n), clse(dlse.n);
      Dev<uint16_t> ccast(dcast.n);
      cudaMemcpyAsync(cout.p, dout.p, dout.n * 4, cudaMemcpyDeviceToDevice, stream);
      cudaMemcpyAsync(clse.p, dlse.p, dlse.n * 4, cudaMemcpyDeviceToDevice, stream);
      cudaMemcpyAsync(ccast.p, dcast.p, dcast.n * 2, cudaMemcpyDeviceToDevice, stream);
      cudaStreamSynchronize(stream);
      r.out = cout.Host();
      r.lse = clse.Host();
      r.cast = ccast.Host();
    } else {
      r.out = dout.Host();
      r.lse = dlse.Host();
      r.cast = dcast.Host();
    }
    // The reference, row by row, over each sequence's tokens on the layer.
    for (uint32_t i = 0, row = 0; i < parts.size(); ++i) {
      const auto& e = kv_[{parts[i].id, layer}];
      if (parts[i].rows == 0) continue;
      reference::DenseKv d;
      d.kv_heads = kLayout.kv_heads;
      d.head_dim = kLayout.head_dim;
      d.positions = e.positions;
      d.k = e.k;
      d.v = e.v;
      std::vector<double> qd;
      for (size_t k = row * qrow; k < (row + parts[i].rows) * qrow; ++k) qd.push_back(Bf16ToFloat(q[k]));
      std::vector<int64_t> qp(pos.begin() + row, pos.begin() + row + parts[i].rows);
      AttentionOptions o;
      o.layer = layer;
      auto ref = reference::Attention(qd, qp, kQHeads, d, o);
      r.ref_out.insert(r.ref_out.end(), ref.out.begin(), ref.out.end());
      r.ref_lse.insert(r.ref_lse.end(), ref.lse.begin(), ref.lse.end());
      row += parts[i].rows;
    }
    return r;
  }

 private:
  struct Kv {
    std::vector<int64_t> positions;
    std::vector<double> k, v;
  };
  std::mt19937_64 rng_;
  std::map<std::pair<std::string, uint32_t>, Kv> kv_;
};

// bf16 inputs, fp32 accumulation: relative L2 of O within 1e-2 of the
// float64 reference, LSE within 1e-2.
void ExpectMatchesReference(const Engine::Result& r, const std::string& what) {
  ASSERT_TRUE(r.status.ok()) << what << ": " << r.status;
  ASSERT_EQ(r.out.size(), r.ref_out.size()) << what;
  double num = 0, den = 0;
  for (size_t i = 0; i < r.out.size(); ++i) {
    ASSERT_FALSE(std::isnan(r.out[i])) << what << ": element " << i << " not written";
    num += (r.out[i] - r.ref_out[i]) * (r.out[i] - r.ref_out[i]);
    den += r.ref_out[i] * r.ref_out[i];
  }
  EXPECT_LT(std::sqrt(num / den), 1e-2) << what;
  for (size_t i = 0; i < r.lse.size(); ++i) ASSERT_NEAR(r.lse[i], r.ref_lse[i], 1e-2) << what << " lse " << i;
  // The output in the model's dtype is the float32 output rounded to bf16,
  // every element (the merge writes both from one value).
  ASSERT_EQ(r.cast.size(), r.out.size()) << what;
  for (size_t i = 0; i < r.out.size(); ++i) ASSERT_EQ(r.cast[i], FloatToBf16(r.out[i])) << what << ": cast " << i;
}

// `exchange_min_bytes`: ClientOptions::device_exchange_min_bytes (-1: its default).
ClientOptions Options(const Cluster& cl, const std::string& token, bool device_delivery,
                      int64_t exchange_min_bytes = -1) {
  ClientOptions co;
  co.coordinator = cl.coordinator_address();
  co.token = token;
  co.device_delivery = device_delivery;
  if (exchange_min_bytes >= 0) co.device_exchange_min_bytes = static_cast<uint64_t>(exchange_min_bytes);
  return co;
}

std::vector<std::string> GpuFlags() { return {"--gpu=0", "--hbm_bytes=256M"}; }

// Two nodes with `replication` replicas and 2-block chunks (a sequence's
// blocks alternate between them), GPU daemons unless `gpu` is false (the
// test starts its daemons itself then).
ClusterOptions TwoNodes(int replication, bool gpu = true) {
  ClusterOptions o{.nodes = 2, .replication = replication, .page_bytes = "1M"};
  if (gpu) o.extra_daemon_flags = GpuFlags();
  o.extra_coordinator_flags = {"--sequence_chunk_blocks=2"};
  return o;
}

TEST(GpuExchangeTest, StepsWithDeviceTensorsRunInTheClientsMemoryAndMatchTheReference) {
  KVRING_REQUIRE_GPU();
  // Two GPU nodes, R=1: every step's rows are merged from both.
  Cluster cl(TwoNodes(1));
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("engine");
  ASSERT_TRUE(token.ok()) << token.status();
  auto dev = Client::Connect(Options(cl, *token, true, /*exchange_min_bytes=*/0));  // every step
  auto staged = Client::Connect(Options(cl, *token, false));
  ASSERT_TRUE(dev.ok() && staged.ok());
  Engine e(7), e2(7);  // the same inputs for both clients, on sequences of their own
  // A prefill chunk (rows see their causal prefix; 819 rows merged from
  // both nodes: more merge indexes than a launch's parameters carry), then
  // decode steps that cross block boundaries, a batch of three with one
  // that only appends.
  const std::vector<std::vector<Engine::Part>> steps = {
      {{"a", 740, 740}, {"b", 9, 9}, {"c", 70, 70}},
      {{"a", 1, 1}, {"b", 1, 1}, {"c", 1, 1}},
      {{"a", 1, 1}, {"b", 0, 1}, {"c", 2, 2}},
      {{"a", 3, 3}, {"b", 1, 1}, {"c", 1, 1}},
  };
  int in_place = 0, shards = 0;
  for (size_t s = 0; s < steps.size(); ++s) {
    for (uint32_t l = 0; l < kLayout.layers; ++l) {
      const std::string what = absl::StrCat("step ", s, " layer ", l);
      Engine::Result r = e.Step(**dev, l, steps[s]);
      ExpectMatchesReference(r, what);
      in_place += r.report.shards_in_place;
      shards += r.report.shards;
      std::vector<Engine::Part> renamed = steps[s];
      for (auto& p : renamed) p.id = "staged-" + p.id;
      Engine::Result r2 = e2.Step(**staged, l, renamed);
      ExpectMatchesReference(r2, what + " (staged)");
      EXPECT_EQ(r2.report.shards_in_place, 0);
      // The two sequences' chunks lie on different nodes (placement hashes the
      // id), so their partials split the keys differently and the kernels
      // round P to bf16 against different running maxima: equal to bf16
      // precision, not bit for bit.
      ASSERT_EQ(r.out.size(), r2.out.size());
      double num = 0, den = 0;
      for (size_t i = 0; i < r.out.size(); ++i) {
        num += (r.out[i] - r2.out[i]) * (r.out[i] - r2.out[i]);
        den += r2.out[i] * r2.out[i];
      }
      EXPECT_LT(std::sqrt(num / den), 5e-3) << what;
      // In place, only the requests cross: far fewer bytes than the staged step.
      EXPECT_LT(r.report.bytes_sent + r.report.bytes_received, r2.report.bytes_sent + r2.report.bytes_received) << what;
    }
  }
  EXPECT_GT(shards, 0);
  EXPECT_EQ(in_place, shards);
}

TEST(GpuExchangeTest, StepsOrderedOnTheCallersStreamWaitForItsInputsOnTheDevice) {
  KVRING_REQUIRE_GPU();
  Cluster cl(TwoNodes(1));
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("engine");
  ASSERT_TRUE(token.ok()) << token.status();
  int ipc_events = 0;
  cudaDeviceGetAttribute(&ipc_events, cudaDevAttrIpcEventSupport, 0);
  // The nodes answer once their work is done, or once it is queued
  // (ClientOptions::node_reply_when_queued, the default).
  for (bool early : {false, true}) {
    ClientOptions co = Options(cl, *token, true);
    co.node_reply_when_queued = early;
    auto c = Client::Connect(co);
    ASSERT_TRUE(c.ok());
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    Engine e(early ? 21 : 31);
    const std::string a = early ? "a" : "a0", b = early ? "b" : "b0";
    const std::vector<std::vector<Engine::Part>> steps = {
        {{a, 40, 40}, {b, 9, 9}},
        {{a, 1, 1}, {b, 1, 1}},
        {{a, 1, 1}, {b, 0, 1}},
        {{a, 2, 2}, {b, 1, 1}},
    };
    int waited_on_device = 0, calls = 0, replied_queued = 0, decode_calls = 0, returned_early = 0, by_flag = 0,
        shards_queued = 0;
    for (size_t s = 0; s < steps.size() + 4; ++s) {
      // (then 4 more decode steps, once every lane's buffers have grown)
      const bool decode = s >= steps.size();
      for (uint32_t l = 0; l < kLayout.layers; ++l) {
        const std::string what =
            absl::StrCat(early ? "replied when queued" : "replied when done", ", step ", s, " layer ", l);
        Engine::Result r = e.Step(**c, l, decode ? std::vector<Engine::Part>{{a, 1, 1}, {b, 1, 1}} : steps[s], stream);
        ExpectMatchesReference(r, what);
        EXPECT_EQ(r.report.shards_in_place, r.report.shards) << what;
        waited_on_device += r.report.inputs_waited_on_device ? 1 : 0;
        // (a round refused before the sequences existed on a node counts as
        // a shard that did not answer with its work queued)
        if (r.report.shards_replied_queued > 0) ++replied_queued;
        shards_queued += r.report.shards_replied_queued;
        by_flag += r.report.shards_done_by_flag;
        if (decode) {
          ++decode_calls;
          // Every node answered with its work still queued behind the 30 ms
          // host function: the call did not wait for it.
          if (early) {
            EXPECT_EQ(r.report.shards_replied_queued, r.report.shards) << what;
          }
          returned_early += r.call_seconds < 0.025 ? 1 : 0;
        }
        ++calls;
      }
    }
    // Where the device has IPC events, the nodes waited on them every time;
    // asked to, they answered before their work was done (the output above
    // was read through the stream: exact) and, once the lanes' buffers have
    // grown (a growth frees device memory, which waits for the device), the
    // calls returned before the stream reached the inputs. Else the calls
    // waited for the work.
    if (ipc_events) {
      EXPECT_EQ(waited_on_device, calls);
      EXPECT_EQ(replied_queued, early ? calls : 0);
      if (early) {
        EXPECT_GE(returned_early, decode_calls * 3 / 4);
        // Where the driver has stream memory operations, every node that
        // answered early set the client's word, not an event.
        if (StreamWordsAvailable()) {
          EXPECT_EQ(by_flag, shards_queued);
        }
      } else {
        EXPECT_EQ(returned_early, 0);
      }
    }
    std::cout << (early ? "replied when queued" : "replied when done") << ": IPC events: " << ipc_events
              << "; steps whose nodes waited on the device: " << waited_on_device << " of " << calls
              << "; answered with their work queued: " << replied_queued << "; decode steps that returned before "
              << "the stream reached the inputs: " << returned_early << " of " << decode_calls
              << "; shards whose work the stream waited for by a word: " << by_flag << " of " << shards_queued << "\n";
    // The legacy default stream works the same way.
    Engine e2(early ? 22 : 32);
    Engine::Result r = e2.Step(**c, 0, {{early ? "z" : "z0", 5, 5}}, cudaStreamLegacy);
    ExpectMatchesReference(r, "on the legacy default stream");
    cudaStreamDestroy(stream);
  }
}

// Two replicas (R=2) answering once queued, the default: every append goes
// to both nodes, the rows to one, so each step sends one node appends alone
// (no kernel on its lane). Such a step's lane, reaped after the reply, must
// not time a kernel it never recorded (that left cudaErrorInvalidResourceHandle
// for the next launch on the node's thread: "appending K/V into HBM pages",
// hf_e2e on 2026-12-07). Exact at every step.
TEST(GpuExchangeTest, StepsOrderedOnTwoReplicasAnsweredOnceQueuedStayExact) {
  KVRING_REQUIRE_GPU();
  Cluster cl(TwoNodes(2));
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("engine");
  ASSERT_TRUE(token.ok()) << token.status();
  auto c = Client::Connect(Options(cl, *token, true));
  ASSERT_TRUE(c.ok());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  Engine e(41);
  for (int s = 0; s < 12; ++s) {
    for (uint32_t l = 0; l < kLayout.layers; ++l) {
      const std::string what = absl::StrCat("R=2, step ", s, " layer ", l);
      const std::vector<Engine::Part> parts = s == 0 ? std::vector<Engine::Part>{{"r", 40, 40}, {"q", 9, 9}}
                                                     : std::vector<Engine::Part>{{"r", 1, 1}, {"q", 1, 1}};
      Engine::Result r = e.Step(**c, l, parts, stream);
      ASSERT_NO_FATAL_FAILURE(ExpectMatchesReference(r, what));
    }
  }
  cudaStreamDestroy(stream);
}

// Detached steps (ClientOptions::detach_device_steps): the call returns
// once the requests are out, the stream waits for the nodes' words and
// merges; the replies are collected on the client's thread. Exact at every
// step, read through the stream. Then a node is killed: the steps that
// reached it fail in the collector, which sets their words (the stream goes
// on: the reads below would hang otherwise), and a later call returns the
// failure.
TEST(GpuExchangeTest, DetachedStepsStayExactAndAFailureComesBackOnALaterCall) {
  KVRING_REQUIRE_GPU();
  int ipc_events = 0;
  cudaDeviceGetAttribute(&ipc_events, cudaDevAttrIpcEventSupport, 0);
  if (!ipc_events || !StreamWordsAvailable()) GTEST_SKIP() << "needs IPC events and stream memory operations";
  Cluster cl(TwoNodes(1));
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("engine");
  ASSERT_TRUE(token.ok()) << token.status();
  ClientOptions co = Options(cl, *token, true);
  co.detach_device_steps = true;
  auto c = Client::Connect(co);
  ASSERT_TRUE(c.ok());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  Engine e(51);
  int detached = 0, decode_calls = 0, returned_early = 0;
  for (int s = 0; s < 10; ++s) {
    for (uint32_t l = 0; l < kLayout.layers; ++l) {
      const std::string what = absl::StrCat("detached, step ", s, " layer ", l);
      const std::vector<Engine::Part> parts = s == 0 ? std::vector<Engine::Part>{{"d", 40, 40}, {"e", 9, 9}}
                                                     : std::vector<Engine::Part>{{"d", 1, 1}, {"e", 1, 1}};
      Engine::Result r = e.Step(**c, l, parts, stream);
      ASSERT_NO_FATAL_FAILURE(ExpectMatchesReference(r, what));
      if (s > 0) {
        ++decode_calls;
        detached += r.report.shards_detached > 0 ? 1 : 0;
        returned_early += r.call_seconds < 0.025 ? 1 : 0;
      }
    }
  }
  // Every decode step went on without its replies, and returned before the
  // stream reached its inputs (queued behind a 30 ms host function).
  EXPECT_EQ(detached, decode_calls);
  EXPECT_GE(returned_early, decode_calls * 3 / 4);
  // The replies are all in, and none failed: the sequences list their tokens.
  auto listed = (*c)->ListSequences({"d", "e"});
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 2u);
  cl.KillDaemon(1);
  absl::Status failure;
  for (int s = 0; s < 6 && failure.ok(); ++s) {
    Engine::Result r = e.Step(**c, 0, {{"d", 1, 1}, {"e", 1, 1}}, stream);
    failure = r.status;
    if (failure.ok()) ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // (the stream went on)
  }
  // (from the collector: "a detached step (layer 0 of sequence 'd' ...)
  // failed on node ..."; or, where the client already knew the node was
  // gone when it sent, from the step itself)
  ASSERT_FALSE(failure.ok()) << "a step on the killed node never failed";
  std::cout << "after the kill: " << failure << "\n";
  cudaStreamDestroy(stream);
}

TEST(GpuExchangeTest, ACpuNodeRefusesTheExchangeAndIsServedThroughStaging) {
  KVRING_REQUIRE_GPU();
  Cluster cl(TwoNodes(1, /*gpu=*/false));
  ASSERT_TRUE(cl.StartCoordinator());
  ASSERT_TRUE(cl.StartDaemon(0, GpuFlags()));
  ASSERT_TRUE(cl.StartDaemon(1));
  ASSERT_TRUE(cl.WaitForNodesUp(2));
  auto token = cl.CreateTenant("engine");
  ASSERT_TRUE(token.ok());
  // Two thresholds. The default (0): every step goes through the exchange
  // on the GPU node, decode steps included. 1 MiB (what hosts without MPS
  // set): the first (prefill) step goes through the exchange, the one-row
  // decode steps are staged. The CPU node's share is staged either way.
  for (int64_t threshold : {int64_t{-1}, int64_t{1} << 20}) {
    const std::string what = absl::StrCat("threshold ", threshold);
    auto c = Client::Connect(Options(cl, *token, true, threshold));
    ASSERT_TRUE(c.ok());
    Engine e(11);
    const std::string a = absl::StrCat("a", threshold), b = absl::StrCat("b", threshold);
    int in_place = 0, shards = 0, decode_in_place = 0;
    for (int s = 0; s < 4; ++s) {
      for (uint32_t l = 0; l < kLayout.layers; ++l) {
        Engine::Result r = e.Step(**c, l,
                                  s == 0 ? std::vector<Engine::Part>{{a, 64, 64}, {b, 20, 20}}
                                         : std::vector<Engine::Part>{{a, 1, 1}, {b, 1, 1}});
        ExpectMatchesReference(r, absl::StrCat(what, " step ", s, " layer ", l));
        if (s > 0) decode_in_place += r.report.shards_in_place;
        in_place += r.report.shards_in_place;
        shards += r.report.shards;
      }
    }
    EXPECT_GT(in_place, 0) << what;       // the GPU node's
    EXPECT_LT(in_place, shards) << what;  // the CPU node's through staging
    if (threshold < 0) {
      EXPECT_GT(decode_in_place, 0) << what;
    } else {
      EXPECT_EQ(decode_in_place, 0) << what << ": decode steps under the threshold";
    }
  }
}

}  // namespace
}  // namespace kvring
