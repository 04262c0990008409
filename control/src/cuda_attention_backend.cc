#include "kvring/control/cuda_attention_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvring/attention/cuda/paged_attention_cuda.h"
#include "kvring/attention/cuda/paged_kv_update.h"
#include "kvring/cache/device_page_pool.h"
#include "kvring/common/cuda_status.h"
#include "kvring/common/logging.h"
#include "kvring/common/status_macros.h"
#include "kvring/common/stream_words.h"
#include "kvring/control/cpu_attention_backend.h"
#include "kvring/layout/float_convert.h"

namespace kvring {
namespace {

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A host staging buffer in pinned memory, or a device buffer, that grows.
struct Buffer {
  uint8_t* p = nullptr;
  size_t cap = 0;
  bool pinned = false;  // host (cudaHostAlloc) vs device (cudaMalloc)
  void Free() {
    if (p != nullptr) (void)(pinned ? cudaFreeHost(p) : cudaFree(p));  // at teardown or before a larger one
    p = nullptr;
    cap = 0;
  }
  // Grows to at least `n` bytes (contents are lost). The lane's stream must
  // be idle (it is, between requests).
  cudaError_t Reserve(size_t n) {
    if (n <= cap) return cudaSuccess;
    Free();
    const size_t c = std::max<size_t>(AlignUp(n), 1 << 20);
    void* q = nullptr;
    const cudaError_t e = pinned ? cudaHostAlloc(&q, c, cudaHostAllocDefault) : cudaMalloc(&q, c);
    if (e != cudaSuccess) return e;
    p = static_cast<uint8_t*>(q);
    cap = c;
    return cudaSuccess;
  }
};

struct DevSeq;

// One request at a time on the GPU: a stream and the buffers a step needs.
struct Lane {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, kernel_begin = nullptr, kernel_end = nullptr, done = nullptr;
  Buffer h_in{.pinned = true}, d_in, h_out{.pinned = true}, d_out, d_tables, d_workspace;
  // A prefill step's quantized pages dequantized (cuda::PagedPrefillDequantized).
  Buffer d_dequantized;
  // Bytes at the start of d_workspace known to be zero (the decode merge's
  // counters must be; earlier calls leave partials after their own).
  size_t counters_clean = 0;
  // Interprocess events a caller's stream waits on when the reply went
  // before the step's work was done (DeviceExchange.reply_when_queued),
  // used in turn: a caller slow to wait meets its own step's record, not a
  // later step's. Null where the device has no IPC events.
  static constexpr int kDoneEvents = 4;
  cudaEvent_t done_ipc[kDoneEvents] = {};
  std::string done_ipc_handle[kDoneEvents];
  int next_done = 0;
  // A step replied to while its work is still on the device: what it holds
  // until the work completes (CudaAttentionBackend::Reap). The lane is not
  // reused before then (its staging is still being read).
  struct InFlight {
    std::vector<DevSeq*> seqs;                        // busy (never dropped) until then
    std::vector<std::pair<BlockKey, int32_t>> keyed;  // promoted pages: shared once their bytes landed
    std::vector<PinnedBlock> sources;                 // the promotions' host copies
    std::shared_ptr<void> keepalive;                  // the caller's mapped memory and event
  };
  std::optional<InFlight> in_flight;
  // The lane's current step recorded kernel_begin / kernel_end (it had rows
  // to attend; a step of appends alone records none).
  bool attended = false;
  // The current step's device time (its events complete): the kernel's, and
  // the rest. Only events the step recorded are timed: timing one never
  // recorded fails and leaves its error for this thread's next launch (whose
  // cudaGetLastError would report it).
  void Elapsed(double* kernel_seconds, double* copy_seconds) const {
    float total_ms = 0, kernel_ms = 0;
    (void)cudaEventElapsedTime(&total_ms, start, done);
    if (attended) (void)cudaEventElapsedTime(&kernel_ms, kernel_begin, kernel_end);
    *kernel_seconds = kernel_ms * 1e-3;
    *copy_seconds = std::max(0.f, total_ms - kernel_ms) * 1e-3;
  }
  ~Lane() {
    for (Buffer* b : {&h_in, &d_in, &h_out, &d_out, &d_tables, &d_workspace, &d_dequantized}) b->Free();
    for (cudaEvent_t e : {start, kernel_begin, kernel_end, done}) {
      if (e != nullptr) (void)cudaEventDestroy(e);
    }
    for (cudaEvent_t e : done_ipc) {
      if (e != nullptr) (void)cudaEventDestroy(e);
    }
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

// The blob a step sends in its one host-to-device copy, section by section
// (each 256-byte aligned).
class Blob {
 public:
  size_t Add(size_t bytes) {
    const size_t at = size_;
    size_ = AlignUp(size_ + bytes);
    return at;
  }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

struct SeqId {
  NamespaceId ns;
  std::string id;
  friend bool operator==(const SeqId& a, const SeqId& b) { return a.ns == b.ns && a.id == b.id; }
  template <typename H>
  friend H AbslHashValue(H h, const SeqId& k) {
    return H::combine(std::move(h), k.ns, k.id);
  }
};

// A sequence's blocks in HBM: sorted block indices, their pages, and the
// device copy of its page tables (ids and token-0 positions, same order).
struct DevSeq {
  TenantId tenant = 0;
  uint32_t block_tokens = 0;
  uint64_t open_bytes_each = 0;  // charged to the tenant's budget in the store per open block
  std::vector<uint64_t> idx;
  std::vector<int32_t> page;
  std::vector<uint8_t> open;        // 1: an open block (only in HBM; never dropped)
  std::vector<uint8_t> needs_zero;  // an open page not yet cleared on the device
  int32_t* d_ids = nullptr;
  int32_t* d_pos = nullptr;
  size_t cap = 0;
  size_t synced = 0;  // device entries [0, synced) are current
  uint64_t last_use = 0;
  int busy = 0;
  Lane* flying = nullptr;  // the lane of its last step still on the device (replied when queued), if any
  size_t Find(uint64_t i) const {
    return static_cast<size_t>(std::lower_bound(idx.begin(), idx.end(), i) - idx.begin());
  }
  bool Has(uint64_t i) const {
    const size_t k = Find(i);
    return k < idx.size() && idx[k] == i;
  }
  // Every index of [b, e) resident (idx is sorted and unique).
  bool HasRange(uint64_t b, uint64_t e) const {
    const size_t k = Find(b);
    return k + (e - b) <= idx.size() && idx[k] == b && idx[k + (e - b) - 1] == e - 1;
  }
  void Insert(uint64_t i, int32_t pg, bool is_open) {
    const size_t k = Find(i);
    idx.insert(idx.begin() + k, i);
    page.insert(page.begin() + k, pg);
    open.insert(open.begin() + k, is_open ? 1 : 0);
    needs_zero.insert(needs_zero.begin() + k, is_open ? 1 : 0);
    synced = std::min(synced, k);
  }
  void Erase(size_t k) {
    idx.erase(idx.begin() + k);
    page.erase(page.begin() + k);
    open.erase(open.begin() + k);
    needs_zero.erase(needs_zero.begin() + k);
    synced = std::min(synced, k);
  }
  size_t full_pages() const {
    size_t n = 0;
    for (uint8_t o : open) n += o == 0;
    return n;
  }
};

// A step goes through stages, each a function of CudaAttentionBackend over
// this struct: Admit (sequences busy, blocks not in HBM found), FetchMissing
// (their host copies and pages), SizeTables (device page tables), Pack (the
// one host-to-device blob), EnqueueInputs and EnqueueAttention (the device
// work, no host synchronization), then HandOff (a reply before the work is
// done) or Finish. What a stage finds for the next lives here; on failure
// after Admit, Abandon gives back what the step took.
struct GpuStep {
  struct Missing {  // a block of the step not in HBM
    size_t seq;
    uint64_t index;
    BlockKey key;
    PinnedBlock host;
    int32_t page = -1;
  };
  struct KSeq {  // a kernel sequence: a plan sequence with rows
    size_t plan_i;
    std::vector<std::pair<size_t, size_t>> runs;  // slots [k0, k1) of its table
    int32_t tokens = 0;
  };
  // The blob's sections (byte offsets).
  struct Sections {
    size_t q = 0, k = 0, v = 0, pos = 0, rows = 0, pages = 0, tokens = 0, appends = 0, writes = 0, segs = 0;
  };

  GpuStep(const StepPlan& p, Lane* l) : plan(p), L(p.layout), lane(l), st(l->stream), dx(p.device) {}

  const StepPlan& plan;
  const BlockLayout& L;
  Lane* const lane;
  const cudaStream_t st;
  // A device plan: queries, K/V and output in the caller's GPU memory
  // (mapped). Its rows are used in place when the plan's rows are the
  // batch's; else the queries are gathered into the blob on the device and
  // the output scattered back from the lane's.
  const AttendDeviceIo* const dx;
  uint32_t max_rows = 0;
  bool decode = false;  // the split-KV decode kernel (few rows a sequence), else prefill

  // Admit, FetchMissing.
  std::vector<DevSeq*> dseq;       // per plan sequence, busy while the step holds it
  std::vector<cudaEvent_t> after;  // steps of these sequences still on the device
  std::vector<Missing> missing;

  // Pack.
  std::vector<KSeq> kseqs;
  std::vector<int32_t> zero_pages;
  uint32_t append_rows = 0, append_ops = 0;
  size_t q_elems = 0, num_writes = 0, num_segments = 0;
  bool direct = false, in_place = false;
  Sections off;
  size_t blob_bytes = 0, out_o = 0, out_bytes = 0, ids_bytes = 0;
  int max_count = 0, max_pages = 0, listed_pages = 0;
  const int32_t* direct_ids = nullptr;  // direct: the one run of the one sequence's table
  const int32_t* direct_pos = nullptr;
};

bool KernelsTake(const BlockLayout& l) {
  return (l.dtype == DType::kBF16 || l.dtype == DType::kF16) && cuda::KernelsTakeHeadDim(static_cast<int>(l.head_dim));
}

class CudaAttentionBackend final : public AttentionBackend {
 public:
  CudaAttentionBackend(const CudaBackendOptions& o, BlockStore* store, ThreadPool* cpu_pool)
      : o_(o), store_(store), cpu_(store, cpu_pool) {}

  absl::Status Init() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || o_.device < 0 || o_.device >= n) {
      return absl::FailedPreconditionError(absl::StrCat("no CUDA device ", o_.device, " (", n, " visible)"));
    }
    KVRING_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(o_.device), "cudaSetDevice"));
    KVRING_RETURN_IF_ERROR(
        CudaStatus(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, o_.device), "device attributes"));
    if (o_.page_bytes == 0 || o_.page_bytes % kAlign != 0) {
      return absl::InvalidArgumentError("HBM page bytes must be a positive multiple of 256");
    }
    const uint64_t pages = o_.hbm_bytes / o_.page_bytes;
    if (pages == 0) return absl::InvalidArgumentError("hbm_bytes must hold at least one page");
    if (o_.lanes < 1 || o_.lanes > 64) return absl::InvalidArgumentError("lanes must be in [1, 64]");
    // One slab: the kernels address pages as pool + id * page_bytes.
    DevicePagePoolOptions po;
    po.page_bytes = o_.page_bytes;
    po.num_pages = pages;
    po.device = o_.device;
    po.slab_bytes = pages * o_.page_bytes;
    KVRING_ASSIGN_OR_RETURN(pool_, DevicePagePool::Create(po));
    pool_base_ = pool_->page_address(0);
    {
      absl::MutexLock l(&mu_);
      pages_.assign(pages, PageInfo{});
    }
    KVRING_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&admin_stream_, cudaStreamNonBlocking), "admin stream"));
    for (int i = 0; i < o_.lanes; ++i) {
      auto l = std::make_unique<Lane>();
      KVRING_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking), "lane stream"));
      for (cudaEvent_t* e : {&l->start, &l->kernel_begin, &l->kernel_end, &l->done}) {
        KVRING_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(e), "lane event"));
      }
      int ipc_events = 0;
      (void)cudaDeviceGetAttribute(&ipc_events, cudaDevAttrIpcEventSupport, o_.device);
      for (int k = 0; ipc_events && k < Lane::kDoneEvents; ++k) {
        cudaIpcEventHandle_t h;
        if (cudaEventCreateWithFlags(&l->done_ipc[k], cudaEventDisableTiming | cudaEventInterprocess) != cudaSuccess ||
            cudaIpcGetEventHandle(&h, l->done_ipc[k]) != cudaSuccess) {
          (void)cudaGetLastError();
          KVRING_LOG(INFO) << "no interprocess events on this device: every Attend replies once its work is done";
          for (cudaEvent_t& e : l->done_ipc) {
            if (e != nullptr) (void)cudaEventDestroy(e);
            e = nullptr;
          }
          break;
        }
        l->done_ipc_handle[k].assign(reinterpret_cast<const char*>(&h), sizeof(h));
      }
      absl::MutexLock lk(&lanes_mu_);
      free_lanes_.push_back(l.get());
      lanes_.push_back(std::move(l));
    }
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, o_.device) == cudaSuccess) device_name_ = prop.name;
    KVRING_LOG(INFO) << "CUDA backend on device " << o_.device << " (" << device_name_ << ", " << sm_count_
                     << " SMs): " << pages << " HBM pages x " << o_.page_bytes << " bytes, " << o_.lanes << " lanes";
    return absl::OkStatus();
  }

  ~CudaAttentionBackend() override {
    Reap(ReapMode::kAll);
    if (healthy_) (void)cudaDeviceSynchronize();  // nothing may still read the pool or tables
    absl::MutexLock l(&mu_);
    for (auto& [id, d] : seqs_) FreeTables(*d);
    lanes_.clear();
    if (admin_stream_ != nullptr) (void)cudaStreamDestroy(admin_stream_);
  }

  std::string name() const override { return absl::StrCat("cuda:", o_.device); }

  absl::Status AdmitBlock(const SequenceRef& seq, uint64_t index, const BlockKey& key, const BlockMeta& meta,
                          absl::Span<const uint8_t> payload) override {
    if (!KernelsTake(meta.layout)) {
      MarkCpu(seq);
      return cpu_.AdmitBlock(seq, index, key, meta, payload);
    }
    KVRING_RETURN_IF_ERROR(Healthy());
    Reap(ReapMode::kDone);  // (their sequences' pages may be evicted again)
    if (payload.size() > o_.page_bytes) return absl::InvalidArgumentError("block larger than an HBM page");
    const SeqId id{seq.ns, seq.id};
    int32_t page;
    {
      absl::MutexLock l(&mu_);
      DevSeq& d = SeqLocked(id);
      d.tenant = seq.tenant;
      d.block_tokens = meta.layout.block_tokens;
      if (d.Has(index)) return absl::OkStatus();  // resident already
      d.last_use = ++clock_;
      if (int32_t shared = SharedPageLocked(key); shared >= 0) {  // another sequence's page of the same block
        d.Insert(index, shared, /*is_open=*/false);
        return absl::OkStatus();
      }
      KVRING_ASSIGN_OR_RETURN(page, AllocatePageLocked(seq.tenant, &id));
      d.Insert(index, page, /*is_open=*/false);
      ++d.busy;
    }
    // The payload is host memory the caller keeps until we return.
    absl::Status s;
    {
      absl::MutexLock a(&admin_mu_);
      s = Check(
          cudaMemcpyAsync(PageAddress(page), payload.data(), payload.size(), cudaMemcpyHostToDevice, admin_stream_),
          "copy of a sequence block into HBM");
      if (s.ok()) s = Check(cudaStreamSynchronize(admin_stream_), "copy of a sequence block into HBM");
    }
    absl::MutexLock l(&mu_);
    DevSeq& d = SeqLocked(id);
    --d.busy;
    if (!s.ok()) {
      DropBlockLocked(d, index);
    } else {
      KeyPageLocked(key, page);
    }
    return s;
  }

  absl::Status OpenBlock(const SequenceRef& seq, uint64_t index, const BlockLayout& layout) override {
    if (!KernelsTake(layout)) {
      MarkCpu(seq);
      return cpu_.OpenBlock(seq, index, layout);
    }
    KVRING_RETURN_IF_ERROR(Healthy());
    Reap(ReapMode::kDone);
    if (layout.bytes() > o_.page_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a block of ", layout.bytes(), " bytes is larger than this node's ", o_.page_bytes, "-byte HBM pages"));
    }
    const SeqId id{seq.ns, seq.id};
    // An open block is the tenant's alone until sealed: it counts against the
    // tenant's one budget (kept by the store, with its pinned bytes).
    KVRING_RETURN_IF_ERROR(store_->ChargeOpenBytes(seq.tenant, layout.bytes()));
    absl::MutexLock l(&mu_);
    DevSeq& d = SeqLocked(id);
    d.tenant = seq.tenant;
    d.block_tokens = layout.block_tokens;
    d.open_bytes_each = layout.bytes();
    if (d.Has(index)) {
      store_->RefundOpenBytes(seq.tenant, layout.bytes());
      return absl::AlreadyExistsError(absl::StrCat("block ", index, " is already in HBM"));
    }
    absl::StatusOr<int32_t> page = AllocatePageLocked(seq.tenant, &id);
    if (!page.ok()) {
      store_->RefundOpenBytes(seq.tenant, layout.bytes());
      return page.status();
    }
    d.Insert(index, *page, /*is_open=*/true);
    ++open_blocks_;
    return absl::OkStatus();
  }

  void DiscardOpenBlock(const SequenceRef& seq, uint64_t index) override {
    if (OnCpu(seq)) return cpu_.DiscardOpenBlock(seq, index);
    Reap(ReapMode::kAll);  // nothing on the device may still write the page
    absl::MutexLock l(&mu_);
    DevSeq* dp = FindLocked(SeqId{seq.ns, seq.id});
    if (dp == nullptr) return;
    DevSeq& d = *dp;
    const size_t k = d.Find(index);
    if (k >= d.idx.size() || d.idx[k] != index || !d.open[k]) return;
    DropBlockLocked(d, index);
    --open_blocks_;
    store_->RefundOpenBytes(d.tenant, d.open_bytes_each);
  }

  void ForgetSequence(const SequenceRef& seq) override {
    const SeqId id{seq.ns, seq.id};
    Reap(ReapMode::kAll);  // no step still on the device holds it
    {
      absl::MutexLock l(&mu_);
      auto cpu = on_cpu_.find(id);
      if (cpu != on_cpu_.end()) {  // served by the CPU fallback
        on_cpu_.erase(cpu);
        cpu_.ForgetSequence(seq);
        return;
      }
      auto it = seqs_.find(id);
      if (it == seqs_.end()) return;
      DevSeq& d = *it->second;
      for (size_t k = 0; k < d.idx.size(); ++k) {
        FreePageLocked(d.page[k]);
        if (d.open[k]) {
          --open_blocks_;
          store_->RefundOpenBytes(d.tenant, d.open_bytes_each);
        }
      }
      // No step of this sequence is in flight (the core holds its lock, and
      // the steps replied to early completed above), so nothing reads its
      // tables; cudaFree waits for the device anyway.
      FreeTables(d);
      seqs_.erase(it);
    }
  }

  absl::Status ReadOpenBlock(const SequenceRef& seq, uint64_t index, absl::Span<uint8_t> dst) override {
    if (OnCpu(seq)) return cpu_.ReadOpenBlock(seq, index, dst);
    KVRING_RETURN_IF_ERROR(Healthy());
    Reap(ReapMode::kAll);  // the appends still on the device land first
    int32_t page;
    {
      absl::MutexLock l(&mu_);
      DevSeq* d = FindLocked(SeqId{seq.ns, seq.id});
      if (d == nullptr || !d->Has(index)) {
        return absl::InternalError(absl::StrCat("block ", index, " of '", seq.id, "' is not in HBM"));
      }
      page = d->page[d->Find(index)];
    }
    absl::MutexLock a(&admin_mu_);
    KVRING_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(dst.data(), PageAddress(page), std::min<size_t>(dst.size(), o_.page_bytes),
                              cudaMemcpyDeviceToHost, admin_stream_),
              "copy of a filled block out of HBM"));
    return Check(cudaStreamSynchronize(admin_stream_), "copy of a filled block out of HBM");
  }

  void SealBlock(const SequenceRef& seq, uint64_t index, const BlockKey& key, const KvEncoding& stored) override {
    if (OnCpu(seq)) return cpu_.SealBlock(seq, index, key, stored);
    // The page holds the plain bytes; a quantized block is promoted from the
    // store when next read.
    if (stored.quantized()) return DiscardOpenBlock(seq, index);
    absl::MutexLock l(&mu_);
    DevSeq* d = FindLocked(SeqId{seq.ns, seq.id});
    if (d == nullptr) return;
    const size_t k = d->Find(index);
    if (k < d->idx.size() && d->idx[k] == index && d->open[k]) {
      d->open[k] = 0;  // now a full block whose home is the store: droppable
      --open_blocks_;
      store_->RefundOpenBytes(d->tenant, d->open_bytes_each);
      KeyPageLocked(key, d->page[k]);  // (its last append's step completed: the page holds it)
    }
  }

  void SetTenantQuota(TenantId tenant, uint64_t max_bytes) override {
    cpu_.SetTenantQuota(tenant, max_bytes);
    absl::MutexLock l(&mu_);
    quota_[tenant] = max_bytes;
  }

  BackendStats stats() override {
    BackendStats s;
    s.name = name();
    s.pages = pool_->num_pages();
    s.free_pages = pool_->free_pages();
    s.page_bytes = o_.page_bytes;
    absl::MutexLock l(&mu_);
    for (const auto& [id, d] : seqs_) s.resident_blocks += d->full_pages();
    s.shared_pages = shared_pages_;
    s.hits = hits_;
    s.misses = misses_;
    s.demotions = demotions_;
    s.open_blocks = open_blocks_ + cpu_.stats().open_blocks;
    s.healthy = healthy_;
    return s;
  }

  uint64_t TenantBytes(TenantId tenant) override {
    absl::MutexLock l(&mu_);
    auto it = tenant_pages_.find(tenant);
    return it == tenant_pages_.end() ? 0 : it->second * o_.page_bytes;
  }

  absl::Status Step(const StepPlan& plan, PartialOutput out, StepTimes* times) override;
  std::string DeviceIoRefusal(const BlockLayout& l, const KvEncoding& e, DType q_dtype) const override {
    if (!KernelsTake(l))
      return "this node attends over these blocks on the CPU (its kernels take bf16/f16, head_dim 64/128/256)";
    if (q_dtype != l.dtype) return "queries in GPU memory must be in the blocks' dtype";
    return "";
  }

 private:
  // Step's stages (GpuStep).
  absl::Status Admit(GpuStep& w) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status FetchMissing(GpuStep& w) ABSL_LOCKS_EXCLUDED(mu_, lanes_mu_);
  absl::Status SizeTables(GpuStep& w) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Pack(GpuStep& w) ABSL_LOCKS_EXCLUDED(mu_);
  void PackTables(GpuStep& w) ABSL_LOCKS_EXCLUDED(mu_);
  cuda::PagedKvView KvViewOf(const GpuStep& w) const;
  absl::Status EnqueueInputs(GpuStep& w);
  absl::Status EnqueueAttention(GpuStep& w);
  absl::Status LaunchDecode(GpuStep& w, const cuda::AttnParams& p, const cuda::QueryView& qv,
                            const cuda::PagedKvView& kv, cuda::OutputView out);
  absl::Status LaunchPrefill(GpuStep& w, const cuda::AttnParams& p, const cuda::QueryView& qv,
                             const cuda::PagedKvView& kv, cuda::OutputView out);
  // The reply goes before the work is done: the caller's word (or an event)
  // set after it on the lane's stream, the step's holds moved to the lane.
  // False (nothing queued, nothing moved) when neither can be set: the
  // caller then waits for the work.
  absl::StatusOr<bool> HandOff(GpuStep& w, StepTimes* times) ABSL_LOCKS_EXCLUDED(mu_);
  void Finish(GpuStep& w, PartialOutput out, StepTimes* times) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Abandon(GpuStep& w, absl::Status s) ABSL_LOCKS_EXCLUDED(mu_);

  void* PageAddress(int32_t page) const { return static_cast<uint8_t*>(pool_base_) + uint64_t(page) * o_.page_bytes; }

  absl::Status Healthy() const {
    if (healthy_) return absl::OkStatus();
    return absl::UnavailableError("this node's GPU context failed; the node is restarting");
  }

  // The status of a CUDA call; a context-poisoning error also marks the
  // backend unhealthy and runs on_fatal once.
  absl::Status Check(cudaError_t e, absl::string_view what) {
    if (e == cudaSuccess) return absl::OkStatus();
    absl::Status s = CudaStatus(e, what);
    if (CudaErrorIsSticky(e) && healthy_.exchange(false)) {
      KVRING_LOG(ERROR) << "GPU context poisoned: " << s;
      if (o_.on_fatal) o_.on_fatal(s);
    }
    return s;
  }

  void MarkCpu(const SequenceRef& seq) {
    absl::MutexLock l(&mu_);
    on_cpu_[SeqId{seq.ns, seq.id}] = true;
  }
  bool OnCpu(const SequenceRef& seq) {
    absl::MutexLock l(&mu_);
    return on_cpu_.contains(SeqId{seq.ns, seq.id});
  }

  // A free HBM page for `tenant`, dropping the full pages of the least
  // recently used idle sequence (not `self`) when none is free.
  absl::StatusOr<int32_t> AllocatePageLocked(TenantId tenant, const SeqId* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto q = quota_.find(tenant);
    if (q != quota_.end() && (tenant_pages_[tenant] + 1) * o_.page_bytes > q->second) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the tenant's HBM pages would exceed its quota of ", q->second, " pinned bytes"));
    }
    for (;;) {
      absl::StatusOr<PageId> p = pool_->Allocate();
      if (p.ok()) {
        ++tenant_pages_[tenant];
        pages_[*p] = PageInfo{tenant, 1, false, BlockKey{}};
        return static_cast<int32_t>(*p);
      }
      DevSeq* victim = nullptr;
      for (auto& [id, d] : seqs_) {
        if (d->busy > 0 || d->full_pages() == 0 || (self != nullptr && id == *self)) continue;
        if (victim == nullptr || d->last_use < victim->last_use) victim = d.get();
      }
      if (victim == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat("HBM full: all ", pool_->num_pages(),
                                                         " pages hold open blocks or blocks of sequences in use"));
      }
      for (size_t k = victim->idx.size(); k-- > 0;) {
        if (victim->open[k]) continue;
        FreePageLocked(victim->page[k]);
        victim->Erase(k);
        ++demotions_;
      }
    }
  }

  DevSeq& SeqLocked(const SeqId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::unique_ptr<DevSeq>& d = seqs_[id];
    if (d == nullptr) d = std::make_unique<DevSeq>();
    return *d;
  }
  DevSeq* FindLocked(const SeqId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = seqs_.find(id);
    return it == seqs_.end() ? nullptr : it->second.get();
  }

  // One holder of `page` fewer; the last gives it back to the pool (and
  // the tenant that allocated it its quota).
  void FreePageLocked(int32_t page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    PageInfo& pi = pages_[page];
    if (pi.holders > 1) {
      if (--pi.holders == 1) --shared_pages_;
      return;
    }
    if (pi.keyed) {
      auto it = keyed_pages_.find(pi.key);
      if (it != keyed_pages_.end() && it->second == page) keyed_pages_.erase(it);
    }
    --tenant_pages_[pi.owner];
    pi = PageInfo{};
    (void)pool_->Free(static_cast<PageId>(page));  // a page this backend allocated
  }

  // The resident page holding full block `key` (the same block another
  // sequence holds: a fork's shared blocks), with one more holder; -1 when
  // none.
  int32_t SharedPageLocked(const BlockKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = keyed_pages_.find(key);
    if (it == keyed_pages_.end()) return -1;
    if (pages_[it->second].holders++ == 1) ++shared_pages_;
    return it->second;
  }
  // `page` now holds full block `key`, its bytes landed: later promotions
  // of the key share it.
  void KeyPageLocked(const BlockKey& key, int32_t page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (keyed_pages_.contains(key)) return;  // another page holds it already
    keyed_pages_[key] = page;
    pages_[page].key = key;
    pages_[page].keyed = true;
  }

  // Block `index` of `d` leaves HBM (its page freed), if it is there.
  void DropBlockLocked(DevSeq& d, uint64_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t k = d.Find(index);
    if (k >= d.idx.size() || d.idx[k] != index) return;
    FreePageLocked(d.page[k]);
    d.Erase(k);
  }

  void FreeTables(DevSeq& d) {
    if (d.d_ids != nullptr) (void)cudaFree(d.d_ids);  // the device is idle at teardown
    d.d_ids = d.d_pos = nullptr;
    d.cap = 0;
  }

  // A free lane; lanes whose steps completed on the device are freed first,
  // and with none free the oldest still on the device is waited for.
  Lane* AcquireLane() ABSL_LOCKS_EXCLUDED(mu_, lanes_mu_) {
    Reap(ReapMode::kDone);
    for (;;) {
      {
        absl::MutexLock l(&lanes_mu_);
        lanes_mu_.Await(absl::Condition(this, &CudaAttentionBackend::LaneOrFlyingLocked));
        if (!free_lanes_.empty()) {
          Lane* lane = free_lanes_.back();
          free_lanes_.pop_back();
          return lane;
        }
      }
      Reap(ReapMode::kOldest);
    }
  }
  bool LaneOrFlyingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(lanes_mu_) {
    return !free_lanes_.empty() || !flying_.empty();
  }
  void ReleaseLane(Lane* lane) {
    absl::MutexLock l(&lanes_mu_);
    free_lanes_.push_back(lane);
  }
  // Completes steps replied to early whose work is done on the device
  // (kDone), the oldest after waiting for it and any others done (kOldest),
  // or all, waiting for each (kAll): their sequences are no longer busy,
  // their promoted pages shared, their host copies and the caller's mapped
  // memory let go, their lanes free.
  enum class ReapMode { kDone, kOldest, kAll };
  void Reap(ReapMode mode) ABSL_LOCKS_EXCLUDED(mu_, lanes_mu_) {
    std::vector<Lane*> done;
    {
      absl::MutexLock l(&lanes_mu_);
      for (auto it = flying_.begin(); it != flying_.end();) {
        const bool take = mode == ReapMode::kAll || (mode == ReapMode::kOldest && it == flying_.begin()) ||
                          cudaEventQuery((*it)->done) == cudaSuccess;
        if (take) {
          done.push_back(*it);
          it = flying_.erase(it);
        } else {
          ++it;
        }
      }
    }
    if (done.empty()) return;
    std::vector<Lane::InFlight> released;
    for (Lane* lane : done) {
      // (a failure here poisoned the context: Check reports it; the step's
      // caller met it on its own stream)
      (void)Check(cudaEventSynchronize(lane->done), "a step replied to before its work was done");
      double kernel_s = 0, copy_s = 0;
      lane->Elapsed(&kernel_s, &copy_s);
      last_kernel_seconds_ = kernel_s;
      last_copy_seconds_ = copy_s;
    }
    {
      absl::MutexLock l(&mu_);
      for (Lane* lane : done) {
        Lane::InFlight& f = *lane->in_flight;
        for (DevSeq* d : f.seqs) {
          --d->busy;
          if (d->flying == lane) d->flying = nullptr;
        }
        for (const auto& [key, page] : f.keyed) KeyPageLocked(key, page);
        released.push_back(std::move(f));
        lane->in_flight.reset();
      }
    }
    released.clear();  // the host copies' holds go without mu_ held
    absl::MutexLock l(&lanes_mu_);
    for (Lane* lane : done) free_lanes_.push_back(lane);
  }

  const CudaBackendOptions o_;
  BlockStore* store_;
  CpuAttentionBackend cpu_;
  int sm_count_ = 0;
  std::string device_name_;
  std::unique_ptr<DevicePagePool> pool_;
  void* pool_base_ = nullptr;
  std::atomic<bool> healthy_{true};
  // False once the driver refused a stream word write (a caller's done flag):
  // later steps answer with events, or once their work is done.
  std::atomic<bool> stream_words_ok_{true};

  absl::Mutex admin_mu_;  // the admin stream (block copies in and out of HBM)
  cudaStream_t admin_stream_ = nullptr;

  // Lock order: mu_ before lanes_mu_ (never the other way).
  absl::Mutex lanes_mu_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::vector<Lane*> free_lanes_ ABSL_GUARDED_BY(lanes_mu_);
  std::deque<Lane*> flying_ ABSL_GUARDED_BY(lanes_mu_);  // steps replied to early, oldest first
  // The device times of the last step completed after its reply (what an
  // early reply reports: its own are not known yet).
  std::atomic<double> last_kernel_seconds_{0}, last_copy_seconds_{0};

  absl::Mutex mu_;
  absl::flat_hash_map<SeqId, std::unique_ptr<DevSeq>> seqs_ ABSL_GUARDED_BY(mu_);  // stable addresses
  absl::flat_hash_map<SeqId, bool> on_cpu_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<TenantId, uint64_t> quota_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<TenantId, uint64_t> tenant_pages_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hits_ ABSL_GUARDED_BY(mu_) = 0, misses_ ABSL_GUARDED_BY(mu_) = 0, demotions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t open_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  // Per HBM page: the tenant charged for it, how many sequence tables hold
  // it (a fork's shared blocks: more than one), and the full block it holds
  // once its bytes landed (keyed_pages_ finds it by key).
  struct PageInfo {
    TenantId owner = 0;
    uint32_t holders = 0;
    bool keyed = false;
    BlockKey key;
  };
  std::vector<PageInfo> pages_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<BlockKey, int32_t> keyed_pages_ ABSL_GUARDED_BY(mu_);
  uint64_t shared_pages_ ABSL_GUARDED_BY(mu_) = 0;  // pages with more than one holder
};

// Converts `rows` query rows into the KV dtype (the kernels read queries in
// the dtype of the pages).
void ConvertQueries(const uint8_t* src, DType from, size_t n, DType to, uint8_t* dst) {
  if (from == to) {
    std::memcpy(dst, src, n * DTypeSize(from));
    return;
  }
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; ++i) {
    float f;
    switch (from) {
      case DType::kF32:
        std::memcpy(&f, src + 4 * i, 4);
        break;
      case DType::kBF16:
        f = Bf16ToFloat(reinterpret_cast<const uint16_t*>(src)[i]);
        break;
      default:
        f = F16ToFloat(reinterpret_cast<const uint16_t*>(src)[i]);
        break;
    }
    d[i] = to == DType::kBF16 ? FloatToBf16(f) : FloatToF16(f);
  }
}

constexpr size_t kPageElemBytes = 2;  // bf16/fp16 pages (KernelsTake)

absl::Status CudaAttentionBackend::Step(const StepPlan& plan, PartialOutput out, StepTimes* times) {
  if (!KernelsTake(plan.layout)) return cpu_.Step(plan, out, times);
  KVRING_RETURN_IF_ERROR(Healthy());
  struct LaneGuard {
    CudaAttentionBackend* self;
    Lane* lane;  // null: handed on (in flight)
    ~LaneGuard() {
      if (lane != nullptr) self->ReleaseLane(lane);
    }
  } guard{this, AcquireLane()};
  GpuStep w(plan, guard.lane);
  for (const StepSequence& s : plan.sequences) w.max_rows = std::max(w.max_rows, s.rows);
  w.decode = w.max_rows * (plan.shape.q_heads / plan.layout.kv_heads) <= 64;
  absl::Status s = Admit(w);
  if (s.ok()) s = FetchMissing(w);
  if (s.ok()) s = SizeTables(w);
  if (s.ok()) s = Pack(w);
  if (!s.ok()) return Abandon(w, s);
  s = EnqueueInputs(w);
  if (s.ok()) s = EnqueueAttention(w);
  if (s.ok()) s = Check(cudaEventRecord(w.lane->done, w.st), "event");
  // The caller's stream can wait for the work (its inputs were on it too):
  // the reply goes now, with the caller's word or an event for that stream, and the step's holds
  // stay until the work completes (Reap).
  if (s.ok() && w.dx != nullptr && w.dx->reply_when_queued && w.dx->inputs_ready != nullptr && times != nullptr &&
      (w.dx->done_flag != nullptr || w.lane->done_ipc[0] != nullptr)) {
    absl::StatusOr<bool> handed = HandOff(w, times);
    if (!handed.ok()) s = handed.status();
    if (s.ok() && *handed) {
      guard.lane = nullptr;
      absl::MutexLock l(&lanes_mu_);
      flying_.push_back(w.lane);
      return absl::OkStatus();
    }
  }
  if (s.ok()) s = Check(cudaEventSynchronize(w.lane->done), "the step on the GPU");
  if (!s.ok()) {
    w.lane->counters_clean = 0;  // unknown after a failed step: cleared before the next decode
    if (healthy_) {
      // Drain what was enqueued before the lane is used again.
      (void)Check(cudaStreamSynchronize(w.st), "draining a failed step");
    }
    return Abandon(w, s);
  }
  Finish(w, out, times);
  return absl::OkStatus();
}

absl::Status CudaAttentionBackend::Abandon(GpuStep& w, absl::Status s) {
  // Promoted pages are dropped again (their contents are not known to have
  // landed) and the sequences released.
  absl::MutexLock l(&mu_);
  for (GpuStep::Missing& m : w.missing) {
    if (m.page >= 0) DropBlockLocked(*w.dseq[m.seq], m.index);
  }
  for (DevSeq* d : w.dseq) --d->busy;
  return s;
}

absl::Status CudaAttentionBackend::Admit(GpuStep& w) {
  const StepPlan& plan = w.plan;
  w.dseq.resize(plan.sequences.size());
  absl::MutexLock l(&mu_);
  const uint64_t now = ++clock_;
  for (size_t i = 0; i < plan.sequences.size(); ++i) {
    const StepSequence& s = plan.sequences[i];
    DevSeq& d = SeqLocked(SeqId{s.seq.ns, s.seq.id});
    d.tenant = s.seq.tenant;
    d.block_tokens = w.L.block_tokens;
    d.last_use = now;
    ++d.busy;  // never dropped while in the step
    w.dseq[i] = &d;
    // Its steps still on the device (replied to early): this one's work
    // follows theirs. (A lane that completed and was reused since only makes
    // the wait longer.)
    if (d.flying != nullptr) w.after.push_back(d.flying->done);
  }
  for (size_t i = 0; i < plan.sequences.size(); ++i) {
    const StepSequence& s = plan.sequences[i];
    DevSeq& d = *w.dseq[i];
    for (const BlockRange& rg : s.ranges) {
      if (d.HasRange(rg.begin, rg.end)) {  // the common case: O(log n)
        hits_ += rg.size();
        continue;
      }
      for (uint64_t idx = rg.begin; idx < rg.end; ++idx) {
        if (d.Has(idx)) {
          ++hits_;
          continue;
        }
        auto full = s.full->find(idx);
        if (full == s.full->end()) {
          return absl::InternalError(absl::StrCat("open block ", idx, " of '", s.seq.id, "' is not in HBM"));
        }
        if (int32_t shared = SharedPageLocked(full->second); shared >= 0) {
          ++hits_;  // another sequence's page of the same block (a fork's shared block)
          d.Insert(idx, shared, /*is_open=*/false);
          continue;
        }
        ++misses_;
        w.missing.push_back(GpuStep::Missing{i, idx, full->second, {}});
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CudaAttentionBackend::FetchMissing(GpuStep& w) {
  if (w.missing.empty()) return absl::OkStatus();
  // The host copies (store I/O, no lock), then their pages (steps done on
  // the device let go of theirs first).
  Reap(ReapMode::kDone);
  for (GpuStep::Missing& m : w.missing) {
    const StepSequence& s = w.plan.sequences[m.seq];
    absl::StatusOr<PinnedBlock> pb = store_->Acquire(s.seq.ns, m.key);
    if (!pb.ok()) {
      return absl::Status(pb.status().code(),
                          absl::StrCat("sequence '", s.seq.id, "' block ", m.index, ": ", pb.status().message()));
    }
    if (!(pb->meta().layout == w.L) || !(pb->meta().encoding == w.plan.encoding) ||
        pb->payload().size() > o_.page_bytes) {
      return absl::FailedPreconditionError(absl::StrCat("sequence '", s.seq.id, "' block ", m.index,
                                                        " has another layout or encoding than the sequence"));
    }
    m.host = std::move(*pb);
  }
  absl::MutexLock l(&mu_);
  for (GpuStep::Missing& m : w.missing) {
    const StepSequence& s = w.plan.sequences[m.seq];
    const SeqId self{s.seq.ns, s.seq.id};
    absl::StatusOr<int32_t> page = AllocatePageLocked(s.seq.tenant, &self);
    if (!page.ok()) return page.status();
    m.page = *page;
    w.dseq[m.seq]->Insert(m.index, *page, /*is_open=*/false);
  }
  return absl::OkStatus();
}

absl::Status CudaAttentionBackend::SizeTables(GpuStep& w) {
  // Only this step touches the tables of its sequences.
  for (DevSeq* d : w.dseq) {
    size_t need, synced;
    {
      absl::MutexLock l(&mu_);
      need = d->idx.size();
      synced = d->synced;
    }
    if (need <= d->cap) continue;
    const size_t cap = std::max<size_t>(64, need * 2);
    void* nt = nullptr;
    KVRING_RETURN_IF_ERROR(Check(cudaMallocAsync(&nt, cap * 8, w.st), "page table"));
    int32_t* ni = static_cast<int32_t*>(nt);
    absl::Status s = absl::OkStatus();
    if (d->d_ids != nullptr) {
      if (synced > 0) {  // entries from `synced` on are written by the step
        s = Check(cudaMemcpyAsync(ni, d->d_ids, synced * 4, cudaMemcpyDeviceToDevice, w.st), "page table copy");
        if (s.ok()) {
          s = Check(cudaMemcpyAsync(ni + cap, d->d_pos, synced * 4, cudaMemcpyDeviceToDevice, w.st), "page table copy");
        }
      }
      if (s.ok()) s = Check(cudaFreeAsync(d->d_ids, w.st), "page table");
    }
    d->d_ids = ni;
    d->d_pos = ni + cap;
    d->cap = cap;
    KVRING_RETURN_IF_ERROR(s);
  }
  return absl::OkStatus();
}

absl::Status CudaAttentionBackend::Pack(GpuStep& w) {
  const StepPlan& plan = w.plan;
  const BlockLayout& L = w.L;
  const size_t esz = kPageElemBytes;
  w.q_elems = plan.shape.out_floats();  // (a query row has as many elements as an output row)
  const size_t kv_row = size_t{L.kv_heads} * L.head_dim * esz;
  for (const StepSequence& s : plan.sequences) {
    for (const StepAppend& a : s.appends) {
      w.append_rows = std::max(w.append_rows, a.src_row + a.count);
      w.append_ops += a.count;
    }
  }
  int32_t total_pages = 0;
  {
    absl::MutexLock l(&mu_);
    for (size_t i = 0; i < plan.sequences.size(); ++i) {
      DevSeq& d = *w.dseq[i];
      w.num_writes += 2 * (d.idx.size() - d.synced);
      for (size_t k = 0; k < d.idx.size(); ++k) {
        if (d.needs_zero[k]) {
          w.zero_pages.push_back(d.page[k]);
          d.needs_zero[k] = 0;
        }
      }
      const StepSequence& s = plan.sequences[i];
      if (s.rows == 0) continue;
      GpuStep::KSeq ks{i, {}, 0};
      for (const BlockRange& rg : s.ranges) {
        // Every block of the range is resident: one run of the table.
        const size_t k0 = d.Find(rg.begin), k1 = k0 + rg.size();
        if (!ks.runs.empty() && ks.runs.back().second == k0) {
          ks.runs.back().second = k1;
        } else {
          ks.runs.emplace_back(k0, k1);
        }
        ks.tokens += static_cast<int32_t>((rg.size() - 1) * L.block_tokens + s.BlockTokens(rg.end - 1, L.block_tokens));
        total_pages += static_cast<int32_t>(rg.size());
      }
      w.num_segments += ks.runs.size();
      w.kseqs.push_back(std::move(ks));
    }
  }
  w.direct = w.kseqs.size() == 1 && w.kseqs[0].runs.size() == 1;
  w.in_place = w.dx != nullptr;
  for (const GpuStep::KSeq& ks : w.kseqs) {
    w.in_place &= plan.sequences[ks.plan_i].src_row == plan.sequences[ks.plan_i].row_begin;
  }
  // The sections: queries (in the KV dtype), appended K/V, positions, the
  // batch's CSR arrays, append ops, table writes, gather segments.
  Blob blob;
  GpuStep::Sections& off = w.off;
  off.q = blob.Add(w.in_place ? 0 : w.q_elems * esz);
  off.k = blob.Add(w.dx != nullptr ? 0 : size_t{w.append_rows} * kv_row);
  off.v = blob.Add(w.dx != nullptr ? 0 : size_t{w.append_rows} * kv_row);
  off.pos = blob.Add(size_t{plan.shape.num_rows} * 4);
  off.rows = blob.Add((w.kseqs.size() + 1) * 4);
  off.pages = blob.Add((w.kseqs.size() + 1) * 4);
  off.tokens = blob.Add(w.kseqs.size() * 4);
  off.appends = blob.Add(size_t{w.append_ops} * sizeof(cuda::KvAppendOp));
  off.writes = blob.Add(w.num_writes * sizeof(cuda::TableWriteOp));
  off.segs = blob.Add(w.num_segments * sizeof(cuda::TableSegment));
  w.blob_bytes = blob.size();
  w.out_o = AlignUp(w.q_elems * 4);
  w.out_bytes = w.out_o + AlignUp(plan.shape.lse_floats() * 4);
  w.ids_bytes = AlignUp(size_t(total_pages) * 4);
  w.listed_pages = total_pages;
  Lane* lane = w.lane;
  for (auto [buf, n, what] :
       {std::tuple{&lane->h_in, w.blob_bytes, "pinned staging"},
        std::tuple{&lane->d_in, w.blob_bytes, "device staging"}, std::tuple{&lane->h_out, w.out_bytes, "pinned output"},
        std::tuple{&lane->d_out, w.out_bytes, "device output"},
        std::tuple{&lane->d_tables, 2 * w.ids_bytes, "batch page tables"}}) {
    KVRING_RETURN_IF_ERROR(Check(buf->Reserve(n), what));
  }
  uint8_t* h = lane->h_in.p;
  if (w.dx == nullptr) ConvertQueries(plan.queries.data(), plan.shape.q_dtype, w.q_elems, L.dtype, h + off.q);
  if (w.dx == nullptr && w.append_rows > 0) {
    std::memcpy(h + off.k, plan.new_k.data(), size_t{w.append_rows} * kv_row);
    std::memcpy(h + off.v, plan.new_v.data(), size_t{w.append_rows} * kv_row);
  }
  int32_t* pos = reinterpret_cast<int32_t*>(h + off.pos);
  for (uint32_t r = 0; r < plan.shape.num_rows; ++r) pos[r] = static_cast<int32_t>(plan.positions[r]);
  PackTables(w);
  return absl::OkStatus();
}

void CudaAttentionBackend::PackTables(GpuStep& w) {
  const StepPlan& plan = w.plan;
  uint8_t* h = w.lane->h_in.p;
  int32_t* row_begin = reinterpret_cast<int32_t*>(h + w.off.rows);
  int32_t* page_begin = reinterpret_cast<int32_t*>(h + w.off.pages);
  int32_t* seq_tokens = reinterpret_cast<int32_t*>(h + w.off.tokens);
  auto* appends = reinterpret_cast<cuda::KvAppendOp*>(h + w.off.appends);
  auto* writes = reinterpret_cast<cuda::TableWriteOp*>(h + w.off.writes);
  auto* segs = reinterpret_cast<cuda::TableSegment*>(h + w.off.segs);
  absl::MutexLock l(&mu_);
  size_t nw = 0, na = 0, ns = 0;
  for (size_t i = 0; i < plan.sequences.size(); ++i) {
    const DevSeq& d = *w.dseq[i];
    for (size_t k = d.synced; k < d.idx.size(); ++k) {
      writes[nw++] = cuda::TableWriteOp{d.d_ids + k, d.page[k], 0};
      writes[nw++] = cuda::TableWriteOp{d.d_pos + k, static_cast<int32_t>(d.idx[k] * d.block_tokens), 0};
    }
    for (const StepAppend& a : plan.sequences[i].appends) {
      const int32_t page = d.page[d.Find(a.index)];
      for (uint32_t t = 0; t < a.count; ++t) {
        appends[na++] =
            cuda::KvAppendOp{page, static_cast<int32_t>(a.offset + t), static_cast<int32_t>(a.src_row + t), 0};
      }
    }
  }
  int32_t rb = 0, pb = 0;
  for (size_t j = 0; j < w.kseqs.size(); ++j) {
    const GpuStep::KSeq& ks = w.kseqs[j];
    const DevSeq& d = *w.dseq[ks.plan_i];
    row_begin[j] = rb;
    page_begin[j] = pb;
    seq_tokens[j] = ks.tokens;
    rb += static_cast<int32_t>(plan.sequences[ks.plan_i].rows);
    int32_t np = 0;
    for (const auto& [k0, k1] : ks.runs) {
      segs[ns++] = cuda::TableSegment{d.d_ids + k0, d.d_pos + k0, static_cast<int32_t>(k1 - k0), pb + np};
      w.max_count = std::max<int>(w.max_count, static_cast<int>(k1 - k0));
      np += static_cast<int32_t>(k1 - k0);
    }
    pb += np;
    w.max_pages = std::max<int>(w.max_pages, np);
  }
  row_begin[w.kseqs.size()] = rb;
  page_begin[w.kseqs.size()] = pb;
  if (w.direct) {
    w.direct_ids = segs[0].ids;
    w.direct_pos = segs[0].pos;
  }
}

cuda::PagedKvView CudaAttentionBackend::KvViewOf(const GpuStep& w) const {
  cuda::PagedKvView kv;
  kv.pool = pool_base_;
  kv.page_stride = o_.page_bytes;
  kv.block_tokens = static_cast<int32_t>(w.L.block_tokens);
  kv.layers = static_cast<int32_t>(w.L.layers);
  kv.kv_heads = static_cast<int32_t>(w.L.kv_heads);
  kv.head_dim = static_cast<int32_t>(w.L.head_dim);
  kv.dtype = w.L.dtype == DType::kBF16 ? cuda::KvType::kBF16 : cuda::KvType::kF16;
  kv.layer = static_cast<int32_t>(w.plan.shape.options.layer);
  return kv;
}

absl::Status CudaAttentionBackend::EnqueueInputs(GpuStep& w) {
  const cudaStream_t st = w.st;
  const AttendDeviceIo* dx = w.dx;
  uint8_t* dv = w.lane->d_in.p;
  if (dx != nullptr && dx->inputs_ready != nullptr) {
    // The caller did not wait for its inputs: this stream does (before the
    // step's clock starts).
    KVRING_RETURN_IF_ERROR(Check(cudaStreamWaitEvent(st, static_cast<cudaEvent_t>(dx->inputs_ready), 0),
                                 "waiting for the caller's inputs"));
  }
  for (cudaEvent_t e : w.after) {
    KVRING_RETURN_IF_ERROR(Check(cudaStreamWaitEvent(st, e, 0), "ordering after a step still on the device"));
  }
  KVRING_RETURN_IF_ERROR(Check(cudaEventRecord(w.lane->start, st), "event"));
  w.lane->attended = false;  // (until EnqueueAttention records the kernel's events)
  for (const GpuStep::Missing& m : w.missing) {
    KVRING_RETURN_IF_ERROR(Check(cudaMemcpyAsync(PageAddress(m.page), m.host.payload().data(), m.host.payload().size(),
                                                 cudaMemcpyHostToDevice, st),
                                 "promotion of a block into HBM"));
  }
  for (int32_t page : w.zero_pages) {
    KVRING_RETURN_IF_ERROR(Check(cudaMemsetAsync(PageAddress(page), 0, o_.page_bytes, st), "clearing an open page"));
  }
  KVRING_RETURN_IF_ERROR(Check(cudaMemcpyAsync(dv, w.lane->h_in.p, w.blob_bytes, cudaMemcpyHostToDevice, st),
                               "copy of the step to the device"));
  const size_t q_row_bytes = w.plan.shape.row_elems() * kPageElemBytes;
  if (dx != nullptr && !w.in_place) {
    // The plan's query rows, gathered from the batch's (same dtype: DeviceIoRefusal).
    for (const GpuStep::KSeq& ks : w.kseqs) {
      const StepSequence& ss = w.plan.sequences[ks.plan_i];
      KVRING_RETURN_IF_ERROR(Check(cudaMemcpyAsync(dv + w.off.q + size_t{ss.row_begin} * q_row_bytes,
                                                   dx->queries + size_t{ss.src_row} * q_row_bytes,
                                                   size_t{ss.rows} * q_row_bytes, cudaMemcpyDeviceToDevice, st),
                                   "gathering the queries from the caller's GPU memory"));
    }
  }
  if (w.append_ops == 0 && w.num_writes == 0) return absl::OkStatus();
  return Check(cuda::ApplyKvUpdates(KvViewOf(w), reinterpret_cast<const cuda::KvAppendOp*>(dv + w.off.appends),
                                    static_cast<int>(w.append_ops), dx != nullptr ? dx->new_k : dv + w.off.k,
                                    dx != nullptr ? dx->new_v : dv + w.off.v,
                                    reinterpret_cast<const cuda::TableWriteOp*>(dv + w.off.writes),
                                    static_cast<int>(w.num_writes), st),
               "appending K/V into HBM pages");
}

absl::Status CudaAttentionBackend::EnqueueAttention(GpuStep& w) {
  if (w.kseqs.empty()) return absl::OkStatus();  // appends only
  const StepPlan& plan = w.plan;
  const cudaStream_t st = w.st;
  const AttendDeviceIo* dx = w.dx;
  Lane* lane = w.lane;
  const uint8_t* dv = lane->d_in.p;
  cuda::PagedKvView kv = KvViewOf(w);
  kv.encoding = plan.encoding;
  kv.num_seqs = static_cast<int32_t>(w.kseqs.size());
  kv.seq_page_begin = reinterpret_cast<const int32_t*>(dv + w.off.pages);
  kv.seq_tokens = reinterpret_cast<const int32_t*>(dv + w.off.tokens);
  if (w.direct) {
    // One sequence served from one run of its own table: no gather.
    kv.page_ids = w.direct_ids;
    kv.page_pos = w.direct_pos;
  } else {
    int32_t* ids = reinterpret_cast<int32_t*>(lane->d_tables.p);
    int32_t* tpos = reinterpret_cast<int32_t*>(lane->d_tables.p + w.ids_bytes);
    KVRING_RETURN_IF_ERROR(Check(cuda::GatherPageTables(reinterpret_cast<const cuda::TableSegment*>(dv + w.off.segs),
                                                        static_cast<int>(w.num_segments), w.max_count, ids, tpos, st),
                                 "gathering the batch's page tables"));
    kv.page_ids = ids;
    kv.page_pos = tpos;
  }
  float* d_o = w.in_place ? dx->out : reinterpret_cast<float*>(lane->d_out.p);
  float* d_l = w.in_place ? dx->lse : reinterpret_cast<float*>(lane->d_out.p + w.out_o);
  cuda::QueryView qv;
  qv.q = w.in_place ? dx->queries : dv + w.off.q;
  qv.positions = reinterpret_cast<const int32_t*>(dv + w.off.pos);
  qv.seq_row_begin = reinterpret_cast<const int32_t*>(dv + w.off.rows);
  qv.num_rows = static_cast<int32_t>(plan.shape.num_rows);
  qv.q_heads = static_cast<int32_t>(plan.shape.q_heads);
  qv.max_rows_per_seq = static_cast<int32_t>(w.max_rows);
  cuda::AttnParams p;
  p.softmax_scale = plan.shape.options.softmax_scale;
  p.causal = plan.shape.options.causal;
  p.window = static_cast<int32_t>(std::min<int64_t>(plan.shape.options.window, INT32_MAX));
  if (const char* why = cuda::CheckViews(qv, kv); why != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("attention on the GPU: ", why));
  }
  KVRING_RETURN_IF_ERROR(Check(cudaEventRecord(lane->kernel_begin, st), "event"));
  lane->attended = true;
  if (w.decode) {
    KVRING_RETURN_IF_ERROR(LaunchDecode(w, p, qv, kv, cuda::OutputView{d_o, d_l}));
  } else {
    KVRING_RETURN_IF_ERROR(LaunchPrefill(w, p, qv, kv, cuda::OutputView{d_o, d_l}));
  }
  KVRING_RETURN_IF_ERROR(Check(cudaEventRecord(lane->kernel_end, st), "event"));
  if (dx == nullptr) {
    return Check(cudaMemcpyAsync(lane->h_out.p, lane->d_out.p, w.out_bytes, cudaMemcpyDeviceToHost, st),
                 "copy of O and LSE");
  }
  if (w.in_place) return absl::OkStatus();
  // Each sequence's rows to its place in the caller's output.
  const size_t q_row = plan.shape.row_elems();
  for (const GpuStep::KSeq& ks : w.kseqs) {
    const StepSequence& ss = plan.sequences[ks.plan_i];
    KVRING_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(dx->out + size_t{ss.src_row} * q_row, d_o + size_t{ss.row_begin} * q_row,
                              size_t{ss.rows} * q_row * 4, cudaMemcpyDeviceToDevice, st),
              "copy of O into the caller's GPU memory"));
    KVRING_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(dx->lse + size_t{ss.src_row} * plan.shape.q_heads,
                              d_l + size_t{ss.row_begin} * plan.shape.q_heads, size_t{ss.rows} * plan.shape.q_heads * 4,
                              cudaMemcpyDeviceToDevice, st),
              "copy of LSE into the caller's GPU memory"));
  }
  return absl::OkStatus();
}

// Quantized pages are prefilled through the 16-bit kernels over a
// dequantized copy of the step's pages (wgmma on sm_90: ~3x the kernel that
// reads the codes, bench/RESULTS.md) where that copy fits the lane's cap;
// longer steps, or a copy that cannot be allocated, run the kernel over the
// codes.
constexpr size_t kMaxDequantizedPrefillBytes = size_t{512} << 20;  // a lane's: 128K tokens of Llama-3-8B heads

absl::Status CudaAttentionBackend::LaunchPrefill(GpuStep& w, const cuda::AttnParams& p, const cuda::QueryView& qv,
                                                 const cuda::PagedKvView& kv, cuda::OutputView out) {
  Buffer& scratch = w.lane->d_dequantized;
  const size_t need = cuda::DequantizedPrefillWorkspaceBytes(kv, w.listed_pages);
  if (need > 0 && need <= kMaxDequantizedPrefillBytes) {
    if (scratch.Reserve(need) == cudaSuccess) {
      return Check(cuda::PagedPrefillDequantized(p, qv, kv, w.listed_pages, scratch.p, scratch.cap, out, w.st),
                   "prefill attention kernel (dequantized pages)");
    }
    (void)cudaGetLastError();  // no memory for the copy: the kernel over the codes serves the step
  }
  return Check(cuda::PagedPrefill(p, qv, kv, out, w.st), "prefill attention kernel");
}

absl::Status CudaAttentionBackend::LaunchDecode(GpuStep& w, const cuda::AttnParams& p, const cuda::QueryView& qv,
                                                const cuda::PagedKvView& kv, cuda::OutputView out) {
  Lane* lane = w.lane;
  const int splits = cuda::DefaultDecodeSplits(qv, kv, w.max_pages, sm_count_);
  const size_t ws = cuda::DecodeWorkspaceBytes(qv, splits, kv.head_dim);
  const size_t counters = cuda::DecodeCounterBytes(qv);
  if (ws > lane->d_workspace.cap) {
    // A new workspace starts zeroed (the merge's counters).
    KVRING_RETURN_IF_ERROR(Check(lane->d_workspace.Reserve(ws), "decode workspace"));
    KVRING_RETURN_IF_ERROR(
        Check(cudaMemsetAsync(lane->d_workspace.p, 0, lane->d_workspace.cap, w.st), "decode workspace"));
    lane->counters_clean = lane->d_workspace.cap;
  }
  if (splits > 1 && lane->counters_clean < counters) {
    // More rows than the last call: its partials lie where these counters go.
    KVRING_RETURN_IF_ERROR(Check(cudaMemsetAsync(lane->d_workspace.p, 0, counters, w.st), "decode workspace counters"));
    lane->counters_clean = counters;
  }
  KVRING_RETURN_IF_ERROR(
      Check(cuda::PagedDecode(p, qv, kv, out, splits, lane->d_workspace.p, lane->d_workspace.cap, w.st),
            "decode attention kernel"));
  // The call leaves its counters zero and writes partials after them.
  if (splits > 1) lane->counters_clean = std::min(lane->counters_clean, counters);
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaAttentionBackend::HandOff(GpuStep& w, StepTimes* times) {
  Lane* lane = w.lane;
  // The caller's word when it gave one (its stream waits on the device for
  // the word, no event), else the next of the lane's interprocess events.
  bool by_flag = w.dx->done_flag != nullptr && stream_words_ok_.load() && StreamWordsAvailable();
  if (by_flag) {
    if (absl::Status f = StreamWordWrite(w.st, w.dx->done_flag, w.dx->done_flag_value); !f.ok()) {
      if (stream_words_ok_.exchange(false)) {
        KVRING_LOG(WARNING) << "cannot set a caller's done flag on the device (" << f.message()
                            << "): steps answer with an event, or once their work is done";
      }
      by_flag = false;
    }
  }
  if (!by_flag && lane->done_ipc[0] == nullptr) return false;
  const int k = by_flag ? -1 : lane->next_done++ % Lane::kDoneEvents;
  if (!by_flag) KVRING_RETURN_IF_ERROR(Check(cudaEventRecord(lane->done_ipc[k], w.st), "event"));
  Lane::InFlight f;
  f.seqs = w.dseq;
  f.keepalive = w.dx->keepalive;
  for (GpuStep::Missing& m : w.missing) {
    f.keyed.emplace_back(m.key, m.page);
    f.sources.push_back(std::move(m.host));
  }
  {
    absl::MutexLock l(&mu_);
    for (DevSeq* d : w.dseq) {
      d->synced = d->idx.size();  // (the table writes are queued before any later step's)
      d->flying = lane;
    }
  }
  lane->in_flight = std::move(f);
  if (by_flag) {
    times->done_flag = true;
  } else {
    times->done_event = lane->done_ipc_handle[k];
  }
  times->kernel_seconds = last_kernel_seconds_.load();
  times->copy_seconds = last_copy_seconds_.load();
  return true;
}

void CudaAttentionBackend::Finish(GpuStep& w, PartialOutput out, StepTimes* times) {
  Lane* lane = w.lane;
  if (w.dx == nullptr && !w.kseqs.empty()) {
    std::memcpy(out.out, lane->h_out.p, w.q_elems * 4);
    std::memcpy(out.lse, lane->h_out.p + w.out_o, w.plan.shape.lse_floats() * 4);
  }
  if (times != nullptr) lane->Elapsed(&times->kernel_seconds, &times->copy_seconds);
  absl::MutexLock l(&mu_);
  for (DevSeq* d : w.dseq) {
    d->synced = d->idx.size();
    --d->busy;
  }
  for (const GpuStep::Missing& m : w.missing) KeyPageLocked(m.key, m.page);  // their bytes landed
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaAttentionBackend(const CudaBackendOptions& options,
                                                                           BlockStore* store, ThreadPool* cpu_pool) {
  auto b = std::make_unique<CudaAttentionBackend>(options, store, cpu_pool);
  KVRING_RETURN_IF_ERROR(b->Init());
  return std::unique_ptr<AttentionBackend>(std::move(b));
}

absl::Status CudaRegisterHostMemory(void* p, size_t n) {
  return CudaStatus(cudaHostRegister(p, n, cudaHostRegisterDefault), "cudaHostRegister of the host tier");
}

void CudaUnregisterHostMemory(void* p) { (void)cudaHostUnregister(p); }

}  // namespace kvring
