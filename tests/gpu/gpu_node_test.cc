// A GPU node in process: NodeCore over the CUDA attention backend (HBM pages,
// device page tables, decode in place), every answer against the float64
// reference over the same bf16 K/V; HBM pressure (idle sequences dropped and
// promoted back), quantized pages, the CPU fallback for layouts the kernels
// do not take, and a poisoned CUDA context.
#include <cmath>
#include <map>
#include <random>

#include "gpu_test_util.h"
#include "kvring/attention/reference.h"
#include "kvring/cache/quantize.h"
#include "kvring/common/cuda_status.h"
#include "kvring/common/status_macros.h"
#include "kvring/control/cuda_attention_backend.h"
#include "kvring/control/node_core.h"
#include "kvring/control/node_wire.h"
#include "kvring/control/request_validation.h"

// Launches a kernel that writes through a null pointer (gpu_fault_kernel.cu).
extern "C" cudaError_t KvringTestLaunchFault();

namespace kvring {
namespace {

using namespace gpu_testing;

class GpuNode {
 public:
  GpuNode(BlockLayout layout, uint32_t q_heads, uint64_t hbm_pages,
          std::function<void(const absl::Status&)> on_fatal = nullptr, int lanes = 2)
      : L_(layout), q_heads_(q_heads) {
    BlockStoreOptions so;
    so.page_bytes = std::max<uint64_t>(layout.bytes(), 1 << 16);
    so.num_pages = 4096;
    so.prefault = false;
    so.register_memory = CudaRegisterHostMemory;
    so.unregister_memory = CudaUnregisterHostMemory;
    store_ = std::move(BlockStore::Create(so).value());
    seqs_ = std::move(SequenceTable::Create(nullptr).value());
    CudaBackendOptions co;
    co.hbm_bytes = hbm_pages * so.page_bytes;
    co.page_bytes = so.page_bytes;
    co.lanes = lanes;
    co.on_fatal = std::move(on_fatal);
    auto b = MakeCudaAttentionBackend(co, store_.get(), nullptr);
    status_ = b.status();
    if (!b.ok()) return;
    backend_ = std::move(*b);
    NodeCoreOptions no;
    no.limits.max_payload_bytes = so.page_bytes;
    core_ = std::make_unique<NodeCore>(no, store_.get(), seqs_.get(), backend_.get(), &tenants_, &metrics_);
    tenant_.set_id(1);
    tenant_.set_name("t");
    tenant_.set_namespace_(TenantNamespace(tenant_.id()));
  }
  const absl::Status& status() const { return status_; }

  struct Part {
    std::string id;
    uint32_t rows = 0, append = 0;
  };
  // One step on `layer`; every row checked against the reference (relative
  // L2 of O below `tol`, LSE within `tol`).
  absl::Status Step(uint32_t layer, const std::vector<Part>& parts, double tol = 1e-2) {
    AttendBatch b;
    b.shape.options.layer = layer;
    b.shape.q_heads = q_heads_;
    b.shape.head_dim = L_.head_dim;
    b.shape.q_dtype = DType::kBF16;
    b.layout = L_;
    b.quantize = quantize;
    std::vector<uint16_t> q;
    std::vector<double> nk, nv;  // the appended values, as the layout's dtype holds them
    std::normal_distribution<float> nd;
    const size_t kvn = size_t{L_.kv_heads} * L_.head_dim, qn = size_t{q_heads_} * L_.head_dim;
    for (const Part& p : parts) {
      const uint64_t before = k_[p.id][layer].size() / kvn;
      AttendSequenceSpec s{p.id, {}, before + p.append, p.rows, p.append, before};
      s.placement_digest = digest_[p.id];
      for (size_t i = 0; i < p.append * kvn; ++i) {
        nk.push_back(Round(nd(rng_)));
        nv.push_back(Round(nd(rng_)));
      }
      if (p.rows > 0) s.ranges = {{0, (s.tokens + L_.block_tokens - 1) / L_.block_tokens}};
      for (uint32_t r = 0; r < p.rows; ++r) {
        b.positions.push_back(static_cast<int64_t>(s.tokens - p.rows + r));
        for (size_t i = 0; i < qn; ++i) q.push_back(FloatToBf16(nd(rng_)));
      }
      b.shape.num_rows += p.rows;
      b.sequences.push_back(s);
    }
    b.queries = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(q.data()), q.size() * 2);
    const std::vector<uint8_t> kb = Encode(nk), vb = Encode(nv);
    b.new_k = kb;
    b.new_v = vb;
    std::vector<float> out(size_t{b.shape.num_rows} * qn, std::nanf("")),
        lse(size_t{b.shape.num_rows} * q_heads_, std::nanf(""));
    absl::Status s = core_->Attend(tenant_, "", b, PartialOutput{out.data(), lse.data()}, &last_);
    if (!s.ok()) return s;
    for (const absl::Status& ss : last_.sequence_status) {
      if (!ss.ok()) return ss;
    }
    size_t off = 0;
    for (const Part& p : parts) {
      auto& k = k_[p.id][layer];
      auto& v = v_[p.id][layer];
      k.insert(k.end(), nk.begin() + off, nk.begin() + off + p.append * kvn);
      v.insert(v.end(), nv.begin() + off, nv.begin() + off + p.append * kvn);
      off += p.append * kvn;
    }
    uint32_t row = 0;
    for (const Part& p : parts) {
      if (p.rows == 0) continue;
      std::vector<double> qd;
      for (size_t i = row * qn; i < (row + p.rows) * qn; ++i) qd.push_back(Bf16ToFloat(q[i]));
      std::vector<int64_t> pos(b.positions.begin() + row, b.positions.begin() + row + p.rows);
      AttentionOptions o;
      o.layer = layer;
      auto ref = reference::Attention(qd, pos, q_heads_, Dense(p.id, layer), o);
      double num = 0, den = 0, lerr = 0;
      for (size_t i = 0; i < ref.out.size(); ++i) {
        const double g = out[row * qn + i];
        if (std::isnan(g)) return absl::InternalError(absl::StrCat(p.id, ": output not written"));
        num += (g - ref.out[i]) * (g - ref.out[i]);
        den += ref.out[i] * ref.out[i];
      }
      for (size_t i = 0; i < ref.lse.size(); ++i) {
        lerr = std::max(lerr, std::abs(lse[row * q_heads_ + i] - ref.lse[i]) / std::max(1.0, std::abs(ref.lse[i])));
      }
      if (!(den > 0) || std::sqrt(num / den) > tol || lerr > tol) {
        return absl::InternalError(
            absl::StrCat(p.id, " layer ", layer, ": rel L2 ", std::sqrt(num / den), ", lse err ", lerr));
      }
      row += p.rows;
    }
    return absl::OkStatus();
  }

  reference::DenseKv Dense(const std::string& id, uint32_t layer) {
    reference::DenseKv d;
    d.kv_heads = L_.kv_heads;
    d.head_dim = L_.head_dim;
    const auto& k = k_[id][layer];
    const auto& v = v_[id][layer];
    for (size_t t = 0; t < k.size() / (size_t{L_.kv_heads} * L_.head_dim); ++t)
      d.positions.push_back(static_cast<int64_t>(t));
    d.k = k;
    d.v = v;
    return d;
  }

  // A value as the layout's dtype stores it, and values as its bytes.
  double Round(float x) const { return L_.dtype == DType::kF32 ? x : Bf16ToFloat(FloatToBf16(x)); }
  std::vector<uint8_t> Encode(const std::vector<double>& xs) const {
    std::vector<uint8_t> out(xs.size() * DTypeSize(L_.dtype));
    for (size_t i = 0; i < xs.size(); ++i) {
      if (L_.dtype == DType::kF32) {
        const float f = static_cast<float>(xs[i]);
        std::memcpy(out.data() + 4 * i, &f, 4);
      } else {
        const uint16_t h = FloatToBf16(static_cast<float>(xs[i]));
        std::memcpy(out.data() + 2 * i, &h, 2);
      }
    }
    return out;
  }

  // Puts `n` random full blocks of sequence `id` (PutSequence), recording
  // their K/V as the engine's; `quantize` as PutRequest.quantize.
  absl::Status PutBlocks(const std::string& id, uint64_t n, const std::string& quantize = "") {
    v1::PutRequest put;
    put.mutable_header()->set_version(1);
    put.set_quantize(quantize.empty() ? "none" : quantize);
    std::normal_distribution<float> nd;
    const uint64_t first = k_[id][0].size() / (size_t{L_.kv_heads} * L_.head_dim) / L_.block_tokens;
    std::vector<std::vector<uint16_t>> blocks(n, std::vector<uint16_t>(L_.elements()));
    for (uint64_t i = 0; i < n; ++i) {
      for (uint32_t l = 0; l < L_.layers; ++l)
        for (uint32_t t = 0; t < L_.block_tokens; ++t)
          for (uint32_t h = 0; h < L_.kv_heads; ++h)
            for (uint32_t d = 0; d < L_.head_dim; ++d) {
              const uint16_t kx = FloatToBf16(nd(rng_)), vx = FloatToBf16(nd(rng_));
              blocks[i][L_.index(l, 0, h, t, d)] = kx;
              blocks[i][L_.index(l, 1, h, t, d)] = vx;
              k_[id][l].push_back(Bf16ToFloat(kx));
              v_[id][l].push_back(Bf16ToFloat(vx));
            }
      v1::PutBlock* pb = put.add_blocks();
      KeyToProto(BlockKey{rng_() | 1, rng_()}, pb->mutable_block()->mutable_key());
      LayoutToProto(L_, pb->mutable_block()->mutable_layout());
      pb->mutable_block()->set_payload_bytes(static_cast<uint32_t>(L_.bytes()));
      pb->set_payload(reinterpret_cast<const char*>(blocks[i].data()), L_.bytes());
      pb->mutable_sequence()->set_sequence_id(id);
      pb->mutable_sequence()->set_block_index(first + i);
    }
    v1::PutResponse resp;
    KVRING_RETURN_IF_ERROR(WirePut(*core_, tenant_, put, {}, &resp));
    for (const auto& r : resp.results()) {
      if (r.status().code() != 0) return StatusFromProto(r.status());
    }
    return absl::OkStatus();
  }

  // Forks `dst` from the first `tokens` tokens of `src` (the engine's view
  // follows: the source's tokens, then the fork's own).
  absl::Status Fork(const std::string& src, const std::string& dst, uint64_t tokens) {
    const SequencePlacement p = SequencePlacement().Fork(src, 1).value();
    KVRING_RETURN_IF_ERROR(core_->ForkSequence(tenant_, "", src, dst, tokens, p).status());
    digest_[dst] = p.Digest();
    const size_t n = tokens * L_.kv_heads * L_.head_dim;
    for (auto& [layer, k] : k_[src]) k_[dst][layer].assign(k.begin(), k.begin() + n);
    for (auto& [layer, v] : v_[src]) v_[dst][layer].assign(v.begin(), v.begin() + n);
    return absl::OkStatus();
  }
  absl::Status Delete(const std::string& id) {
    k_.erase(id);
    v_.erase(id);
    return core_->DeleteSequence(tenant_, "", id).status();
  }

  BackendStats stats() { return backend_->stats(); }
  // The tenant is deleted: the node reclaims its sequences.
  absl::StatusOr<ReclaimResult> DeleteTenant() {
    v1::TenantTable table;
    table.set_tenants_version(2);
    table.add_deleted_tenant_ids(tenant_.id());
    tenants_.Update(table);
    return core_->ReclaimDeletedTenants();
  }
  const AttendStats& last() const { return last_; }
  NodeCore& core() { return *core_; }
  std::optional<KvEncoding> quantize;  // what the steps' completed blocks are stored as (AttendBatch::quantize)
  const v1::Tenant& tenant() const { return tenant_; }

 private:
  BlockLayout L_;
  uint32_t q_heads_;
  std::mt19937_64 rng_{7};
  absl::Status status_;
  std::unique_ptr<BlockStore> store_;
  std::unique_ptr<SequenceTable> seqs_;
  std::unique_ptr<AttentionBackend> backend_;
  TenantDirectory tenants_;
  MetricsRegistry metrics_;
  std::unique_ptr<NodeCore> core_;
  v1::Tenant tenant_;
  AttendStats last_;
  std::map<std::string, std::map<uint32_t, std::vector<double>>> k_, v_;
  std::map<std::string, uint64_t> digest_;  // placement digest each sequence is routed by
};

// Appends to a sequence stored int8: the tail is plain while open; each
// completed block is stored int8 and its HBM page given back (the page holds
// the plain bytes; the codes are promoted from the store). A step over the
// int8 blocks and the plain tail runs as two (NodeCore::StepTwoEncodings)
// merged by LSE; against the plain reference, within the codes' error.
TEST(GpuNodeTest, AQuantizedSequenceAppendsAndAttendsOverItsCodesAndItsPlainTail) {
  KVRING_REQUIRE_GPU();
  GpuNode node(BlockLayout{16, 2, 2, 128, DType::kBF16}, 8, 64);
  ASSERT_TRUE(node.status().ok()) << node.status();
  KvEncoding int8;
  ASSERT_TRUE(ParseKvEncoding("int8", &int8).ok());
  node.quantize = int8;
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(node.Step(l, {{"a", 10, 10}}).ok());  // its open block only
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(node.Step(l, {{"a", 0, 22}}).ok());   // blocks 0, 1 complete
  EXPECT_EQ(node.last().completed_blocks, 2u);
  EXPECT_EQ(node.stats().open_blocks, 0u);
  for (int step = 0; step < 20; ++step) {  // decode across block 2 and into 3
    for (uint32_t l = 0; l < 2; ++l) {
      const absl::Status s = node.Step(l, {{"a", 1, 1}, {"b", 1, 1}}, 3e-2);
      ASSERT_TRUE(s.ok()) << "step " << step << " layer " << l << ": " << s;
    }
  }
  EXPECT_EQ(node.stats().open_blocks, 2u);  // a's block 3, b's block 1
}

TEST(GpuNodeTest, DecodeInPlaceInHbmMatchesTheReference) {
  KVRING_REQUIRE_GPU();
  for (uint32_t D : {128u, 64u, 256u}) {  // (256: Gemma's head dim)
    GpuNode node(BlockLayout{16, 2, 2, D, DType::kBF16}, 8, 64);
    ASSERT_TRUE(node.status().ok()) << node.status();
    // Prefill chunks (many rows: the prefill kernel), three sequences in one
    // launch; then decode steps of the batch (gathered tables) and of one
    // sequence alone (its own table, no gather).
    for (uint32_t l = 0; l < 2; ++l) {
      absl::Status s = node.Step(l, {{"a", 70, 70}, {"b", 20, 33}, {"c", 1, 1}});
      ASSERT_TRUE(s.ok()) << "D=" << D << " prefill: " << s;
    }
    EXPECT_EQ(node.last().backend, "cuda:0");
    EXPECT_GT(node.last().kernel_seconds, 0);
    for (int step = 0; step < 20; ++step) {
      for (uint32_t l = 0; l < 2; ++l) {
        absl::Status s = node.Step(l, {{"a", 1, 1}, {"b", 1, 1}, {"c", 1, 1}});
        ASSERT_TRUE(s.ok()) << "D=" << D << " step " << step << ": " << s;
      }
    }
    for (int step = 0; step < 20; ++step) {
      for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(node.Step(l, {{"b", 1, 1}}).ok()) << step;
    }
    // Every block filled on both layers was sealed into the store.
    const BackendStats st = node.stats();
    EXPECT_EQ(st.resident_blocks, (90u / 16) + (73u / 16) + (21u / 16));
    EXPECT_EQ(st.open_blocks, 3u);
    EXPECT_TRUE(st.healthy);
  }
}

// One lane serves steps of growing batches (more rows a call than the last):
// the decode merge's counters must be cleared where earlier calls left
// partials. Llama-3-70B's grouping (8 q heads a kv head), one lane.
TEST(GpuNodeTest, GrowingBatchesOnOneLaneStayExact) {
  KVRING_REQUIRE_GPU();
  GpuNode node(BlockLayout{16, 1, 8, 128, DType::kBF16}, 64, 1024, nullptr, /*lanes=*/1);
  ASSERT_TRUE(node.status().ok()) << node.status();
  for (const char* id : {"a", "b", "c", "d"}) ASSERT_TRUE(node.Step(0, {{id, 1, 3000}}).ok());
  for (int step = 0; step < 3; ++step) {
    absl::Status one = node.Step(0, {{"a", 1, 1}});
    ASSERT_TRUE(one.ok()) << step << ": " << one;
    absl::Status s = node.Step(0, {{"a", 1, 1}, {"b", 1, 1}, {"c", 1, 1}});
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s;
    EXPECT_EQ(node.stats().misses, 0u) << "every block stayed in HBM";
    s = node.Step(0, {{"a", 1, 1}, {"b", 1, 1}, {"c", 1, 1}, {"d", 2, 2}});
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s;
  }
}

TEST(GpuNodeTest, FullHbmDropsIdleSequencesAndPromotesThemBack) {
  KVRING_REQUIRE_GPU();
  GpuNode node(BlockLayout{16, 2, 2, 128, DType::kBF16}, 8, 12);
  ASSERT_TRUE(node.status().ok()) << node.status();
  ASSERT_TRUE(node.PutBlocks("a", 8).ok());
  ASSERT_TRUE(node.Step(0, {{"a", 2, 0}}).ok());
  const uint64_t misses0 = node.stats().misses;
  ASSERT_TRUE(node.PutBlocks("b", 8).ok());  // 16 blocks on 12 pages: a's pages are dropped for b's
  EXPECT_GT(node.stats().demotions, 0u);
  ASSERT_TRUE(node.Step(0, {{"b", 1, 0}}).ok());
  // a is promoted back from the host tier, and still exact.
  ASSERT_TRUE(node.Step(1, {{"a", 3, 0}}).ok());
  EXPECT_GT(node.stats().misses, misses0);
  // Both at once do not fit: RESOURCE_EXHAUSTED, not a crash; each alone works.
  absl::Status both = node.Step(0, {{"a", 1, 0}, {"b", 1, 0}});
  EXPECT_EQ(both.code(), absl::StatusCode::kResourceExhausted) << both;
  EXPECT_TRUE(node.Step(0, {{"b", 1, 0}}).ok());
  EXPECT_TRUE(node.stats().healthy);
}

// A deleted tenant's sequences give every HBM page back (full and open).
TEST(GpuNodeTest, ReclaimingADeletedTenantFreesItsHbm) {
  KVRING_REQUIRE_GPU();
  GpuNode node(BlockLayout{16, 2, 2, 128, DType::kBF16}, 8, 32);
  ASSERT_TRUE(node.status().ok()) << node.status();
  ASSERT_TRUE(node.PutBlocks("a", 4).ok());
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(node.Step(l, {{"a", 1, 5}, {"b", 1, 20}}).ok());
  ASSERT_GT(node.stats().pages - node.stats().free_pages, 0u);
  ASSERT_GT(node.stats().open_blocks, 0u);
  absl::StatusOr<ReclaimResult> r = node.DeleteTenant();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sequences, 2u);
  EXPECT_EQ(node.stats().free_pages, node.stats().pages);
  EXPECT_EQ(node.stats().open_blocks, 0u);
  EXPECT_EQ(node.stats().resident_blocks, 0u);
  EXPECT_TRUE(node.stats().healthy);
}

// A fork's full blocks are its source's in HBM too: one page, held by both
// sequences' tables (promoted once, never copied), while each side appends
// its own tokens exactly; the pages outlive the source and go back to the
// pool with the last holder.
TEST(GpuNodeTest, ForksShareTheirSourcesHbmPages) {
  KVRING_REQUIRE_GPU();
  GpuNode node(BlockLayout{16, 2, 2, 128, DType::kBF16}, 8, 64);
  ASSERT_TRUE(node.status().ok()) << node.status();
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(node.Step(l, {{"ctx", 3, 200}}).ok());  // 12 full blocks + 8
  const uint64_t used = node.stats().pages - node.stats().free_pages;
  EXPECT_EQ(used, 13u);
  ASSERT_TRUE(node.Fork("ctx", "f", 200).ok());
  for (uint32_t l = 0; l < 2; ++l) {
    absl::Status s = node.Step(l, {{"f", 2, 3}});
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(node.stats().shared_pages, 12u);
  EXPECT_EQ(node.stats().pages - node.stats().free_pages, used + 1) << "only the fork's copied tail block is new";
  for (int step = 0; step < 8; ++step) {
    for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(node.Step(l, {{"ctx", 1, 1}, {"f", 1, 1}}).ok()) << step;
  }
  ASSERT_TRUE(node.Delete("ctx").ok());
  EXPECT_EQ(node.stats().shared_pages, 0u);
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(node.Step(l, {{"f", 2, 1}}).ok());
  ASSERT_TRUE(node.Delete("f").ok());
  EXPECT_EQ(node.stats().free_pages, node.stats().pages);
  EXPECT_TRUE(node.stats().healthy);
}

TEST(GpuNodeTest, QuantizedPagesAreAttendedInHbmByDecodeAndPrefill) {
  KVRING_REQUIRE_GPU();
  for (const char* enc : {"int8", "fp8"}) {
    GpuNode node(BlockLayout{16, 2, 2, 128, DType::kBF16}, 8, 32);
    ASSERT_TRUE(node.status().ok()) << node.status();
    ASSERT_TRUE(node.PutBlocks("q", 12, enc).ok());
    // Against the plain blocks: within the codec's error.
    absl::Status s = node.Step(1, {{"q", 4, 0}}, 6e-2);
    EXPECT_TRUE(s.ok()) << enc << ": " << s;
    // A prefill chunk (150 rows x 4 q heads a kv head): the prefill kernel
    // over the same quantized pages.
    s = node.Step(1, {{"q", 150, 0}}, 6e-2);
    EXPECT_TRUE(s.ok()) << enc << " prefill: " << s;
    // Appends to a quantized sequence: its plain open tail and its codes in
    // one answer (NodeCore::StepTwoEncodings).
    s = node.Step(0, {{"q", 1, 1}}, 6e-2);
    EXPECT_TRUE(s.ok()) << enc << " append: " << s;
  }
}

TEST(GpuNodeTest, LayoutsTheKernelsDoNotTakeAreServedOnTheCpu) {
  KVRING_REQUIRE_GPU();
  GpuNode node(BlockLayout{8, 1, 2, 32, DType::kF32}, 4, 8);  // f32 KV, head_dim 32
  ASSERT_TRUE(node.status().ok()) << node.status();
  for (int step = 0; step < 12; ++step) ASSERT_TRUE(node.Step(0, {{"f", 1, 2}}, 1e-4).ok()) << step;
  EXPECT_EQ(node.stats().pages - node.stats().free_pages, 0u);  // nothing of it in HBM
}

// A kernel fault poisons the CUDA context: the backend turns unhealthy, runs
// on_fatal once and answers UNAVAILABLE from then on. (In a child process of
// its own: the context stays poisoned.)
TEST(GpuNodeDeathTest, APoisonedContextMarksTheNodeUnhealthy) {
  KVRING_REQUIRE_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        int fatal = 0;
        GpuNode node(BlockLayout{16, 2, 2, 128, DType::kBF16}, 8, 16, [&fatal](const absl::Status&) { ++fatal; });
        if (!node.status().ok() || !node.Step(0, {{"s", 1, 5}}).ok()) std::_Exit(10);
        (void)KvringTestLaunchFault();
        (void)cudaDeviceSynchronize();
        absl::Status s = node.Step(0, {{"s", 1, 1}});
        if (s.code() != absl::StatusCode::kInternal) std::_Exit(11);
        if (fatal != 1 || node.stats().healthy) std::_Exit(12);
        absl::Status again = node.Step(0, {{"s", 1, 1}});
        if (!absl::IsUnavailable(again) || fatal != 1) std::_Exit(13);
        std::fprintf(stderr, "unhealthy after: %s\n", std::string(s.message()).c_str());
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "unhealthy after: .*cudaError");
}

TEST(CudaStatusTest, NamesTheErrorAndMapsItsCode) {
  absl::Status s = CudaStatus(cudaErrorInvalidValue, "a launch");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("a launch: cudaErrorInvalidValue"), std::string::npos) << s;
  EXPECT_EQ(CudaStatus(cudaErrorMemoryAllocation, "x").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(CudaStatus(cudaSuccess, "x").ok());
  EXPECT_TRUE(CudaErrorIsSticky(cudaErrorIllegalAddress));
  EXPECT_FALSE(CudaErrorIsSticky(cudaErrorInvalidValue));
}

}  // namespace
}  // namespace kvring
