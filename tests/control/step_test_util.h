// An engine's side of attention steps in the tests: random queries and new
// K/V per step (bf16, so the reference reads exactly the bits the shards
// hold), the K/V the engine has appended so far (which it would not keep in
// production: here it is the reference's input), and the float64 reference
// for every row of a step.
#pragma once

#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvring/attention/reference.h"
#include "kvring/client/client.h"
#include "kvring/layout/float_convert.h"

namespace kvring::testing {

class StepSim {
 public:
  StepSim(BlockLayout layout, uint32_t q_heads, uint64_t seed) : L_(layout), q_heads_(q_heads), rng_(seed) {}

  struct Part {
    std::string id;
    uint32_t rows = 0;    // queries at the last `rows` positions after the append
    uint32_t append = 0;  // new tokens
  };

  // A step on `layer`: buffers the caller passes to Client::Step; Commit()
  // records the appended K/V once the step succeeded.
  struct Built {
    AttendStep step;
    std::vector<uint16_t> q, k, v;
    std::vector<int64_t> pos;
    std::vector<Part> parts;
    uint32_t layer = 0;
  };

  Built Build(uint32_t layer, const std::vector<Part>& parts) {
    Built b;
    b.layer = layer;
    b.parts = parts;
    std::normal_distribution<float> nd;
    const size_t kvn = size_t{L_.kv_heads} * L_.head_dim, qn = size_t{q_heads_} * L_.head_dim;
    for (const Part& p : parts) {
      const uint64_t ctx = tokens(p.id, layer);
      AttendSequence s{p.id, ctx, p.rows, p.append};
      for (size_t i = 0; i < p.append * kvn; ++i) {
        b.k.push_back(FloatToBf16(nd(rng_)));
        b.v.push_back(FloatToBf16(nd(rng_)));
      }
      for (uint32_t r = 0; r < p.rows; ++r) {
        b.pos.push_back(static_cast<int64_t>(ctx + p.append - p.rows + r));
        for (size_t i = 0; i < qn; ++i) b.q.push_back(FloatToBf16(nd(rng_)));
      }
      b.step.sequences.push_back(s);
    }
    b.step.layout = L_;
    b.step.q = QueryTensor{b.q.data(),   DType::kBF16, static_cast<uint32_t>(b.pos.size()), q_heads_, L_.head_dim,
                           b.pos.data(), nullptr};
    b.step.new_k = b.k.data();
    b.step.new_v = b.v.data();
    b.step.options.layer = layer;
    return b;
  }

  void Commit(const Built& b) {
    const size_t kvn = size_t{L_.kv_heads} * L_.head_dim;
    size_t off = 0;
    for (const Part& p : b.parts) {
      auto& k = k_[p.id][b.layer];
      auto& v = v_[p.id][b.layer];
      k.insert(k.end(), b.k.begin() + off, b.k.begin() + off + p.append * kvn);
      v.insert(v.end(), b.v.begin() + off, b.v.begin() + off + p.append * kvn);
      off += p.append * kvn;
    }
  }

  // Relative L2 error of `out` against the reference for every row of `b`
  // (run after Commit), and the max LSE error; -1 when an output is NaN.
  std::pair<double, double> Check(const Built& b, const PartialResult& out) {
    const size_t qn = size_t{q_heads_} * L_.head_dim;
    double num = 0, den = 0, lse_err = 0;
    uint32_t row = 0;
    for (const Part& p : b.parts) {
      if (p.rows == 0) continue;
      reference::DenseKv d;
      d.kv_heads = L_.kv_heads;
      d.head_dim = L_.head_dim;
      const auto& k = k_[p.id][b.layer];
      const auto& v = v_[p.id][b.layer];
      const size_t kvn = size_t{L_.kv_heads} * L_.head_dim;
      for (size_t t = 0; t < k.size() / kvn; ++t) d.positions.push_back(static_cast<int64_t>(t));
      for (uint16_t x : k) d.k.push_back(Bf16ToFloat(x));
      for (uint16_t x : v) d.v.push_back(Bf16ToFloat(x));
      std::vector<double> qd;
      for (size_t i = row * qn; i < (row + p.rows) * qn; ++i) qd.push_back(Bf16ToFloat(b.q[i]));
      std::vector<int64_t> pos(b.pos.begin() + row, b.pos.begin() + row + p.rows);
      AttentionOptions o;
      o.layer = b.layer;
      auto ref = reference::Attention(qd, pos, q_heads_, d, o);
      for (size_t i = 0; i < ref.out.size(); ++i) {
        const double g = out.out[row * qn + i];
        if (std::isnan(g)) return {-1, -1};
        num += (g - ref.out[i]) * (g - ref.out[i]);
        den += ref.out[i] * ref.out[i];
      }
      for (size_t i = 0; i < ref.lse.size(); ++i) {
        lse_err =
            std::max(lse_err, std::abs(out.lse[row * q_heads_ + i] - ref.lse[i]) / std::max(1.0, std::abs(ref.lse[i])));
      }
      row += p.rows;
    }
    return {den > 0 ? std::sqrt(num / den) : (num > 0 ? 1.0 : 0.0), lse_err};
  }

  // The engine's view cut back to `n` tokens on every layer (TruncateSequence).
  void Truncate(const std::string& id, uint64_t n) {
    const size_t kvn = size_t{L_.kv_heads} * L_.head_dim;
    for (auto* side : {&k_[id], &v_[id]}) {
      for (auto& [layer, vals] : *side) vals.resize(std::min<size_t>(vals.size(), n * kvn));
    }
  }
  // The engine's view of a fork: `dst` starts as the first `n` tokens of `src`.
  void Fork(const std::string& src, const std::string& dst, uint64_t n) {
    k_[dst] = k_[src];
    v_[dst] = v_[src];
    Truncate(dst, n);
  }
  uint64_t tokens(const std::string& id, uint32_t layer) {
    return k_[id][layer].size() / (size_t{L_.kv_heads} * L_.head_dim);
  }
  const BlockLayout& layout() const { return L_; }

 private:
  BlockLayout L_;
  uint32_t q_heads_;
  std::mt19937_64 rng_;
  std::map<std::string, std::map<uint32_t, std::vector<uint16_t>>> k_, v_;
};

// What an engine does while the cluster's map catches up with a death or a
// restart: one step of `parts` on every layer, each layer retried (up to 100
// tries, 100 ms apart) until it succeeds, or until it fails with `stop_at`
// (kOk: never stops early). Every answer is checked against the reference
// at a CPU node's precision; the steps' repairs are added to *repairs.
// Returns the last status.
inline absl::Status StepEveryLayerRetrying(Client& c, StepSim& sim, const std::vector<StepSim::Part>& parts,
                                           absl::StatusCode stop_at = absl::StatusCode::kOk, int* repairs = nullptr) {
  absl::Status last;
  for (uint32_t l = 0; l < sim.layout().layers; ++l) {
    auto b = sim.Build(l, parts);
    for (int attempt = 0; attempt < 100; ++attempt) {
      AttendReport rep;
      auto out = c.Step(b.step, &rep);
      if (repairs != nullptr) *repairs += rep.repairs;
      if (out.ok()) {
        sim.Commit(b);
        auto [err, lse_err] = sim.Check(b, *out);
        EXPECT_GE(err, 0);
        EXPECT_LT(err, 2e-5);
        EXPECT_LT(lse_err, 1e-4);
        last = absl::OkStatus();
        break;
      }
      last = out.status();
      if (last.code() == stop_at) return last;
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (!last.ok()) return last;
  }
  return last;
}

}  // namespace kvring::testing
