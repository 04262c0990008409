// The engine's side of a node's death during decode, shared by the fault
// tests of CPU daemons (tests/control/fault_test.cc) and of GPU daemons
// (tests/gpu/gpu_fault_test.cc): real processes, one of them SIGKILLed.
#pragma once

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "cluster_fixture.h"
#include "gtest/gtest.h"
#include "step_test_util.h"

namespace kvring::testing {

struct DecodeThroughDeathOptions {
  int write_quorum = 2;  // of R=2
  // Extra kvringd flags (GPU daemons: --gpu=0 and an HBM budget) and page size.
  std::vector<std::string> daemon_flags;
  std::string page_bytes;
  // Against the float64 reference over the same bf16 K/V: a CPU node
  // accumulates in fp32 (2e-5); the GPU kernels round P to bf16 (1e-2).
  double max_rel_l2 = 2e-5;
  double max_lse_err = 1e-4;
};

// Decode with append on 16 sequences over 4 daemons (R=2, chunks of 2
// blocks) while one daemon is killed; the engine as a real one acts: a
// token whose step fails is regenerated (new K/V) after a truncate to its
// position, from layer 0. Once the map no longer lists the dead node, each
// tail chunk's new replica refuses the first append with DATA_LOSS (it
// lacks the tail) and is repaired from the survivor (the chunk's blocks
// copied); from then on no step fails, at W=R and at W=1. No answer is ever
// wrong; at the end every sequence attends exactly over every layer.
inline void DecodeThroughANodesDeath(const DecodeThroughDeathOptions& o) {
  const int write_quorum = o.write_quorum;
  ClusterOptions co{
      .nodes = 4,
      .replication = 2,
      .extra_coordinator_flags = {absl::StrCat("--write_quorum=", write_quorum), "--sequence_chunk_blocks=2"}};
  if (!o.page_bytes.empty()) co.page_bytes = o.page_bytes;
  co.extra_daemon_flags = o.daemon_flags;
  Cluster cl(co);
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("decode");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  StepSim sim(SmallLayout(), 4, 31 + write_quorum);
  const uint32_t layers = SmallLayout().layers;
  std::vector<std::string> ids;
  for (int i = 0; i < 16; ++i) ids.push_back(absl::StrCat("s", i));
  std::vector<StepSim::Part> prefill, decode;
  for (int i = 0; i < 16; ++i) {
    prefill.push_back({ids[i], 1, static_cast<uint32_t>(20 + 3 * i)});
    decode.push_back({ids[i], 1, 1});
  }
  std::atomic<int> wrong{0}, failed_steps{0}, tokens_done{0}, repairs{0};
  std::atomic<bool> marked_down{false}, stop{false};
  std::atomic<int> failures_after_recovery{0};
  std::mutex mu;
  std::vector<std::string> failures;
  // One token on every layer; on a failure: truncate every sequence back to
  // the token's position and start the token again with new K/V.
  auto run_token = [&](const std::vector<StepSim::Part>& parts) {
    // Started once the client's map marks the dead node down: the repair's
    // side of the failure, where no step may fail.
    const bool after = marked_down.load();
    std::vector<uint64_t> at;
    for (const auto& p : parts) at.push_back(sim.tokens(p.id, 0));
    for (int attempt = 0; attempt < 200; ++attempt) {
      bool ok = true;
      for (uint32_t l = 0; l < layers && ok; ++l) {
        auto b = sim.Build(l, parts);
        AttendReport rep;
        auto out = (*c)->Step(b.step, &rep);
        repairs += rep.repairs;
        if (!out.ok()) {
          ok = false;
          ++failed_steps;
          if (after) ++failures_after_recovery;
          std::lock_guard<std::mutex> g(mu);
          failures.push_back(out.status().ToString());
          break;
        }
        sim.Commit(b);
        auto [err, lse_err] = sim.Check(b, *out);
        if (err < 0 || err > o.max_rel_l2 || lse_err > o.max_lse_err) ++wrong;
      }
      if (ok) {
        ++tokens_done;
        return true;
      }
      // Regenerate: back to the token's position everywhere (a node the map
      // still lists refuses the truncate until it is marked down), then again.
      for (size_t i = 0; i < parts.size(); ++i) {
        for (int t = 0; t < 100; ++t) {
          if ((*c)->TruncateSequence(parts[i].id, at[i]).ok()) break;
          absl::SleepFor(absl::Milliseconds(50));
        }
        sim.Truncate(parts[i].id, at[i]);
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  };
  ASSERT_TRUE(run_token(prefill));
  std::atomic<bool> gave_up{false};
  std::thread engine([&] {
    while (!stop) {
      if (!run_token(decode)) {
        gave_up = true;
        return;
      }
    }
  });
  absl::SleepFor(absl::Seconds(1));
  const int before_kill = tokens_done.load();
  cl.KillDaemon(1);
  const absl::Time killed = absl::Now();
  while (!marked_down && absl::Now() - killed < absl::Seconds(20)) {
    (void)(*c)->RefreshMap();
    for (const NodeStats& n : (*c)->Stats()) marked_down = marked_down || (n.state != "UP");
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(marked_down.load()) << "the coordinator never marked the killed node down";
  const int at_down = tokens_done.load();
  absl::SleepFor(absl::Seconds(3));
  stop = true;
  engine.join();
  EXPECT_FALSE(gave_up.load());
  EXPECT_GT(before_kill, 0);
  EXPECT_GT(tokens_done.load(), at_down + 5) << "decode did not go on after the node was marked down";
  EXPECT_EQ(wrong.load(), 0) << "a step returned a wrong answer";
  EXPECT_EQ(failures_after_recovery.load(), 0) << "a step failed after the repair: " << [&] {
    std::lock_guard<std::mutex> g(mu);
    return absl::StrJoin(failures, "\n");
  }();
  EXPECT_GT(repairs.load(), 0) << "no new replica was repaired";
  {
    std::lock_guard<std::mutex> g(mu);
    for (const std::string& f : failures) {
      // Before the map marks the node down: it does not answer (UNAVAILABLE,
      // or short of the write quorum); never a refusal the engine cannot act on.
      EXPECT_TRUE(absl::StrContains(f, "UNAVAILABLE") || absl::StrContains(f, "DATA_LOSS") ||
                  absl::StrContains(f, "DEADLINE"))
          << f;
    }
  }
  // Every sequence, every layer: exact over every acknowledged token.
  for (uint32_t l = 0; l < layers; ++l) {
    std::vector<StepSim::Part> all;
    for (const std::string& id : ids) all.push_back({id, 2, 0});
    auto b = sim.Build(l, all);
    auto out = (*c)->Step(b.step);
    ASSERT_TRUE(out.ok()) << out.status();
    auto [err, lse_err] = sim.Check(b, *out);
    EXPECT_GE(err, 0);
    EXPECT_LT(err, o.max_rel_l2);
    EXPECT_LT(lse_err, o.max_lse_err);
  }
  std::printf(
      "[fault]%s W=%d: %d tokens x 16 sequences (%d before the kill), %d failed steps (all before the map "
      "marked the node down), %d replicas repaired, %d wrong\n",
      o.daemon_flags.empty() ? "" : " GPU daemons,", write_quorum, tokens_done.load(), before_kill, failed_steps.load(),
      repairs.load(), wrong.load());
}

}  // namespace kvring::testing
