// NodeCore with the CPU attention backend: decode in place (appends that
// cross block boundaries, layer by layer), batched steps, sequences mixing
// PutSequence blocks and appended ones, and the refusals that leave a
// sequence unchanged. Every answer is checked against the float64 reference
// over the same K/V.
#include "kvring/control/node_core.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvring/attention/reference.h"
#include "kvring/cache/quantize.h"
#include "kvring/common/process.h"
#include "kvring/common/status_macros.h"
#include "kvring/control/cpu_attention_backend.h"
#include "kvring/control/node_wire.h"
#include "kvring/control/request_validation.h"

namespace kvring {
namespace {

// One sequence's K/V as the engine would hold it: per layer, per token,
// [kv_heads, head_dim] of K and of V (f32).
struct EngineKv {
  std::map<uint32_t, std::vector<float>> k, v;  // layer -> [tokens, kv_heads, head_dim]
  uint64_t tokens(uint32_t layer) const {
    auto it = k.find(layer);
    return it == k.end() ? 0 : it->second.size();
  }
};

// A delivery that "maps" each handle to a host buffer: the node's side of
// same-host GPU memory (Get's device places, Attend's device exchange),
// checked without a GPU. (CUDA IPC itself runs against real processes on a
// GPU: gpu_cluster_test.)
class FakeDelivery : public DeviceDelivery {
 public:
  struct Alloc {
    std::vector<uint8_t> bytes;
  };
  std::map<std::string, Alloc> allocs;  // by handle
  absl::Status begin_status = absl::OkStatus();
  int finished = 0;
  int reads = 0;
  // Events by handle ("opened" as the address of their entry); a handle
  // not listed cannot be opened.
  std::map<std::string, int> events;
  int reads_after_event = 0;

  absl::StatusOr<std::unique_ptr<Batch>> Begin(absl::Span<const std::string> handles) override {
    if (!begin_status.ok()) return begin_status;
    std::vector<Alloc*> maps;
    for (const auto& h : handles) {
      auto it = allocs.find(h);
      if (it == allocs.end()) return absl::FailedPreconditionError("no such allocation");
      maps.push_back(&it->second);
    }
    return std::unique_ptr<Batch>(new FakeBatch(this, std::move(maps)));
  }

 private:
  class FakeBatch : public Batch {
   public:
    FakeBatch(FakeDelivery* o, std::vector<Alloc*> m) : o_(o), m_(std::move(m)) {}
    absl::Status Add(uint32_t a, uint64_t offset, absl::Span<const uint8_t> src) override {
      if (a >= m_.size() || offset + src.size() > m_[a]->bytes.size()) return absl::InvalidArgumentError("outside");
      std::memcpy(m_[a]->bytes.data() + offset, src.data(), src.size());
      return absl::OkStatus();
    }
    absl::Status Finish() override {
      ++o_->finished;
      return absl::OkStatus();
    }
    absl::StatusOr<uint8_t*> Region(uint32_t a, uint64_t offset, uint64_t bytes) override {
      if (a >= m_.size() || offset > m_[a]->bytes.size() || bytes > m_[a]->bytes.size() - offset) {
        return absl::InvalidArgumentError("outside");
      }
      return m_[a]->bytes.data() + offset;
    }
    absl::Status Read(const uint8_t* src, absl::Span<uint8_t> dst) override {
      ++o_->reads;
      if (event_ != nullptr) ++o_->reads_after_event;
      std::memcpy(dst.data(), src, dst.size());
      return absl::OkStatus();
    }
    absl::StatusOr<void*> InputsReady(const std::string& handle) override {
      auto it = o_->events.find(handle);
      if (it == o_->events.end()) return absl::FailedPreconditionError("cannot open the caller's CUDA IPC event");
      event_ = &it->second;
      return static_cast<void*>(event_);
    }

   private:
    FakeDelivery* o_;
    std::vector<Alloc*> m_;
    int* event_ = nullptr;
  };
};

// The CPU backend taking "device" plans whose pointers are host memory (the
// FakeDelivery's buffers): the core's device path (rows read and written at
// each sequence's src_row, appends from the caller's memory) checked on the
// CPU against the same kernels.
class HostIoBackend : public AttentionBackend {
 public:
  explicit HostIoBackend(BlockStore* store) : cpu_(store, nullptr) {}
  std::string refusal;  // DeviceIoRefusal's answer
  int device_steps = 0;
  void* last_inputs_ready = nullptr;   // the last device step's AttendDeviceIo::inputs_ready
  uint32_t* last_done_flag = nullptr;  // and its done_flag, done_flag_value
  uint32_t last_done_flag_value = 0;

  std::string name() const override { return "host-io"; }
  absl::Status AdmitBlock(const SequenceRef& seq, uint64_t index, const BlockKey& key, const BlockMeta& meta,
                          absl::Span<const uint8_t> payload) override {
    return cpu_.AdmitBlock(seq, index, key, meta, payload);
  }
  absl::Status OpenBlock(const SequenceRef& seq, uint64_t index, const BlockLayout& layout) override {
    return cpu_.OpenBlock(seq, index, layout);
  }
  void DiscardOpenBlock(const SequenceRef& seq, uint64_t index) override { cpu_.DiscardOpenBlock(seq, index); }
  std::string DeviceIoRefusal(const BlockLayout&, const KvEncoding&, DType) const override { return refusal; }
  absl::Status Step(const StepPlan& plan, PartialOutput out, StepTimes* times) override {
    const AttendDeviceIo* dx = plan.device;
    if (dx == nullptr) return cpu_.Step(plan, out, times);
    ++device_steps;
    last_inputs_ready = dx->inputs_ready;
    last_done_flag = dx->done_flag;
    last_done_flag_value = dx->done_flag_value;
    StepPlan p = plan;
    p.device = nullptr;
    const size_t qrow = size_t{plan.shape.q_heads} * plan.shape.head_dim * DTypeSize(plan.shape.q_dtype);
    const size_t orow = size_t{plan.shape.q_heads} * plan.shape.head_dim;
    const size_t kvrow = size_t{plan.layout.kv_heads} * plan.layout.head_dim * DTypeSize(plan.layout.dtype);
    std::vector<uint8_t> q;
    uint32_t app = 0;
    for (const StepSequence& s : plan.sequences) {
      q.insert(q.end(), dx->queries + s.src_row * qrow, dx->queries + (s.src_row + s.rows) * qrow);
      for (const StepAppend& a : s.appends) app = std::max(app, a.src_row + a.count);
    }
    p.queries = q;
    p.new_k = absl::MakeConstSpan(dx->new_k, app * kvrow);
    p.new_v = absl::MakeConstSpan(dx->new_v, app * kvrow);
    std::vector<float> o(plan.shape.num_rows * orow), l(size_t{plan.shape.num_rows} * plan.shape.q_heads);
    KVRING_RETURN_IF_ERROR(cpu_.Step(p, PartialOutput{o.data(), l.data()}, times));
    for (const StepSequence& s : plan.sequences) {
      std::copy_n(o.begin() + s.row_begin * orow, s.rows * orow, dx->out + s.src_row * orow);
      std::copy_n(l.begin() + size_t{s.row_begin} * plan.shape.q_heads, size_t{s.rows} * plan.shape.q_heads,
                  dx->lse + size_t{s.src_row} * plan.shape.q_heads);
    }
    return absl::OkStatus();
  }
  absl::Status ReadOpenBlock(const SequenceRef& seq, uint64_t index, absl::Span<uint8_t> dst) override {
    return cpu_.ReadOpenBlock(seq, index, dst);
  }
  void SealBlock(const SequenceRef& seq, uint64_t index, const BlockKey& key, const KvEncoding& stored) override {
    cpu_.SealBlock(seq, index, key, stored);
  }
  void ForgetSequence(const SequenceRef& seq) override { cpu_.ForgetSequence(seq); }
  void SetTenantQuota(TenantId tenant, uint64_t max_bytes) override { cpu_.SetTenantQuota(tenant, max_bytes); }
  BackendStats stats() override { return cpu_.stats(); }

 private:
  CpuAttentionBackend cpu_;
};

class NodeCoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BlockStoreOptions so;
    so.page_bytes = 1 << 16;
    so.num_pages = 256;
    so.prefault = false;
    store_ = std::move(BlockStore::Create(so).value());
    seqs_ = std::move(SequenceTable::Create(nullptr).value());
    if (Exchange()) {
      backend_ = std::make_unique<HostIoBackend>(store_.get());
    } else {
      backend_ = std::make_unique<CpuAttentionBackend>(store_.get(), nullptr);
    }
    NodeCoreOptions no;
    no.node_id = "test";
    no.limits.max_payload_bytes = so.page_bytes;
    no.clock = &clock_;
    core_ = std::make_unique<NodeCore>(no, store_.get(), seqs_.get(), backend_.get(), &tenants_, &metrics_, &fake_);
    fake_.allocs[kExchangeHandle].bytes.assign(1 << 20, 0);
    host_ = HostBootId().value();
    tenant_.set_id(3);
    tenant_.set_name("t");
    tenant_.set_namespace_(TenantNamespace(tenant_.id()));
  }

  // One sequence's part of a step.
  struct Part {
    std::string id;
    uint32_t rows = 0;               // queries at the last `rows` positions of its tokens after the append
    uint32_t append = 0;             // new tokens (random K/V, recorded in kv_[id])
    std::vector<BlockRange> ranges;  // empty: every block
  };

  // Whether Step goes through the device exchange (NodeCoreExchangeTest).
  virtual bool Exchange() const { return false; }
  static inline const std::string kExchangeHandle = std::string(kIpcHandleBytes, 'x');
  // Regions of the exchange allocation (256-byte aligned, as the wire requires).
  static constexpr uint64_t kQ = 0, kK = 256 << 10, kV = 384 << 10, kO = 512 << 10, kL = 896 << 10;

  // `b` through the device exchange: its bulk bytes copied into the fake
  // allocation, AttendOnDevice, the output read back from it (rows of
  // sequences not served stay as `out` had them).
  absl::Status AttendThroughExchange(AttendBatch b, PartialOutput out, AttendStats* st, const std::string& host = "") {
    std::vector<uint8_t>& x = fake_.allocs[kExchangeHandle].bytes;
    auto put = [&](uint64_t off, absl::Span<const uint8_t> src) {
      if (!src.empty()) std::memcpy(x.data() + off, src.data(), src.size());
    };
    put(kQ, b.queries);
    put(kK, b.new_k);
    put(kV, b.new_v);
    const size_t on = size_t{b.shape.num_rows} * b.shape.q_heads * b.shape.head_dim * 4,
                 ln = size_t{b.shape.num_rows} * b.shape.q_heads * 4;
    if (out.out != nullptr) std::memcpy(x.data() + kO, out.out, on);
    if (out.lse != nullptr) std::memcpy(x.data() + kL, out.lse, ln);
    b.queries = b.new_k = b.new_v = {};
    absl::Status s = core_->AttendOnDevice(
        tenant_, "", b, DeviceExchangeIn{host.empty() ? host_ : host, kExchangeHandle, kQ, kK, kV, kO, kL}, st);
    if (out.out != nullptr) std::memcpy(out.out, x.data() + kO, on);
    if (out.lse != nullptr) std::memcpy(out.lse, x.data() + kL, ln);
    return s;
  }
  absl::Status Attend(const AttendBatch& b, PartialOutput out, AttendStats* st) {
    if (!Exchange()) return core_->Attend(tenant_, "", b, out, st);
    AttendStats local;
    absl::Status s = AttendThroughExchange(b, out, st != nullptr ? st : &local);
    if (s.ok() && !(st != nullptr ? st : &local)->device_refusal.empty()) {
      return absl::InternalError("refused: " + (st != nullptr ? st : &local)->device_refusal);
    }
    return s;
  }

  // A batch of this fixture's shapes on `layer` (f32 queries, the fixture's
  // layout), with no sequences yet.
  AttendBatch Batch(uint32_t layer) const {
    AttendBatch b;
    b.shape.options.layer = layer;
    b.shape.q_heads = kQHeads;
    b.shape.head_dim = L_.head_dim;
    b.shape.q_dtype = DType::kF32;
    b.layout = L_;
    b.quantize = quantize_;
    return b;
  }

  // The engine's view of sequence `id` made what the node stores: each
  // full block's K/V as its stored (possibly quantized) bytes decode, so the
  // reference attends over what the node attends over. Returns the full
  // blocks' encodings by index.
  std::map<uint64_t, KvEncoding> SyncSealed(const std::string& id) {
    const NamespaceId ns = NamespaceIdOf(TenantNamespace(3));
    SequenceTable::Handle h = seqs_->Lock(ns, id);
    std::map<uint64_t, KvEncoding> encodings;
    for (const auto& [idx, key] : h.state().blocks) {
      absl::StatusOr<PinnedBlock> pb = store_->Acquire(ns, key);
      EXPECT_TRUE(pb.ok()) << pb.status();
      if (!pb.ok()) continue;
      encodings[idx] = pb->meta().encoding;
      std::vector<uint8_t> plain(pb->payload().begin(), pb->payload().end());
      if (pb->meta().encoding.quantized()) {
        EXPECT_TRUE(DequantizeBlock(L_, pb->meta().encoding, pb->payload(), &plain).ok());
      }
      const float* f = reinterpret_cast<const float*>(plain.data());
      for (uint32_t l = 0; l < L_.layers; ++l)
        for (uint32_t t = 0; t < L_.block_tokens; ++t)
          for (uint32_t hd = 0; hd < L_.kv_heads; ++hd)
            for (uint32_t d = 0; d < L_.head_dim; ++d) {
              const size_t e = ((idx * L_.block_tokens + t) * L_.kv_heads + hd) * L_.head_dim + d;
              kv_[id].k[l][e] = f[L_.index(l, 0, hd, t, d)];
              kv_[id].v[l][e] = f[L_.index(l, 1, hd, t, d)];
            }
    }
    return encodings;
  }

  // Runs one step on `layer` and checks every row against the reference.
  absl::Status Step(uint32_t layer, const std::vector<Part>& parts, double tol = 2e-5) {
    AttendBatch b = Batch(layer);
    std::vector<float> q, nk, nv;
    std::normal_distribution<float> nd;
    std::vector<std::pair<std::string, uint32_t>> checks;  // id, first row
    for (const Part& p : parts) {
      EngineKv& e = kv_[p.id];
      const uint64_t before = e.tokens(layer) / (L_.kv_heads * L_.head_dim);
      AttendSequenceSpec s;
      s.sequence_id = p.id;
      s.append_position = before;
      s.append_tokens = p.append;
      s.tokens = before + p.append;
      s.rows = p.rows;
      s.placement_digest = digest_[p.id];
      for (uint32_t t = 0; t < p.append * L_.kv_heads * L_.head_dim; ++t) {
        nk.push_back(nd(rng_));
        nv.push_back(nd(rng_));
      }
      if (p.rows > 0) {
        s.ranges = p.ranges.empty() ? std::vector<BlockRange>{{0, (s.tokens + L_.block_tokens - 1) / L_.block_tokens}}
                                    : p.ranges;
        checks.emplace_back(p.id, b.shape.num_rows);
        for (uint32_t r = 0; r < p.rows; ++r) {
          b.positions.push_back(static_cast<int64_t>(s.tokens - p.rows + r));
          for (uint32_t i = 0; i < kQHeads * L_.head_dim; ++i) q.push_back(nd(rng_));
        }
        b.shape.num_rows += p.rows;
      }
      b.sequences.push_back(s);
    }
    b.queries = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(q.data()), q.size() * 4);
    b.new_k = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(nk.data()), nk.size() * 4);
    b.new_v = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(nv.data()), nv.size() * 4);
    std::vector<float> out(size_t{b.shape.num_rows} * kQHeads * L_.head_dim, std::nanf("")),
        lse(size_t{b.shape.num_rows} * kQHeads);
    AttendStats st;
    absl::Status s = Attend(b, PartialOutput{out.data(), lse.data()}, &st);
    if (!s.ok()) return s;
    // The append is now part of the engine's view of the sequence.
    size_t off = 0;
    for (const Part& p : parts) {
      const size_t n = size_t{p.append} * L_.kv_heads * L_.head_dim;
      auto& k = kv_[p.id].k[layer];
      auto& v = kv_[p.id].v[layer];
      k.insert(k.end(), nk.begin() + off, nk.begin() + off + n);
      v.insert(v.end(), nv.begin() + off, nv.begin() + off + n);
      off += n;
    }
    // Each sequence's rows against the reference over the blocks named.
    size_t seq_i = 0;
    for (const Part& p : parts) {
      const AttendSequenceSpec& spec = b.sequences[seq_i++];
      if (p.rows == 0) continue;
      uint32_t row0 = 0;
      for (const auto& [id, r] : checks) {
        if (id == p.id) row0 = r;
      }
      reference::DenseKv d;
      d.kv_heads = L_.kv_heads;
      d.head_dim = L_.head_dim;
      const auto& k = kv_[p.id].k[layer];
      const auto& v = kv_[p.id].v[layer];
      for (const BlockRange& rg : spec.ranges) {
        for (uint64_t t = rg.begin * L_.block_tokens; t < std::min(spec.tokens, rg.end * L_.block_tokens); ++t) {
          d.positions.push_back(static_cast<int64_t>(t));
          const size_t e = t * L_.kv_heads * L_.head_dim;
          d.k.insert(d.k.end(), k.begin() + e, k.begin() + e + L_.kv_heads * L_.head_dim);
          d.v.insert(d.v.end(), v.begin() + e, v.begin() + e + L_.kv_heads * L_.head_dim);
        }
      }
      const size_t qn = size_t{kQHeads} * L_.head_dim;
      std::vector<double> qd(q.begin() + row0 * qn, q.begin() + (row0 + p.rows) * qn);
      std::vector<int64_t> pos(b.positions.begin() + row0, b.positions.begin() + row0 + p.rows);
      AttentionOptions o;
      o.layer = layer;
      auto ref = reference::Attention(qd, pos, kQHeads, d, o);
      double num = 0, den = 0;
      for (size_t i = 0; i < ref.out.size(); ++i) {
        const double g = out[row0 * qn + i];
        EXPECT_FALSE(std::isnan(g)) << p.id << " output not written";
        num += (g - ref.out[i]) * (g - ref.out[i]);
        den += ref.out[i] * ref.out[i];
      }
      EXPECT_GT(den, 0);
      EXPECT_LT(std::sqrt(num / den), tol) << p.id << " layer " << layer;
      for (size_t i = 0; i < ref.lse.size(); ++i) {
        EXPECT_NEAR(lse[row0 * kQHeads + i], ref.lse[i], 1e-4 * std::max(1.0, std::abs(ref.lse[i]))) << p.id;
      }
    }
    last_ = st;
    return absl::OkStatus();
  }

  static constexpr uint32_t kQHeads = 4;
  const BlockLayout L_{4, 2, 2, 16, DType::kF32};
  std::mt19937_64 rng_{42};
  std::unique_ptr<BlockStore> store_;
  std::unique_ptr<SequenceTable> seqs_;
  std::unique_ptr<AttentionBackend> backend_;
  TenantDirectory tenants_;
  MetricsRegistry metrics_;
  FakeDelivery fake_;
  std::unique_ptr<NodeCore> core_;
  v1::Tenant tenant_;
  std::string host_;
  std::map<std::string, EngineKv> kv_;
  AttendStats last_;
  FakeClock clock_;
  std::map<std::string, uint64_t> digest_;  // placement digest each sequence is routed by
  std::optional<KvEncoding> quantize_;      // the steps' AttendBatch::quantize
};

TEST_F(NodeCoreTest, DecodeInPlaceCrossesBlockBoundariesAndSealsFullBlocks) {
  // A 6-token prefill chunk on both layers (rows see their causal prefix),
  // then 7 decode steps of one token each.
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 6, 6}}).ok());
  EXPECT_EQ(last_.appended_tokens, 6u);
  EXPECT_EQ(last_.completed_blocks, 1u);  // block 0 (tokens 0-3) filled on both layers
  for (int step = 0; step < 7; ++step) {
    for (uint32_t l = 0; l < 2; ++l) {
      absl::Status s = Step(l, {{"s", 1, 1}});
      ASSERT_TRUE(s.ok()) << "step " << step << " layer " << l << ": " << s;
    }
  }
  // 13 tokens: blocks 0-2 sealed into the store under their sequence keys,
  // block 3 open with one token on each layer.
  const NamespaceId ns = NamespaceIdOf(TenantNamespace(3));
  SequenceTable::Handle h = seqs_->Lock(ns, "s");
  EXPECT_EQ(h.state().blocks.size(), 3u);
  ASSERT_EQ(h.state().open.size(), 1u);
  EXPECT_EQ(h.state().open.begin()->first, 3u);
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(h.state().blocks.count(i));
    EXPECT_EQ(h.state().blocks[i], SequenceBlockKey(ns, "s", i, L_));
    auto pb = store_->Acquire(ns, h.state().blocks[i]);
    ASSERT_TRUE(pb.ok()) << pb.status();
    // Bit-exact: the block holds the engine's K/V in the block layout.
    const float* f = reinterpret_cast<const float*>(pb->payload().data());
    for (uint32_t l = 0; l < 2; ++l)
      for (uint32_t t = 0; t < L_.block_tokens; ++t)
        for (uint32_t hd = 0; hd < L_.kv_heads; ++hd)
          for (uint32_t d = 0; d < L_.head_dim; ++d) {
            const size_t e = ((i * L_.block_tokens + t) * L_.kv_heads + hd) * L_.head_dim + d;
            ASSERT_EQ(f[L_.index(l, 0, hd, t, d)], kv_["s"].k[l][e]);
            ASSERT_EQ(f[L_.index(l, 1, hd, t, d)], kv_["s"].v[l][e]);
          }
  }
  h.Release();
  EXPECT_EQ(seqs_->open_blocks(), 1u);
  EXPECT_EQ(backend_->stats().open_blocks, 1u);
}

// A sequence built by appends with quantize set: its open blocks stay plain,
// each block is stored int8 as its last layer fills, and a step reads the
// quantized full blocks and the plain tail in one answer (two passes merged
// by LSE), exact against the reference over what is stored. A sequence
// whose first blocks were sealed plain keeps plain; a sequence without full
// blocks here joins a batch of quantized ones.
TEST_F(NodeCoreTest, AppendsToAQuantizedSequenceSealEachBlockInItsEncodingAndAttendOverBoth) {
  KvEncoding int8;
  ASSERT_TRUE(ParseKvEncoding("int8", &int8).ok());
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"plain", 2, 5}}).ok());  // block 0 sealed plain
  quantize_ = int8;
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"q", 6, 6}}).ok());  // block 0 sealed int8
  SyncSealed("q");
  for (int step = 0; step < 9; ++step) {
    for (uint32_t l = 0; l < 2; ++l) {
      std::vector<Part> parts{{"q", 1, 1}};
      if (step >= 3) parts.push_back({"new", 1, 1});  // no full blocks here yet: agrees with int8
      absl::Status s = Step(l, parts);
      ASSERT_TRUE(s.ok()) << "step " << step << " layer " << l << ": " << s;
      SyncSealed("q");
      SyncSealed("new");
    }
    for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"plain", 1, 1}}).ok());
  }
  // q: 15 tokens, blocks 0-2 int8, block 3 open (plain) with 3 tokens.
  const std::map<uint64_t, KvEncoding> q = SyncSealed("q");
  ASSERT_EQ(q.size(), 3u);
  for (const auto& [idx, e] : q) EXPECT_EQ(e, int8) << "block " << idx;
  const std::map<uint64_t, KvEncoding> n = SyncSealed("new");
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n.begin()->second, int8);
  // plain: its first block was sealed plain, so every later one is too.
  const std::map<uint64_t, KvEncoding> p = SyncSealed("plain");
  ASSERT_EQ(p.size(), 3u);
  for (const auto& [idx, e] : p) EXPECT_FALSE(e.quantized()) << "block " << idx;
  // One batch mixing full blocks of two encodings is refused.
  EXPECT_EQ(Step(0, {{"q", 1, 0}, {"plain", 1, 0}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_GE(metrics_.Counter("kvring_quantized_blocks_total", "")->value(), 4u);
}

// A deleted tenant's sequences (full and open blocks) and blocks are
// reclaimed from the store, the sequence table and the backend; another
// tenant's are not touched; a second reclaim does nothing.
TEST_F(NodeCoreTest, ReclaimingADeletedTenantFreesItsSequencesAndBlocks) {
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 1, 10}, {"u", 1, 3}}).ok());
  v1::Tenant other;
  other.set_id(4);
  other.set_name("o");
  other.set_namespace_(TenantNamespace(4));
  PutArgs a;
  a.tenant = 4;
  a.ns = NamespaceIdOf(other.namespace_());
  a.key = BlockKey{5, 6};
  a.meta.layout = L_;
  a.meta.payload_bytes = static_cast<uint32_t>(L_.bytes());
  std::vector<uint8_t> payload(L_.bytes(), 1);
  a.meta.checksum = PayloadChecksum(payload.data(), payload.size());
  ASSERT_TRUE(store_->Put(a, payload).ok());
  ASSERT_EQ(store_->stats().blocks, 3u);  // s: blocks 0 and 1 sealed; o: one
  ASSERT_EQ(backend_->stats().open_blocks, 2u);
  ASSERT_EQ(seqs_->num_sequences(), 2u);

  v1::TenantTable table;
  table.set_tenants_version(2);
  *table.add_entries()->mutable_tenant() = other;
  table.add_deleted_tenant_ids(tenant_.id());
  tenants_.Update(table);
  absl::StatusOr<ReclaimResult> r = core_->ReclaimDeletedTenants();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tenants, 1u);
  EXPECT_EQ(r->blocks, 2u);
  EXPECT_EQ(r->sequences, 2u);
  EXPECT_EQ(store_->stats().blocks, 1u);
  EXPECT_TRUE(store_->Acquire(a.ns, a.key).ok());
  EXPECT_EQ(backend_->stats().open_blocks, 0u);
  EXPECT_EQ(seqs_->num_sequences(), 0u);
  EXPECT_TRUE(store_->CheckInvariants().ok());
  absl::StatusOr<ReclaimResult> again = core_->ReclaimDeletedTenants();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->tenants, 0u);
}

TEST_F(NodeCoreTest, RefusedAppendsAndAttendsChangeNothing) {
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 1, 5}}).ok());
  // A gap: position 7 on a node whose tail is at 5.
  AttendBatch b = Batch(0);
  std::vector<float> kv(L_.kv_heads * L_.head_dim, 1.f);
  b.new_k = b.new_v = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(kv.data()), kv.size() * 4);
  AttendSequenceSpec s;
  s.sequence_id = "s";
  s.append_position = 7;
  s.append_tokens = 1;
  s.tokens = 8;
  b.sequences = {s};
  absl::Status st = core_->Attend(tenant_, "", b, PartialOutput{}, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("first missing position 5"), std::string::npos) << st;
  // A repeat of a sealed block's position with other bytes.
  b.sequences[0].append_position = 2;
  b.sequences[0].tokens = 3;
  st = core_->Attend(tenant_, "", b, PartialOutput{}, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("differs from the token this node already holds"), std::string::npos) << st;
  EXPECT_NE(st.message().find("truncate the sequence to 2"), std::string::npos) << st;
  // The same repeat with the bytes the node holds (a retried step) is a
  // no-op, in a sealed block and in the open one.
  for (uint64_t pos : {2, 4}) {
    const size_t e = pos * L_.kv_heads * L_.head_dim;
    std::vector<float> rk(kv_["s"].k[0].begin() + e, kv_["s"].k[0].begin() + e + L_.kv_heads * L_.head_dim);
    std::vector<float> rv(kv_["s"].v[0].begin() + e, kv_["s"].v[0].begin() + e + L_.kv_heads * L_.head_dim);
    AttendBatch r = b;
    r.new_k = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(rk.data()), rk.size() * 4);
    r.new_v = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(rv.data()), rv.size() * 4);
    r.sequences[0].append_position = pos;
    r.sequences[0].tokens = pos + 1;
    AttendStats rs;
    st = core_->Attend(tenant_, "", r, PartialOutput{}, &rs);
    EXPECT_TRUE(st.ok()) << pos << ": " << st;
    EXPECT_EQ(rs.appended_tokens, 0u);
  }
  // An attend that expects tokens this node does not hold: NOT_FOUND (the
  // client moves to another replica).
  std::vector<float> q(kQHeads * L_.head_dim, 0.5f);
  AttendBatch a = b;
  a.new_k = a.new_v = {};
  a.queries = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(q.data()), q.size() * 4);
  a.shape.num_rows = 1;
  a.positions = {6};
  a.sequences[0] = AttendSequenceSpec{"s", {{0, 2}}, 7, 1, 0, 0};
  std::vector<float> out(kQHeads * L_.head_dim), lse(kQHeads);
  st = core_->Attend(tenant_, "", a, PartialOutput{out.data(), lse.data()}, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_NE(st.message().find("holds 1 of 3 tokens"), std::string::npos) << st;
  // An unknown sequence; naming it leaves nothing behind in the table.
  const size_t known = seqs_->num_sequences();
  for (int i = 0; i < 100; ++i) {
    a.sequences[0].sequence_id = "nope-" + std::to_string(i);
    EXPECT_EQ(core_->Attend(tenant_, "", a, PartialOutput{out.data(), lse.data()}, nullptr).code(),
              absl::StatusCode::kNotFound);
  }
  EXPECT_EQ(seqs_->num_sequences(), known);
  // Another layout than the sequence's.
  b.layout = BlockLayout{8, 2, 2, 16, DType::kF32};
  b.sequences[0].append_position = 5;
  b.sequences[0].tokens = 6;
  EXPECT_EQ(core_->Attend(tenant_, "", b, PartialOutput{}, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  // Nothing changed: the next in-order step still matches the reference.
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 2, 3}}).ok());
  // Another tenant's namespace does not see the sequence.
  v1::Tenant other;
  other.set_id(4);
  other.set_name("o");
  other.set_namespace_(TenantNamespace(4));
  a.sequences[0] = AttendSequenceSpec{"s", {{0, 2}}, 8, 1, 0, 0};
  a.positions = {7};
  EXPECT_EQ(core_->Attend(other, "", a, PartialOutput{out.data(), lse.data()}, nullptr).code(),
            absl::StatusCode::kNotFound);
}

TEST_F(NodeCoreTest, OneStepServesABatchOfSequences) {
  for (uint32_t l = 0; l < 2; ++l) {
    ASSERT_TRUE(Step(l, {{"a", 3, 9}, {"b", 1, 2}, {"c", 5, 17}}).ok());
  }
  for (int step = 0; step < 5; ++step) {
    for (uint32_t l = 0; l < 2; ++l) {
      // "b" only appends on this node this time (its rows are served elsewhere).
      ASSERT_TRUE(Step(l, {{"a", 1, 1}, {"b", 0, 1}, {"c", 2, 2}}).ok());
    }
  }
  // Part of a sequence: its blocks [1, 3) only (another shard holds the rest).
  ASSERT_TRUE(Step(0, {{"c", 1, 0, {{1, 3}}}}).ok());
  EXPECT_EQ(last_.blocks_used, 2u);
}

TEST_F(NodeCoreTest, PutSequenceBlocksAndAppendedBlocksFormOneSequence) {
  // Blocks 0 and 1 arrive by Put (the engine's prefill), then decode appends.
  const NamespaceId ns = NamespaceIdOf(TenantNamespace(3));
  std::normal_distribution<float> nd;
  v1::PutRequest put;
  put.mutable_header()->set_version(1);
  for (uint64_t i = 0; i < 2; ++i) {
    std::vector<float> blk(L_.elements());
    for (uint32_t l = 0; l < 2; ++l)
      for (uint32_t t = 0; t < L_.block_tokens; ++t)
        for (uint32_t hd = 0; hd < L_.kv_heads; ++hd)
          for (uint32_t d = 0; d < L_.head_dim; ++d) {
            const float kx = nd(rng_), vx = nd(rng_);
            blk[L_.index(l, 0, hd, t, d)] = kx;
            blk[L_.index(l, 1, hd, t, d)] = vx;
            kv_["p"].k[l].push_back(kx);  // token order matches (t, hd, d) loops
            kv_["p"].v[l].push_back(vx);
          }
    v1::PutBlock* pb = put.add_blocks();
    KeyToProto(BlockKey{100 + i, 7}, pb->mutable_block()->mutable_key());
    LayoutToProto(L_, pb->mutable_block()->mutable_layout());
    pb->mutable_block()->set_payload_bytes(static_cast<uint32_t>(L_.bytes()));
    pb->set_payload(reinterpret_cast<const char*>(blk.data()), L_.bytes());
    pb->mutable_sequence()->set_sequence_id("p");
    pb->mutable_sequence()->set_block_index(i);
  }
  v1::PutResponse resp;
  ASSERT_TRUE(WirePut(*core_, tenant_, put, {}, &resp).ok());
  for (const auto& r : resp.results()) ASSERT_EQ(r.status().code(), 0) << r.status().message();
  for (int step = 0; step < 6; ++step) {
    for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"p", 1, 1}}).ok()) << step;
  }
  // A Put into the block being appended to is refused.
  v1::PutRequest clash = put;
  clash.mutable_blocks()->DeleteSubrange(1, 1);
  clash.mutable_blocks(0)->mutable_sequence()->set_block_index(3);
  ASSERT_TRUE(WirePut(*core_, tenant_, clash, {}, &resp).ok());
  EXPECT_EQ(resp.results(resp.results_size() - 1).status().code(),
            static_cast<int>(absl::StatusCode::kFailedPrecondition));
  SequenceTable::Handle h = seqs_->Lock(ns, "p");
  EXPECT_EQ(h.state().blocks.size(), 3u);  // 0, 1 put; 2 sealed from appends
  EXPECT_EQ(h.state().blocks[0], (BlockKey{100, 7}));
}

// ---- Attend through the caller's GPU memory (device exchange) ----
// The same steps with the queries, appended K/V and output in the caller's
// memory (FakeDelivery maps the exchange handle to a host buffer; the
// backend reads and writes it at each sequence's src_row), checked against
// the reference as above.
// Open blocks take their memory from the host tier (the probe's finding:
// 512 one-token appends grew a 64 MB node to 1.1 GB): once every host page
// is lent to an open block, the next append is RESOURCE_EXHAUSTED and the
// sequences already open keep working.
TEST_F(NodeCoreTest, OpenBlocksLiveInTheHostTierAndStopAtItsSize) {
  const uint64_t pages = store_->stats().num_pages;
  uint64_t opened = 0;
  absl::Status refused;
  for (uint64_t i = 0; i < pages + 8; ++i) {
    absl::Status s = Step(0, {{absl::StrCat("s", i), 0, 1}});
    if (!s.ok()) {
      refused = s;
      break;
    }
    ++opened;
  }
  EXPECT_EQ(opened, pages);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("host"), std::string::npos) << refused;
  EXPECT_EQ(store_->stats().scratch_pages, pages);
  EXPECT_EQ(store_->GetTenantUsage(3).open_bytes, pages * L_.bytes());
  // An open sequence goes on (its block has room), and is exact.
  EXPECT_TRUE(Step(0, {{"s0", 1, 1}}).ok());
  EXPECT_TRUE(store_->CheckInvariants().ok());
}

// One tenant, one budget: pinned blocks and open sequence blocks count
// together (the probe had 3 open + 3 pinned blocks accepted on a 3-block
// quota).
TEST_F(NodeCoreTest, PinsAndOpenBlocksShareTheTenantsOneBudget) {
  store_->SetTenantQuota(3, TenantQuota{3 * L_.bytes()});
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Step(0, {{absl::StrCat("s", i), 0, 1}}).ok());
  const NamespaceId ns = NamespaceIdOf(TenantNamespace(3));
  std::vector<uint8_t> payload(L_.bytes(), 1);
  PutArgs a;
  a.tenant = 3;
  a.ns = ns;
  a.key = BlockKey{7, 8};
  a.meta.layout = L_;
  a.meta.payload_bytes = static_cast<uint32_t>(L_.bytes());
  a.pin = true;
  absl::StatusOr<PutResult> pinned = store_->Put(a, payload);
  EXPECT_EQ(pinned.status().code(), absl::StatusCode::kResourceExhausted) << pinned.status();
  // A fourth open block is refused too, and changes nothing.
  absl::Status s = Step(0, {{"s3", 0, 1}});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(store_->GetTenantUsage(3).open_bytes, 3 * L_.bytes());
  // Unpinned blocks are not charged: the same block stored without a pin is fine.
  a.pin = false;
  EXPECT_TRUE(store_->Put(a, payload).ok());
  EXPECT_EQ(store_->Pin(3, ns, a.key).code(), absl::StatusCode::kResourceExhausted);
}

// DeleteSequence ends a sequence here: its sealed blocks leave the store,
// its open blocks give their host pages and budget back, its records go; a
// second delete finds nothing; another sequence is untouched.
TEST_F(NodeCoreTest, DeleteSequenceFreesEverythingItHeldAndIsIdempotent) {
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 1, 10}, {"u", 1, 5}}).ok());
  const NamespaceId ns = NamespaceIdOf(TenantNamespace(3));
  ASSERT_EQ(store_->stats().blocks, 3u);  // s: 0, 1; u: 0
  ASSERT_EQ(seqs_->num_sequences(), 2u);
  const uint64_t open_before = store_->GetTenantUsage(3).open_bytes;
  NodeReport before = core_->Stats(tenant_);
  EXPECT_EQ(before.tenant_sequences, 2u);
  EXPECT_EQ(before.tenant_sequence_blocks, 3u);
  EXPECT_EQ(before.tenant_sequence_bytes, 3 * L_.bytes());
  EXPECT_EQ(before.tenant_sequence_open_blocks, 2u);
  EXPECT_EQ(before.tenant_sequence_host_blocks, 3u);  // no cold tier here: every full block in host memory
  EXPECT_EQ(before.tenant_sequence_cold_blocks, 0u);
  absl::StatusOr<SequenceChange> c = core_->DeleteSequence(tenant_, "", "s");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->held);
  EXPECT_EQ(c->blocks_erased, 2u);
  EXPECT_EQ(c->open_blocks_dropped, 1u);
  EXPECT_EQ(store_->stats().blocks, 1u);
  EXPECT_EQ(store_->GetTenantUsage(3).open_bytes, open_before - L_.bytes());
  EXPECT_EQ(seqs_->num_sequences(), 1u);
  NodeReport after = core_->Stats(tenant_);
  EXPECT_EQ(after.tenant_sequences, 1u);
  EXPECT_EQ(after.tenant_sequence_blocks, 1u);
  EXPECT_EQ(after.tenant_sequence_open_blocks, 1u);
  EXPECT_EQ(after.tenant.open_bytes, L_.bytes());
  EXPECT_FALSE(store_->Acquire(ns, SequenceBlockKey(ns, "s", 0, L_)).ok());
  absl::StatusOr<SequenceChange> again = core_->DeleteSequence(tenant_, "", "s");
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->held);
  // "u" goes on exactly; "s" starts again from nothing.
  EXPECT_TRUE(Step(0, {{"u", 1, 1}}).ok());
  kv_.erase("s");
  EXPECT_TRUE(Step(0, {{"s", 2, 2}}).ok());
  EXPECT_EQ(core_->DeleteSequence(tenant_, "", std::string(300, 'x')).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store_->CheckInvariants().ok());
}

// What speculative decoding does: drafts appended, some rejected, the
// sequence cut back and appended again with other K/V. After a cut inside
// a sealed block, inside an open block and at a block boundary, the
// sequence attends exactly like one built from scratch with the kept and
// the new tokens (the fixture's reference is the engine's own view).
TEST_F(NodeCoreTest, ATruncatedAndReappendedSequenceAttendsLikeOneBuiltFromScratch) {
  auto cut = [&](const std::string& id, uint64_t tokens) {
    absl::StatusOr<SequenceChange> c = core_->TruncateSequence(tenant_, "", id, tokens);
    ASSERT_TRUE(c.ok()) << c.status();
    for (auto* side : {&kv_[id].k, &kv_[id].v}) {
      for (auto& [layer, vals] : *side) vals.resize(std::min<size_t>(vals.size(), tokens * L_.kv_heads * L_.head_dim));
    }
  };
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 4, 13}}).ok());
  // 13 tokens: blocks 0-2 sealed, block 3 open with one token. Cut to 6:
  // inside sealed block 1 (reopened with tokens 4-5).
  cut("s", 6);
  {
    const NamespaceId ns = NamespaceIdOf(TenantNamespace(3));
    SequenceTable::Handle h = seqs_->Lock(ns, "s");
    EXPECT_EQ(h.state().blocks.size(), 1u);
    ASSERT_EQ(h.state().open.size(), 1u);
    EXPECT_EQ(h.state().open.begin()->first, 1u);
    EXPECT_EQ(h.state().open.begin()->second.filled, (std::vector<uint32_t>{2, 2}));
  }
  for (uint32_t l = 0; l < 2; ++l)
    ASSERT_TRUE(Step(l, {{"s", 3, 5}}).ok()) << "re-append after a cut in a sealed block";
  // 11 tokens: cut inside the open block 2 (token 9).
  cut("s", 9);
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 2, 2}}).ok()) << "re-append after a cut in an open block";
  // At a block boundary.
  cut("s", 8);
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 4, 6}}).ok()) << "re-append after a cut at a boundary";
  // Past the end: nothing changes.
  cut("s", 100);
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 1, 1}}).ok());
  // To nothing: a new sequence under the same id.
  cut("s", 0);
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 3, 3}}).ok());
  // As after a restart (the table holds the full blocks' keys only, no
  // layout yet): the cut still happens.
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 1, 9}}).ok());  // 12 tokens: blocks 0-2 sealed
  {
    SequenceTable::Handle h = seqs_->Lock(NamespaceIdOf(TenantNamespace(3)), "s");
    ASSERT_TRUE(h.state().open.empty());
    h.state().layout.reset();
  }
  cut("s", 4);
  EXPECT_EQ(seqs_->Lock(NamespaceIdOf(TenantNamespace(3)), "s").state().blocks.size(), 1u);
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 2, 5}}).ok()) << "re-append after a cut after a restart";
  EXPECT_TRUE(store_->CheckInvariants().ok());
}

// A tenant's sequence TTL: a sequence no call has named for longer is
// deleted at the next sweep (like DeleteSequence: blocks, open blocks and
// their budget charge); one used meanwhile stays; a tenant without a TTL
// keeps its sequences however long they idle.
TEST_F(NodeCoreTest, IdleSequencesExpireAfterTheTenantsTtl) {
  v1::TenantTable table;
  table.set_tenants_version(2);
  v1::Tenant with_ttl = tenant_;
  with_ttl.set_sequence_ttl_s(60);
  *table.add_entries()->mutable_tenant() = with_ttl;
  tenants_.Update(table);
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"idle", 1, 6}, {"busy", 1, 6}}).ok());
  ASSERT_EQ(store_->stats().blocks, 2u);
  clock_.Advance(absl::Seconds(30));
  ASSERT_TRUE(Step(0, {{"busy", 1, 1}}).ok());
  EXPECT_EQ(core_->ExpireIdleSequences().value(), 0u);  // nothing idle for 60 s yet
  clock_.Advance(absl::Seconds(40));                    // idle: 70 s; busy: 40 s
  EXPECT_EQ(core_->ExpireIdleSequences().value(), 1u);
  EXPECT_EQ(seqs_->num_sequences(), 1u);
  EXPECT_EQ(store_->stats().blocks, 1u);
  EXPECT_EQ(store_->GetTenantUsage(3).open_bytes, L_.bytes());  // busy's open block only
  ASSERT_TRUE(Step(1, {{"busy", 1, 1}}).ok());
  kv_.erase("idle");
  ASSERT_TRUE(Step(0, {{"idle", 1, 1}}).ok());  // the id starts afresh
  // Without a TTL nothing expires.
  table.set_tenants_version(3);
  table.mutable_entries(0)->mutable_tenant()->set_sequence_ttl_s(0);
  tenants_.Update(table);
  clock_.Advance(absl::Hours(1000));
  EXPECT_EQ(core_->ExpireIdleSequences().value(), 0u);
  EXPECT_EQ(seqs_->num_sequences(), 2u);
  EXPECT_TRUE(store_->CheckInvariants().ok());
}

// ForkSequence on one node (block_tokens 4). The fork's full blocks are its
// source's (no new store block), the partly filled block at the fork point
// is copied; appends to either side change only that side, and each attends
// exactly like a sequence built from scratch (the fixture's reference is the
// engine's view: the source's first tokens, then the fork's own). A source
// deleted, or truncated below the fork point and appended again with other
// K/V, leaves the fork its bytes; with both gone nothing stays.
TEST_F(NodeCoreTest, AForkSharesFullBlocksAndEachSideAttendsLikeOneBuiltFromScratch) {
  const NamespaceId ns = NamespaceIdOf(TenantNamespace(3));
  auto fork = [&](const std::string& src, const std::string& dst, uint64_t tokens) -> absl::StatusOr<ForkChange> {
    const SequencePlacement p = SequencePlacement().Fork(src, 1).value();
    absl::StatusOr<ForkChange> c = core_->ForkSequence(tenant_, "", src, dst, tokens, p);
    if (!c.ok()) return c;
    digest_[dst] = p.Digest();
    for (auto [from, to] : {std::pair{&kv_[src].k, &kv_[dst].k}, std::pair{&kv_[src].v, &kv_[dst].v}}) {
      for (auto& [layer, vals] : *from) {
        (*to)[layer].assign(vals.begin(), vals.begin() + tokens * L_.kv_heads * L_.head_dim);
      }
    }
    return c;
  };
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"src", 2, 14}}).ok());  // blocks 0-2 sealed, 3 open (2)
  ASSERT_EQ(store_->stats().blocks, 3u);
  // At 10: blocks 0-1 shared, sealed block 2 copied (its first 2 tokens).
  absl::StatusOr<ForkChange> c = fork("src", "a", 10);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->held);
  EXPECT_EQ(c->blocks_shared, 2u);
  EXPECT_EQ(c->blocks_copied, 1u);
  EXPECT_EQ(c->source_tokens, 14u);
  EXPECT_EQ(store_->stats().blocks, 3u);  // nothing copied into the store
  // The same fork again changes nothing; another fork under the id, or a
  // fork onto an existing sequence, is refused.
  EXPECT_TRUE(core_->ForkSequence(tenant_, "", "src", "a", 10, SequencePlacement().Fork("src", 1).value()).ok());
  EXPECT_EQ(
      core_->ForkSequence(tenant_, "", "src", "a", 10, SequencePlacement().Fork("src", 2).value()).status().code(),
      absl::StatusCode::kAlreadyExists);
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"u", 1, 3}}).ok());
  EXPECT_EQ(fork("src", "u", 4).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(fork("src", "src", 4).status().code(), absl::StatusCode::kInvalidArgument);
  // Past what the open block holds: refused, and nothing of the fork stays.
  const size_t n = seqs_->num_sequences();
  EXPECT_EQ(fork("src", "b", 15).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(seqs_->num_sequences(), n);
  kv_.erase("b");
  // Both sides go on, each with its own tokens.
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"a", 3, 5}, {"src", 2, 3}}).ok());
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"src", 1, 1}, {"a", 4, 1}}).ok());
  // A fork routed by another placement (a caller that has not resolved it)
  // is refused with nothing applied.
  digest_["a"] = 0;
  EXPECT_EQ(Step(0, {{"a", 1, 1}}).code(), absl::StatusCode::kAborted);
  digest_["a"] = SequencePlacement().Fork("src", 1).value().Digest();
  // At an open block (src: 18 tokens, block 4 open with 2): blocks 0-3 shared.
  c = fork("src", "b", 18);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->blocks_shared, 4u);
  EXPECT_EQ(c->blocks_copied, 1u);
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"b", 2, 6}}).ok());
  {
    SequenceTable::Handle h = seqs_->Lock(ns, "src");
    EXPECT_EQ(seqs_->References(h.state().blocks.at(0)).records, 3u);  // src, a, b
  }
  // The source ends: the forks keep the blocks they share with it.
  absl::StatusOr<SequenceChange> d = core_->DeleteSequence(tenant_, "", "src");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->blocks_erased, 0u);  // blocks 0-3 are held by b (0-1 by a too)
  kv_.erase("src");
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"a", 2, 1}, {"b", 2, 1}}).ok());
  // A source truncated below the fork point and appended again with other
  // K/V: its new blocks do not overwrite the fork's.
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s2", 1, 12}}).ok());
  ASSERT_TRUE(fork("s2", "f2", 12).ok());
  ASSERT_TRUE(core_->TruncateSequence(tenant_, "", "s2", 4).ok());
  for (auto* side : {&kv_["s2"].k, &kv_["s2"].v}) {
    for (auto& [layer, vals] : *side) vals.resize(4 * L_.kv_heads * L_.head_dim);
  }
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s2", 3, 9}}).ok());
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"f2", 3, 2}, {"s2", 2, 1}}).ok());
  // Everything ends: nothing stays.
  for (const char* id : {"a", "b", "u", "s2", "f2"}) ASSERT_TRUE(core_->DeleteSequence(tenant_, "", id).ok()) << id;
  EXPECT_EQ(seqs_->num_sequences(), 0u);
  EXPECT_EQ(store_->stats().blocks, 0u);
  EXPECT_EQ(store_->GetTenantUsage(3).open_bytes, 0u);
  EXPECT_TRUE(store_->CheckInvariants().ok());
}

class NodeCoreExchangeTest : public NodeCoreTest {
 protected:
  bool Exchange() const override { return true; }
  HostIoBackend& backend() { return static_cast<HostIoBackend&>(*backend_); }
  // A one-row attend of sequence `id` over its blocks [0, blocks) at position `pos`.
  static AttendSequenceSpec Row(const std::string& id, uint64_t blocks, uint64_t tokens) {
    return AttendSequenceSpec{id, {{0, blocks}}, tokens, 1, 0, 0};
  }
};

TEST_F(NodeCoreExchangeTest, DecodeInPlaceAndBatchesRunInTheCallersMemory) {
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 6, 6}}).ok());
  for (int step = 0; step < 7; ++step) {
    for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 1, 1}}).ok()) << step;
  }
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"a", 3, 9}, {"b", 1, 2}, {"c", 5, 17}}).ok());
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"a", 1, 1}, {"b", 0, 1}, {"c", 2, 2}}).ok());
  EXPECT_EQ(backend().device_steps, 20);
  const NamespaceId ns = NamespaceIdOf(TenantNamespace(3));
  SequenceTable::Handle h = seqs_->Lock(ns, "s");
  EXPECT_EQ(h.state().blocks.size(), 3u);  // 13 tokens: blocks 0-2 sealed, as without the exchange
}

TEST_F(NodeCoreExchangeTest, ASequenceNotServedLeavesItsRowsAndTheOthersLandAtTheirOwn) {
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"a", 1, 9}, {"c", 1, 6}}).ok());
  AttendBatch b = Batch(1);
  b.layout.reset();  // attend only: the sequences' own
  b.shape.num_rows = 3;
  b.positions = {8, 3, 5};
  b.sequences = {Row("a", 3, 9), Row("nope", 1, 4), Row("c", 2, 6)};
  const size_t qn = size_t{kQHeads} * L_.head_dim;
  std::vector<float> q(3 * qn);
  std::normal_distribution<float> nd;
  for (float& x : q) x = nd(rng_);
  b.queries = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(q.data()), q.size() * 4);
  // The same batch the ordinary way (the backend's CPU path): the rows to expect.
  std::vector<float> want(3 * qn), want_lse(3 * kQHeads);
  ASSERT_TRUE(core_->Attend(tenant_, "", b, PartialOutput{want.data(), want_lse.data()}, nullptr).ok());
  std::vector<float> got(3 * qn, 7.f), got_lse(3 * kQHeads, 7.f);
  AttendStats st;
  ASSERT_TRUE(AttendThroughExchange(b, PartialOutput{got.data(), got_lse.data()}, &st).ok());
  EXPECT_TRUE(st.device_refusal.empty());
  ASSERT_EQ(st.sequence_status.size(), 3u);
  EXPECT_TRUE(st.sequence_status[0].ok());
  EXPECT_TRUE(absl::IsNotFound(st.sequence_status[1])) << st.sequence_status[1];
  EXPECT_TRUE(st.sequence_status[2].ok());
  for (int r : {0, 2}) {
    for (size_t i = 0; i < qn; ++i) ASSERT_EQ(got[r * qn + i], want[r * qn + i]) << "row " << r;
    for (size_t i = 0; i < kQHeads; ++i) ASSERT_EQ(got_lse[r * kQHeads + i], want_lse[r * kQHeads + i]);
  }
  // Row 1 belongs to the sequence not served: left as it was.
  EXPECT_TRUE(std::all_of(got.begin() + qn, got.begin() + 2 * qn, [](float x) { return x == 7.f; }));
  EXPECT_TRUE(std::all_of(got_lse.begin() + kQHeads, got_lse.begin() + 2 * kQHeads, [](float x) { return x == 7.f; }));
}

TEST_F(NodeCoreExchangeTest, ARetriedAppendIsComparedWithTheBytesInTheCallersMemory) {
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 1, 5}}).ok());
  AttendBatch b = Batch(0);
  b.sequences = {AttendSequenceSpec{"s", {}, 3, 0, 1, 2}};
  const size_t n = size_t{L_.kv_heads} * L_.head_dim, e = 2 * n;
  std::vector<float> rk(kv_["s"].k[0].begin() + e, kv_["s"].k[0].begin() + e + n);
  std::vector<float> rv(kv_["s"].v[0].begin() + e, kv_["s"].v[0].begin() + e + n);
  b.new_k = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(rk.data()), n * 4);
  b.new_v = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(rv.data()), n * 4);
  AttendStats st;
  ASSERT_TRUE(AttendThroughExchange(b, PartialOutput{}, &st).ok());
  EXPECT_EQ(st.appended_tokens, 0u);
  EXPECT_GE(fake_.reads, 2);  // K and V read back from the caller's memory to compare
  rk[3] += 1.f;
  absl::Status s = AttendThroughExchange(b, PartialOutput{}, &st);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("differs from the token this node already holds"), std::string::npos) << s;
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 2, 3}}).ok());  // nothing changed
}

TEST_F(NodeCoreExchangeTest, TheCallersInputsEventReachesTheBackendAndOneThatCannotOpenIsRefused) {
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 1, 5}}).ok());
  EXPECT_EQ(backend().last_inputs_ready, nullptr);  // none given: none waited on
  const std::string ev(kIpcHandleBytes, 'e');
  fake_.events[ev] = 0;
  AttendBatch b = Batch(0);
  b.layout.reset();
  b.shape.num_rows = 1;
  b.positions = {4};
  b.sequences = {Row("s", 2, 5)};
  std::vector<float> q(size_t{kQHeads} * L_.head_dim, 0.5f);
  std::vector<uint8_t>& x = fake_.allocs[kExchangeHandle].bytes;
  std::memcpy(x.data() + kQ, q.data(), q.size() * 4);
  AttendStats st;
  ASSERT_TRUE(
      core_->AttendOnDevice(tenant_, "", b, DeviceExchangeIn{host_, kExchangeHandle, kQ, kK, kV, kO, kL, ev}, &st)
          .ok());
  EXPECT_TRUE(st.device_refusal.empty()) << st.device_refusal;
  EXPECT_EQ(backend().last_inputs_ready, static_cast<void*>(&fake_.events[ev]));
  // A retried append compares with the caller's bytes only after the event.
  AttendBatch r = Batch(0);
  r.sequences = {AttendSequenceSpec{"s", {}, 3, 0, 1, 2}};
  const size_t n = size_t{L_.kv_heads} * L_.head_dim, e = 2 * n;
  std::memcpy(x.data() + kK, kv_["s"].k[0].data() + e, n * 4);
  std::memcpy(x.data() + kV, kv_["s"].v[0].data() + e, n * 4);
  ASSERT_TRUE(
      core_->AttendOnDevice(tenant_, "", r, DeviceExchangeIn{host_, kExchangeHandle, kQ, kK, kV, kO, kL, ev}, &st)
          .ok());
  EXPECT_GE(fake_.reads_after_event, 2);
  // An event this node cannot open: refused, nothing done, and it says so.
  const int steps = backend().device_steps;
  AttendStats refused;
  ASSERT_TRUE(core_
                  ->AttendOnDevice(
                      tenant_, "", b,
                      DeviceExchangeIn{host_, kExchangeHandle, kQ, kK, kV, kO, kL, std::string(kIpcHandleBytes, 'z')},
                      &refused)
                  .ok());
  EXPECT_NE(refused.device_refusal.find("event"), std::string::npos) << refused.device_refusal;
  EXPECT_EQ(backend().device_steps, steps);
}

// A caller that takes replies once the work is queued names a word of its
// buffer that the backend sets when the work is done (no event): it reaches
// the backend as a pointer into the mapped buffer, only with the inputs'
// event and reply_when_queued; a word outside the buffer is refused.
TEST_F(NodeCoreExchangeTest, TheCallersDoneFlagReachesTheBackendInsideItsBuffer) {
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 1, 5}}).ok());
  const std::string ev(kIpcHandleBytes, 'e');
  fake_.events[ev] = 0;
  AttendBatch b = Batch(0);
  b.layout.reset();
  b.shape.num_rows = 1;
  b.positions = {4};
  b.sequences = {Row("s", 2, 5)};
  std::vector<uint8_t>& x = fake_.allocs[kExchangeHandle].bytes;
  const uint64_t flag = x.size() - 8;
  AttendStats st;
  ASSERT_TRUE(core_
                  ->AttendOnDevice(tenant_, "", b,
                                   DeviceExchangeIn{host_, kExchangeHandle, kQ, kK, kV, kO, kL, ev, true, flag, 77},
                                   &st)
                  .ok());
  EXPECT_EQ(backend().last_done_flag, reinterpret_cast<uint32_t*>(x.data() + flag));
  EXPECT_EQ(backend().last_done_flag_value, 77u);
  // Without reply_when_queued (or without the inputs' event) the node
  // answers once done: no word.
  ASSERT_TRUE(core_
                  ->AttendOnDevice(tenant_, "", b,
                                   DeviceExchangeIn{host_, kExchangeHandle, kQ, kK, kV, kO, kL, ev, false, flag, 77},
                                   &st)
                  .ok());
  EXPECT_EQ(backend().last_done_flag, nullptr);
  ASSERT_TRUE(core_
                  ->AttendOnDevice(tenant_, "", b,
                                   DeviceExchangeIn{host_, kExchangeHandle, kQ, kK, kV, kO, kL, "", true, flag, 77},
                                   &st)
                  .ok());
  EXPECT_EQ(backend().last_done_flag, nullptr);
  // A word past the buffer's end: an error, nothing done.
  const int steps = backend().device_steps;
  absl::Status s = core_->AttendOnDevice(
      tenant_, "", b, DeviceExchangeIn{host_, kExchangeHandle, kQ, kK, kV, kO, kL, ev, true, x.size() - 2, 77}, &st);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(backend().device_steps, steps);
}

// A quantized sequence's open tail is merged on the host: its steps through
// the exchange are refused, changing nothing (the client sends them again
// staged), and steps over its quantized blocks alone are served in place.
TEST_F(NodeCoreExchangeTest, AQuantizedSequencesTailIsNotAttendedInTheCallersMemory) {
  KvEncoding int8;
  ASSERT_TRUE(ParseKvEncoding("int8", &int8).ok());
  quantize_ = int8;
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"q", 0, 9}}).ok());  // blocks 0, 1 int8; block 2 open
  SyncSealed("q");
  const int before = backend().device_steps;
  EXPECT_NE(Step(0, {{"q", 1, 0}}).message().find("open tail"), absl::string_view::npos);
  EXPECT_EQ(backend().device_steps, before);
  EXPECT_EQ(kv_["q"].tokens(0), 9u * L_.kv_heads * L_.head_dim);
  // Its first 8 tokens (the int8 blocks) alone: in place.
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"q", 1, 0, {{0, 2}}}}).ok());
  EXPECT_EQ(backend().device_steps, before + 2);
}

TEST_F(NodeCoreExchangeTest, ARefusedExchangeDoesNothingAndSaysWhy) {
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 1, 5}}).ok());
  std::vector<float> kv(L_.kv_heads * L_.head_dim, 1.f);
  AttendBatch b = Batch(0);
  b.sequences = {AttendSequenceSpec{"s", {}, 6, 0, 1, 5}, AttendSequenceSpec{"new", {}, 1, 0, 1, 0}};
  std::vector<float> kv2(2 * kv.size(), 1.f);
  b.new_k = b.new_v = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(kv2.data()), kv2.size() * 4);
  NodeCoreOptions no;
  no.limits.max_payload_bytes = 1 << 16;
  NodeCore no_gpu(no, store_.get(), seqs_.get(), backend_.get(), &tenants_, &metrics_);
  const size_t known = seqs_->num_sequences();
  struct Case {
    std::string why;
    std::function<absl::Status(AttendStats*)> run;
  };
  const std::vector<Case> cases = {
      {"another host", [&](AttendStats* st) { return AttendThroughExchange(b, {}, st, "another-host"); }},
      {"cannot map",
       [&](AttendStats* st) {
         fake_.begin_status = absl::FailedPreconditionError("cannot map the caller's GPU memory");
         absl::Status s = AttendThroughExchange(b, {}, st);
         fake_.begin_status = absl::OkStatus();
         return s;
       }},
      {"kernels do not take",
       [&](AttendStats* st) {
         backend().refusal = "its kernels do not take these blocks";
         absl::Status s = AttendThroughExchange(b, {}, st);
         backend().refusal.clear();
         return s;
       }},
      {"no GPU",
       [&](AttendStats* st) {
         AttendBatch c = b;
         c.new_k = c.new_v = {};
         return no_gpu.AttendOnDevice(tenant_, "", c, DeviceExchangeIn{host_, kExchangeHandle, kQ, kK, kV, kO, kL}, st);
       }},
  };
  for (const Case& c : cases) {
    AttendStats st;
    absl::Status s = c.run(&st);
    EXPECT_TRUE(s.ok()) << c.why << ": " << s;
    EXPECT_NE(st.device_refusal.find(c.why), std::string::npos) << st.device_refusal;
    EXPECT_EQ(st.appended_tokens, 0u) << c.why;
  }
  EXPECT_EQ(seqs_->num_sequences(), known);  // "new" was not created
  EXPECT_EQ(backend().device_steps, 2);      // only the setup's two steps
  // A region beyond the caller's allocation is the request's error.
  AttendStats st;
  absl::Status s =
      core_->AttendOnDevice(tenant_, "", b, DeviceExchangeIn{host_, kExchangeHandle, kQ, 1 << 20, kV, kO, kL}, &st);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;  // (the delivery's range check: FakeBatch::Region here)
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE(Step(l, {{"s", 2, 3}}).ok());  // nothing changed
}

TEST(AttendRequestValidation, MalformedDeviceExchangesAreInvalidArguments) {
  v1::AttendRequest r;
  r.mutable_header()->set_version(1);
  r.set_q_heads(4);
  r.set_head_dim(16);
  r.set_num_rows(1);
  r.add_positions(0);
  v1::AttendSequence* s = r.add_sequences();
  s->set_sequence_id("s");
  s->set_tokens(1);
  s->set_rows(1);
  s->add_ranges()->set_end(1);
  v1::DeviceExchange* d = r.mutable_device();
  d->set_ipc_handle(std::string(kIpcHandleBytes, 'x'));
  d->set_out_offset(4096);
  ASSERT_TRUE(ParseAttendRequest(r, RequestLimits{}).ok());
  std::vector<std::pair<std::string, std::function<void(v1::AttendRequest&)>>> cases = {
      {"carries no query", [](v1::AttendRequest& r) { r.set_queries(std::string(256, 'q')); }},
      {"IPC handle has", [](v1::AttendRequest& r) { r.mutable_device()->set_ipc_handle("short"); }},
      {"not a multiple of 256", [](v1::AttendRequest& r) { r.mutable_device()->set_lse_offset(100); }},
      {"inputs-ready event handle has", [](v1::AttendRequest& r) { r.mutable_device()->set_inputs_ready_event("e"); }},
      {"done flag's offset",
       [](v1::AttendRequest& r) {
         r.mutable_device()->set_done_flag_value(5);
         r.mutable_device()->set_done_flag_offset(4098);
       }},
  };
  for (auto& [why, mutate] : cases) {
    v1::AttendRequest m = r;
    mutate(m);
    absl::Status st = ParseAttendRequest(m, RequestLimits{}).status();
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << why << ": " << st;
    EXPECT_NE(st.message().find(why), std::string::npos) << st.message();
  }
  const uint8_t beside[4] = {1, 2, 3, 4};
  EXPECT_TRUE(absl::IsInvalidArgument(ParseAttendRequest(r, RequestLimits{}, absl::MakeConstSpan(beside)).status()));
}

// ---- Get into a caller's GPU memory (device places) ----
// The node's side of same-host delivery, with FakeDelivery: what gets copied where, what is checked
// first with delivery_checksum on (block 9 has a bit flipped in the host
// tier after it was stored), and when the node answers with payloads instead. (The CUDA IPC
// delivery itself runs against real processes on a GPU: gpu_node_test.)
class NodeCoreDeliveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BlockStoreOptions so;
    so.page_bytes = 1 << 12;
    so.num_pages = 64;
    so.prefault = false;
    store_ = std::move(BlockStore::Create(so).value());
    seqs_ = std::move(SequenceTable::Create(nullptr).value());
    backend_ = std::make_unique<CpuAttentionBackend>(store_.get(), nullptr);
    NodeCoreOptions no;
    no.limits.max_payload_bytes = so.page_bytes;
    no.delivery_checksum = true;
    core_ = std::make_unique<NodeCore>(no, store_.get(), seqs_.get(), backend_.get(), &tenants_, &metrics_, &fake_);
    plain_ = std::make_unique<NodeCore>(no, store_.get(), seqs_.get(), backend_.get(), &tenants_, &metrics_);
    tenant_.set_id(3);
    tenant_.set_namespace_(TenantNamespace(3));
    host_ = HostBootId().value();
    fake_.allocs[Handle('a')].bytes.assign(4 * L_.bytes(), 0);
    // Blocks 1..3, and block 9 which is then corrupted in place.
    std::mt19937 rng(5);
    for (uint64_t i = 1; i <= 3; ++i) {
      std::vector<uint8_t> p(L_.bytes());
      for (auto& x : p) x = static_cast<uint8_t>(rng());
      payloads_[i] = p;
      PutArgs a{.tenant = 3, .ns = NamespaceIdOf(TenantNamespace(3)), .key = BlockKey{i, 1}};
      a.meta.layout = L_;
      a.meta.payload_bytes = static_cast<uint32_t>(L_.bytes());
      ASSERT_TRUE(store_->Put(a, p).ok());
    }
    std::vector<uint8_t> bad(L_.bytes(), 7);
    PutArgs a{.tenant = 3, .ns = NamespaceIdOf(TenantNamespace(3)), .key = BlockKey{9, 1}};
    a.meta.layout = L_;
    a.meta.payload_bytes = static_cast<uint32_t>(L_.bytes());
    ASSERT_TRUE(store_->Put(a, bad).ok());
    // A bit flipped in the host tier after the block was stored.
    PinnedBlock held = std::move(store_->Acquire(a.ns, a.key).value());
    const_cast<uint8_t*>(held.payload().data())[17] ^= 0x10;
  }
  static std::string Handle(char c) { return std::string(kIpcHandleBytes, c); }
  // A Get of `keys`, block i placed at i * block bytes of allocation 'a'.
  v1::GetRequest Request(const std::vector<uint64_t>& keys, const std::string& host) const {
    v1::GetRequest r;
    r.mutable_header()->set_version(1);
    r.set_host_id(host);
    r.add_device_allocations()->set_ipc_handle(Handle('a'));
    for (size_t i = 0; i < keys.size(); ++i) {
      KeyToProto(BlockKey{keys[i], 1}, r.add_keys());
      v1::DevicePlace* p = r.add_device_places();
      p->set_offset(i * L_.bytes());
      p->set_capacity(L_.bytes());
    }
    return r;
  }
  absl::Span<const uint8_t> Landed(size_t slot) {
    return absl::MakeConstSpan(fake_.allocs[Handle('a')].bytes).subspan(slot * L_.bytes(), L_.bytes());
  }

  const BlockLayout L_{4, 2, 2, 16, DType::kF32};
  std::unique_ptr<BlockStore> store_;
  std::unique_ptr<SequenceTable> seqs_;
  std::unique_ptr<CpuAttentionBackend> backend_;
  TenantDirectory tenants_;
  MetricsRegistry metrics_;
  FakeDelivery fake_;
  std::unique_ptr<NodeCore> core_, plain_;
  v1::Tenant tenant_;
  std::string host_;
  std::map<uint64_t, std::vector<uint8_t>> payloads_;
};

TEST_F(NodeCoreDeliveryTest, BlocksAreCopiedToTheirPlacesAndNoPayloadsFollow) {
  v1::GetResponse resp;
  ASSERT_TRUE(WireGet(*core_, tenant_, Request({3, 1, 77, 2}, host_), &resp).ok());
  EXPECT_TRUE(resp.delivered_to_device());
  EXPECT_EQ(fake_.finished, 1);
  ASSERT_EQ(resp.blocks_size(), 4);
  const uint64_t order[] = {3, 1, 0, 2};
  for (int i = 0; i < 4; ++i) {
    const v1::GetBlock& b = resp.blocks(i);
    EXPECT_TRUE(b.payload().empty());
    if (order[i] == 0) {
      EXPECT_EQ(b.status().code(), static_cast<int>(absl::StatusCode::kNotFound));
      continue;
    }
    ASSERT_EQ(b.status().code(), 0) << b.status().message();
    EXPECT_EQ(b.block().payload_bytes(), L_.bytes());
    EXPECT_EQ(b.block().checksum(), PayloadChecksum(payloads_[order[i]].data(), L_.bytes()));
    const auto landed = Landed(i);
    EXPECT_TRUE(std::equal(landed.begin(), landed.end(), payloads_[order[i]].begin())) << "slot " << i;
  }
  v1::StatsRequest sr;
  sr.mutable_header()->set_version(1);
  v1::StatsResponse st;
  ASSERT_TRUE(WireStats(*core_, tenant_, sr, &st).ok());
  EXPECT_EQ(st.device_delivered_bytes(), 3 * L_.bytes());
}

TEST_F(NodeCoreDeliveryTest, ACorruptBlockOrASmallPlaceIsRefusedAndTheRestDelivered) {
  v1::GetRequest r = Request({9, 1, 2}, host_);
  r.mutable_device_places(2)->set_capacity(L_.bytes() - 1);
  v1::GetResponse resp;
  ASSERT_TRUE(WireGet(*core_, tenant_, r, &resp).ok());
  EXPECT_TRUE(resp.delivered_to_device());
  EXPECT_EQ(resp.blocks(0).status().code(), static_cast<int>(absl::StatusCode::kDataLoss));
  EXPECT_NE(resp.blocks(0).status().message().find("fails its checksum"), std::string::npos);
  EXPECT_EQ(resp.blocks(1).status().code(), 0);
  EXPECT_EQ(resp.blocks(2).status().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  // Nothing was written for the refused blocks.
  for (int slot : {0, 2}) {
    const auto landed = Landed(slot);
    EXPECT_TRUE(std::all_of(landed.begin(), landed.end(), [](uint8_t x) { return x == 0; })) << slot;
  }
  const auto one = Landed(1);
  EXPECT_TRUE(std::equal(one.begin(), one.end(), payloads_[1].begin()));
}

TEST_F(NodeCoreDeliveryTest, WithoutTheDeliveryChecksumTheHostTierBytesGoAsTheyAre) {
  // The default trades the second check for bandwidth: the bytes of block 9
  // (corrupted in the host tier after they were checked at Put) go out as
  // they are. (The fixture's core_ has the check on.)
  NodeCoreOptions no;
  no.limits.max_payload_bytes = 1 << 12;
  EXPECT_FALSE(no.delivery_checksum);
  NodeCore unchecked(no, store_.get(), seqs_.get(), backend_.get(), &tenants_, &metrics_, &fake_);
  v1::GetResponse resp;
  ASSERT_TRUE(WireGet(unchecked, tenant_, Request({9, 1}, host_), &resp).ok());
  EXPECT_TRUE(resp.delivered_to_device());
  EXPECT_EQ(resp.blocks(0).status().code(), 0);
  EXPECT_EQ(resp.blocks(1).status().code(), 0);
  const auto one = Landed(1);
  EXPECT_TRUE(std::equal(one.begin(), one.end(), payloads_[1].begin()));
}

TEST_F(NodeCoreDeliveryTest, ANodeThatCannotDeliverAnswersWithPayloadsAndSaysWhy) {
  struct Case {
    NodeCore* core;
    std::string host;
    absl::Status begin;
    std::string why;
  };
  const Case cases[] = {
      {plain_.get(), host_, absl::OkStatus(), "no GPU"},
      {core_.get(), "another-host", absl::OkStatus(), "another host"},
      {core_.get(), host_, absl::FailedPreconditionError("cannot map the caller's GPU memory"), "cannot map"},
  };
  for (const Case& c : cases) {
    fake_.begin_status = c.begin;
    v1::GetResponse resp;
    ASSERT_TRUE(WireGet(*c.core, tenant_, Request({1, 2}, c.host), &resp).ok()) << c.why;
    EXPECT_FALSE(resp.delivered_to_device()) << c.why;
    EXPECT_NE(resp.device_refusal().find(c.why), std::string::npos) << resp.device_refusal();
    ASSERT_EQ(resp.blocks_size(), 2);
    for (int i = 0; i < 2; ++i) {
      ASSERT_EQ(resp.blocks(i).status().code(), 0) << c.why;
      EXPECT_EQ(resp.blocks(i).payload(), std::string(payloads_[i + 1].begin(), payloads_[i + 1].end())) << c.why;
    }
  }
  EXPECT_EQ(fake_.finished, 0);
}

TEST_F(NodeCoreDeliveryTest, MalformedDevicePlacesAreInvalidArguments) {
  std::vector<std::pair<std::string, std::function<void(v1::GetRequest&)>>> cases = {
      {"device places for", [](v1::GetRequest& r) { r.mutable_device_places()->RemoveLast(); }},
      {"has a handle of", [](v1::GetRequest& r) { r.mutable_device_allocations(0)->set_ipc_handle("short"); }},
      {"names allocation", [](v1::GetRequest& r) { r.mutable_device_places(1)->set_allocation(1); }},
      {"device allocations; give",
       [](v1::GetRequest& r) {
         for (int i = 0; i < kMaxGetDeviceAllocations; ++i) r.add_device_allocations()->set_ipc_handle(Handle('b'));
       }},
      {"host_id is longer", [](v1::GetRequest& r) { r.set_host_id(std::string(65, 'h')); }},
  };
  for (auto& [why, mutate] : cases) {
    v1::GetRequest r = Request({1, 2}, host_);
    mutate(r);
    v1::GetResponse resp;
    absl::Status s = WireGet(*core_, tenant_, r, &resp);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << why << ": " << s;
    EXPECT_NE(s.message().find(why), std::string::npos) << s.message();
  }
  EXPECT_EQ(fake_.finished, 0);
}

}  // namespace
}  // namespace kvring
