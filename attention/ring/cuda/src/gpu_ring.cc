#include "kvring/attention/ring/gpu_ring.h"

#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvring/common/cuda_status.h"

namespace kvring::cuda {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status Cuda(cudaError_t e, const char* what) { return CudaStatus(e, what); }
#define KVRING_CUDA_OK(expr, what)                                 \
  do {                                                             \
    if (absl::Status s_ = Cuda((expr), what); !s_.ok()) return s_; \
  } while (0)
#define KVRING_OK(expr)                                \
  do {                                                 \
    if (absl::Status s_ = (expr); !s_.ok()) return s_; \
  } while (0)

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n > 0 && cudaMalloc(&p_, n) != cudaSuccess) p_ = nullptr;
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  bool ok() const { return n_ == 0 || p_ != nullptr; }
  template <typename T = uint8_t>
  T* get() const {
    return static_cast<T*>(p_);
  }
  size_t size() const { return n_; }
  absl::Span<uint8_t> span() const { return {static_cast<uint8_t*>(p_), n_}; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

double Ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

// All ranks' 4-int records (device transport: staged through device memory).
absl::StatusOr<std::vector<std::array<int32_t, 4>>> AllGather(Transport& t, std::array<int32_t, 4> mine,
                                                              absl::Duration timeout) {
  const int n = t.size(), me = t.rank();
  DeviceBuffer d(sizeof(int32_t) * 4 * n);
  if (!d.ok()) return absl::ResourceExhaustedError("cudaMalloc");
  KVRING_CUDA_OK(cudaMemcpy(d.get<int32_t>() + 4 * me, mine.data(), 16, cudaMemcpyHostToDevice), "copy");
  std::vector<std::unique_ptr<TransportRequest>> reqs;
  for (int k = 1; k < n; ++k) {  // same order on every rank: by distance
    const int to = (me + k) % n, from = (me - k + n) % n;
    auto r = t.Irecv(from, 1, absl::MakeSpan(d.get() + 16 * from, 16));
    if (!r.ok()) return r.status();
    reqs.push_back(std::move(*r));
    auto s = t.Isend(to, 1, absl::MakeConstSpan(d.get() + 16 * me, 16));
    if (!s.ok()) return s.status();
    reqs.push_back(std::move(*s));
  }
  KVRING_OK(t.Flush());
  for (auto& r : reqs) {
    if (auto s = r->Wait(timeout); !s.ok()) return s.status();
  }
  std::vector<std::array<int32_t, 4>> all(n);
  KVRING_CUDA_OK(cudaMemcpy(all.data(), d.get(), 16 * n, cudaMemcpyDeviceToHost), "copy");
  return all;
}

// Times kernel work on a stream.
class KernelTimer {
 public:
  explicit KernelTimer(cudaStream_t s) : s_(s) {
    cudaEventCreate(&a_);
    cudaEventCreate(&b_);
  }
  ~KernelTimer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  void Start() { cudaEventRecord(a_, s_); }
  void Stop() { cudaEventRecord(b_, s_); }
  double ElapsedMs() {
    cudaEventSynchronize(b_);
    float ms = 0;
    cudaEventElapsedTime(&ms, a_, b_);
    return ms;
  }

 private:
  cudaStream_t s_;
  cudaEvent_t a_, b_;
};

}  // namespace

absl::Status AttendLocal(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int max_pages,
                         cudaStream_t stream) {
  if (q.num_rows == 0) return absl::OkStatus();
  if (const char* why = CheckViews(q, kv)) return absl::InvalidArgumentError(why);
  if (q.max_rows_per_seq <= 16) {
    int dev = 0, sms = 132;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int splits = DefaultDecodeSplits(q, kv, max_pages, sms);
    const size_t ws = DecodeWorkspaceBytes(q, splits, kv.head_dim);
    void* w = nullptr;
    if (ws) {
      KVRING_CUDA_OK(cudaMallocAsync(&w, ws, stream), "workspace");
      KVRING_CUDA_OK(cudaMemsetAsync(w, 0, ws, stream), "workspace");  // the split-merge counters start at 0
    }
    const cudaError_t e = PagedDecode(p, q, kv, out, splits, w, ws, stream);
    if (w) cudaFreeAsync(w, stream);
    return Cuda(e, "PagedDecode");
  }
  return Cuda(PagedPrefill(p, q, kv, out, stream), "PagedPrefill");
}

absl::Status GpuRingPassKv(Transport& t, const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                           const GpuRingOptions& o, GpuRingStats* stats) {
  const auto start = Clock::now();
  const int n = t.size(), me = t.rank();
  if (t.buffer_kind() != BufferKind::kDevice)
    return absl::InvalidArgumentError("GPU rings need a device-memory transport");
  int npages = 0, ntok = 0;
  KVRING_CUDA_OK(cudaMemcpy(&npages, kv.seq_page_begin + 1, 4, cudaMemcpyDeviceToHost), "copy");
  KVRING_CUDA_OK(cudaMemcpy(&ntok, kv.seq_tokens, 4, cudaMemcpyDeviceToHost), "copy");
  auto rec = AllGather(t, {q.num_rows, npages, ntok, 0}, o.timeout);
  if (!rec.ok()) return rec.status();
  const uint64_t slice = LayerSliceBytes(kv);
  int max_pages = 0;
  for (auto& r : *rec) max_pages = std::max(max_pages, r[1]);
  // Wire form of a chunk: slices, then positions, then the token count.
  auto chunk_bytes = [&](int pages) { return (uint64_t)pages * slice + 4ull * pages + 4; };
  DeviceBuffer buf[2] = {DeviceBuffer(chunk_bytes(max_pages)), DeviceBuffer(chunk_bytes(max_pages))};
  DeviceBuffer iota(4ull * std::max(1, max_pages)), meta(8ull * n),
      part_out((size_t)q.num_rows * q.q_heads * kv.head_dim * 4), part_lse((size_t)q.num_rows * q.q_heads * 4);
  if (!buf[0].ok() || !buf[1].ok() || !iota.ok() || !meta.ok() || !part_out.ok() || !part_lse.ok()) {
    return absl::ResourceExhaustedError("GPU ring: cudaMalloc failed");
  }
  cudaStream_t s = o.stream;
  KVRING_CUDA_OK(Iota(iota.get<int32_t>(), std::max(1, max_pages), s), "iota");
  std::vector<int32_t> meta_h(2 * n);
  for (int r = 0; r < n; ++r) {
    meta_h[2 * r] = 0;
    meta_h[2 * r + 1] = (*rec)[r][1];
  }
  KVRING_CUDA_OK(cudaMemcpyAsync(meta.get(), meta_h.data(), 8 * n, cudaMemcpyHostToDevice, s), "copy");
  // Pack our chunk.
  KVRING_CUDA_OK(PackLayerPages(kv, kv.page_ids, npages, buf[0].get(), s), "pack");
  KVRING_CUDA_OK(
      cudaMemcpyAsync(buf[0].get() + npages * slice, kv.page_pos, 4ull * npages, cudaMemcpyDeviceToDevice, s), "copy");
  KVRING_CUDA_OK(
      cudaMemcpyAsync(buf[0].get() + npages * slice + 4ull * npages, kv.seq_tokens, 4, cudaMemcpyDeviceToDevice, s),
      "copy");
  KVRING_CUDA_OK(cudaStreamSynchronize(s), "sync");
  KernelTimer timer(s);
  int cur = 0;
  for (int step = 0; step < n; ++step) {
    const int owner = (me - step + n) % n;
    const int opages = (*rec)[owner][1];
    std::vector<std::unique_ptr<TransportRequest>> reqs;
    if (step < n - 1) {
      const int src_owner = (me - step - 1 + 2 * n) % n;
      auto rq = t.Irecv((me - 1 + n) % n, 2, absl::MakeSpan(buf[1 - cur].get(), chunk_bytes((*rec)[src_owner][1])));
      if (!rq.ok()) return rq.status();
      auto sq = t.Isend((me + 1) % n, 2, absl::MakeConstSpan(buf[cur].get(), chunk_bytes(opages)));
      if (!sq.ok()) return sq.status();
      reqs.push_back(std::move(*rq));
      reqs.push_back(std::move(*sq));
      KVRING_OK(t.Flush());
      if (stats) stats->bytes_sent += chunk_bytes(opages);
    }
    // Attend our queries over the chunk in hand (a one-layer page pool).
    PagedKvView c = kv;
    c.pool = buf[cur].get();
    c.page_stride = slice;
    c.layers = 1;
    c.layer = 0;
    c.page_ids = iota.get<int32_t>();
    c.page_pos = reinterpret_cast<const int32_t*>(buf[cur].get() + (uint64_t)opages * slice);
    c.seq_page_begin = meta.get<int32_t>() + 2 * owner;
    c.seq_tokens = reinterpret_cast<const int32_t*>(buf[cur].get() + (uint64_t)opages * slice + 4ull * opages);
    c.num_seqs = 1;
    const auto c0 = Clock::now();
    timer.Start();
    if (opages > 0 && q.num_rows > 0) {
      OutputView dst = step == 0 ? out : OutputView{part_out.get<float>(), part_lse.get<float>()};
      KVRING_OK(AttendLocal(p, q, c, dst, opages, s));
      if (step > 0) {
        KVRING_CUDA_OK(
            MergeInto(out, part_out.get<float>(), part_lse.get<float>(), q.num_rows * q.q_heads, kv.head_dim, s),
            "merge");
      }
    } else if (step == 0 && q.num_rows > 0) {
      // Nothing local: start from "saw no key".
      std::vector<float> ninf((size_t)q.num_rows * q.q_heads, -INFINITY);
      KVRING_CUDA_OK(cudaMemsetAsync(out.out, 0, (size_t)q.num_rows * q.q_heads * kv.head_dim * 4, s), "memset");
      KVRING_CUDA_OK(cudaMemcpyAsync(out.lse, ninf.data(), ninf.size() * 4, cudaMemcpyHostToDevice, s), "copy");
    }
    timer.Stop();
    const double kms = timer.ElapsedMs();  // waits for the compute
    const auto c1 = Clock::now();
    for (auto& r : reqs) {
      if (auto st = r->Wait(o.timeout); !st.ok()) return st.status();
    }
    const auto c2 = Clock::now();
    if (stats) {
      stats->compute_ms += kms;
      stats->wait_ms += Ms(c1, c2);
      ++stats->steps;
    }
    (void)c0;
    cur = 1 - cur;
  }
  if (stats) stats->total_ms = Ms(start, Clock::now());
  return absl::OkStatus();
}

absl::Status GpuRingPassQ(Transport& t, const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                          const GpuRingOptions& o, GpuRingStats* stats) {
  const auto start = Clock::now();
  const int n = t.size(), me = t.rank();
  if (t.buffer_kind() != BufferKind::kDevice)
    return absl::InvalidArgumentError("GPU rings need a device-memory transport");
  int npages = 0;
  KVRING_CUDA_OK(cudaMemcpy(&npages, kv.seq_page_begin + 1, 4, cudaMemcpyDeviceToHost), "copy");
  auto rec = AllGather(t, {q.num_rows, npages, 0, 0}, o.timeout);
  if (!rec.ok()) return rec.status();
  const int H = q.q_heads, D = kv.head_dim;
  int max_rows = 0;
  for (auto& r : *rec) max_rows = std::max(max_rows, r[0]);
  auto qbytes = [&](int rows) { return (uint64_t)rows * H * D * 2 + 4ull * rows; };
  auto pbytes = [&](int rows) { return (uint64_t)rows * H * (D + 1) * 4; };  // out then lse
  DeviceBuffer buf[2] = {DeviceBuffer(qbytes(max_rows)), DeviceBuffer(qbytes(max_rows))};
  DeviceBuffer rowmeta(8ull * n);
  std::vector<DeviceBuffer> partial_for(n);
  for (int r = 0; r < n; ++r) partial_for[r] = DeviceBuffer(std::max<uint64_t>(4, pbytes((*rec)[r][0])));
  DeviceBuffer stacked(std::max<uint64_t>(4, (uint64_t)n * pbytes(q.num_rows)));
  if (!buf[0].ok() || !buf[1].ok() || !stacked.ok()) return absl::ResourceExhaustedError("GPU ring: cudaMalloc failed");
  cudaStream_t s = o.stream;
  std::vector<int32_t> rm(2 * n);
  for (int r = 0; r < n; ++r) {
    rm[2 * r] = 0;
    rm[2 * r + 1] = (*rec)[r][0];
  }
  KVRING_CUDA_OK(cudaMemcpyAsync(rowmeta.get(), rm.data(), 8 * n, cudaMemcpyHostToDevice, s), "copy");
  KVRING_CUDA_OK(cudaMemcpyAsync(buf[0].get(), q.q, (uint64_t)q.num_rows * H * D * 2, cudaMemcpyDeviceToDevice, s),
                 "copy");
  KVRING_CUDA_OK(cudaMemcpyAsync(buf[0].get() + (uint64_t)q.num_rows * H * D * 2, q.positions, 4ull * q.num_rows,
                                 cudaMemcpyDeviceToDevice, s),
                 "copy");
  KVRING_CUDA_OK(cudaStreamSynchronize(s), "sync");
  KernelTimer timer(s);
  int cur = 0;
  for (int step = 0; step < n; ++step) {
    const int owner = (me - step + n) % n;
    const int orows = (*rec)[owner][0];
    std::vector<std::unique_ptr<TransportRequest>> reqs;
    if (step < n - 1) {
      const int src_owner = (me - step - 1 + 2 * n) % n;
      auto rq = t.Irecv((me - 1 + n) % n, 3, absl::MakeSpan(buf[1 - cur].get(), qbytes((*rec)[src_owner][0])));
      if (!rq.ok()) return rq.status();
      auto sq = t.Isend((me + 1) % n, 3, absl::MakeConstSpan(buf[cur].get(), qbytes(orows)));
      if (!sq.ok()) return sq.status();
      reqs.push_back(std::move(*rq));
      reqs.push_back(std::move(*sq));
      KVRING_OK(t.Flush());
      if (stats) stats->bytes_sent += qbytes(orows);
    }
    QueryView vq = q;
    vq.q = buf[cur].get();
    vq.positions = reinterpret_cast<const int32_t*>(buf[cur].get() + (uint64_t)orows * H * D * 2);
    vq.seq_row_begin = rowmeta.get<int32_t>() + 2 * owner;
    vq.num_rows = orows;
    vq.max_rows_per_seq = std::max(1, orows);
    float* po = partial_for[owner].get<float>();
    OutputView dst{po, po + (uint64_t)orows * H * D};
    timer.Start();
    if (orows > 0) {
      if (npages > 0) {
        KVRING_OK(AttendLocal(p, vq, kv, dst, npages, s));
      } else {
        std::vector<float> ninf((size_t)orows * H, -INFINITY);
        KVRING_CUDA_OK(cudaMemsetAsync(dst.out, 0, (size_t)orows * H * D * 4, s), "memset");
        KVRING_CUDA_OK(cudaMemcpyAsync(dst.lse, ninf.data(), ninf.size() * 4, cudaMemcpyHostToDevice, s), "copy");
        KVRING_CUDA_OK(cudaStreamSynchronize(s), "sync");
      }
    }
    timer.Stop();
    const double kms = timer.ElapsedMs();
    const auto c1 = Clock::now();
    for (auto& r : reqs) {
      if (auto st = r->Wait(o.timeout); !st.ok()) return st.status();
    }
    if (stats) {
      stats->compute_ms += kms;
      stats->wait_ms += Ms(c1, Clock::now());
      ++stats->steps;
    }
    cur = 1 - cur;
  }
  // Partials home: stacked[k] holds the partial computed by rank k, for our rows.
  const uint64_t mine = pbytes(q.num_rows);
  // Layout of `stacked` for MergePartials: all outs, then all lses.
  const uint64_t out_bytes = (uint64_t)q.num_rows * H * D * 4, lse_bytes = (uint64_t)q.num_rows * H * 4;
  DeviceBuffer recvd(std::max<uint64_t>(4, (uint64_t)n * mine));
  std::vector<std::unique_ptr<TransportRequest>> reqs;
  const auto w0 = Clock::now();
  for (int k = 1; k < n; ++k) {
    const int to = (me + k) % n, from = (me - k + n) % n;
    auto rq = t.Irecv(from, 4, absl::MakeSpan(recvd.get() + (uint64_t)from * mine, mine));
    if (!rq.ok()) return rq.status();
    auto sq = t.Isend(to, 4, absl::MakeConstSpan(partial_for[to].get(), pbytes((*rec)[to][0])));
    if (!sq.ok()) return sq.status();
    reqs.push_back(std::move(*rq));
    reqs.push_back(std::move(*sq));
    if (stats) stats->bytes_sent += pbytes((*rec)[to][0]);
  }
  KVRING_OK(t.Flush());
  for (auto& r : reqs) {
    if (auto st = r->Wait(o.timeout); !st.ok()) return st.status();
  }
  if (stats) stats->wait_ms += Ms(w0, Clock::now());
  if (q.num_rows > 0) {
    KVRING_CUDA_OK(
        cudaMemcpyAsync(recvd.get() + (uint64_t)me * mine, partial_for[me].get(), mine, cudaMemcpyDeviceToDevice, s),
        "copy");
    for (int k = 0; k < n; ++k) {
      KVRING_CUDA_OK(cudaMemcpyAsync(stacked.get() + k * out_bytes, recvd.get() + k * mine, out_bytes,
                                     cudaMemcpyDeviceToDevice, s),
                     "copy");
      KVRING_CUDA_OK(cudaMemcpyAsync(stacked.get() + n * out_bytes + k * lse_bytes, recvd.get() + k * mine + out_bytes,
                                     lse_bytes, cudaMemcpyDeviceToDevice, s),
                     "copy");
    }
    KVRING_CUDA_OK(MergePartials(stacked.get<float>(), reinterpret_cast<const float*>(stacked.get() + n * out_bytes), n,
                                 q.num_rows * H, D, out, s),
                   "merge");
    KVRING_CUDA_OK(cudaStreamSynchronize(s), "sync");
  }
  if (stats) stats->total_ms = Ms(start, Clock::now());
  return absl::OkStatus();
}

}  // namespace kvring::cuda
