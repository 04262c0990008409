// One rank of the multi-GPU ring benchmark (bench/gpu/multi_gpu.sh starts
// one process per GPU): a sequence of --tokens tokens spread over the ring
// in the load-balanced causal layout (2N chunks; rank i holds chunks i and
// 2N-1-i), attended through NCCL with GpuRingPassKv or GpuRingPassQ:
//   --mode=prefill  every rank's queries are its own tokens (causal prefill);
//   --mode=decode   one query row at position --tokens on rank 0 (pass-Q).
// Checks the ring's output against this GPU attending over the whole
// sequence (AttendLocal, same inputs; KV and queries are generated from
// their positions, so every rank can build the whole sequence), then times
// --reps calls. Prints one JSON line per rank.
//
//   ring_bench --rank=R --world=N --id_file=/tmp/id [--tokens=131072] [--q_heads=32] [--kv_heads=8]
//              [--mode=prefill|decode] [--algo=passkv|passq] [--reps=5]
#include <cuda_bf16.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvring/attention/ring/gpu_ring.h"
#include "kvring/transport/nccl_transport.h"

using namespace kvring;

namespace {

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

// Deterministic values in [-1, 1) from (a, b): the same on every rank.
__host__ __device__ inline float Hash01(uint64_t a, uint64_t b) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull + b * 0xBF58476D1CE4E5B9ull + 0x94D049BB133111EBull;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<float>(x >> 40) / static_cast<float>(1ull << 23) - 1.0f;
}

// Pages [n][K|V][kv_head][bt][D] (one layer) for the blocks `blocks[i]`.
__global__ void FillPages(__nv_bfloat16* pool, const int32_t* blocks, int n, int kv_heads, int bt, int D) {
  const uint64_t per = 2ull * kv_heads * bt * D;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n * per;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const uint64_t page = i / per, e = i % per;
    pool[i] = __float2bfloat16(Hash01(blocks[page], e));
  }
}

// Queries [rows][q_heads][D] for the given positions.
__global__ void FillQueries(__nv_bfloat16* q, const int32_t* pos, int rows, int qd) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (uint64_t)rows * qd;
       i += (uint64_t)gridDim.x * blockDim.x) {
    q[i] = __float2bfloat16(Hash01(1ull << 40 | pos[i / qd], i % qd));
  }
}

struct Args {
  int rank = 0, world = 1, q_heads = 32, kv_heads = 8, head_dim = 128, reps = 5;
  int64_t tokens = 131072;
  std::string id_file = "/tmp/kvring_nccl_id", mode = "prefill", algo = "passkv";
};

bool Parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto val = [&](const char* name, std::string* out) {
      const std::string p = std::string("--") + name + "=";
      if (s.rfind(p, 0) != 0) return false;
      *out = s.substr(p.size());
      return true;
    };
    std::string v;
    if (s == "--help") return false;
    if (val("rank", &v))
      a->rank = std::stoi(v);
    else if (val("world", &v))
      a->world = std::stoi(v);
    else if (val("tokens", &v))
      a->tokens = std::stoll(v);
    else if (val("q_heads", &v))
      a->q_heads = std::stoi(v);
    else if (val("kv_heads", &v))
      a->kv_heads = std::stoi(v);
    else if (val("reps", &v))
      a->reps = std::stoi(v);
    else if (val("id_file", &v))
      a->id_file = v;
    else if (val("mode", &v))
      a->mode = v;
    else if (val("algo", &v))
      a->algo = v;
    else {
      std::fprintf(stderr, "unknown argument %s\n", s.c_str());
      return false;
    }
  }
  return true;
}

std::string ShareId(const Args& a) {
  if (a.rank == 0) {
    auto id = NcclTransport::NewUniqueId();
    if (!id.ok()) {
      std::fprintf(stderr, "%s\n", id.status().ToString().c_str());
      std::exit(1);
    }
    const std::string tmp = a.id_file + ".tmp";
    std::ofstream(tmp, std::ios::binary) << *id;
    std::filesystem::rename(tmp, a.id_file);
    return *id;
  }
  for (int i = 0; i < 600; ++i) {
    std::ifstream in(a.id_file, std::ios::binary);
    if (in) {
      std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (s.size() == 128) return s;  // sizeof(ncclUniqueId)
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::fprintf(stderr, "rank %d: no NCCL id in %s\n", a.rank, a.id_file.c_str());
  std::exit(1);
}

template <typename T>
T* DevCopy(const std::vector<T>& h) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(1, h.size()) * sizeof(T)));
  if (!h.empty()) CK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!Parse(argc, argv, &a)) {
    std::printf(
        "usage: ring_bench --rank=R --world=N --id_file=F [--tokens=L] [--q_heads=H] [--kv_heads=K] "
        "[--mode=prefill|decode] [--algo=passkv|passq] [--reps=N]\n");
    return 2;
  }
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  const int dev = a.rank % ndev;
  CK(cudaSetDevice(dev));
  const int bt = 16, D = a.head_dim, N = a.world;
  const int64_t nblocks = a.tokens / bt;
  if (nblocks % (2 * N) != 0) {
    std::fprintf(stderr, "tokens/16 must be a multiple of 2 x world\n");
    return 2;
  }
  const int64_t chunk = nblocks / (2 * N);
  // This rank's blocks (chunks rank and 2N-1-rank), in position order.
  std::vector<int32_t> mine, mine_pos;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t c = b / chunk;
    if (c == a.rank || c == 2 * N - 1 - a.rank) {
      mine.push_back(static_cast<int32_t>(b));
      mine_pos.push_back(static_cast<int32_t>(b * bt));
    }
  }
  std::vector<int32_t> all(nblocks), all_pos(nblocks);
  for (int64_t b = 0; b < nblocks; ++b) {
    all[b] = static_cast<int32_t>(b);
    all_pos[b] = static_cast<int32_t>(b * bt);
  }
  // Queries.
  std::vector<int32_t> qpos;
  if (a.mode == "prefill") {
    for (int32_t p : mine_pos)
      for (int t = 0; t < bt; ++t) qpos.push_back(p + t);
  } else if (a.rank == 0) {
    qpos.push_back(static_cast<int32_t>(a.tokens));  // the next token: sees every key
  }
  const int rows = static_cast<int>(qpos.size()), qd = a.q_heads * D;
  const size_t page_elems = 2ull * a.kv_heads * bt * D;
  __nv_bfloat16 *pool = nullptr, *whole = nullptr, *q = nullptr;
  CK(cudaMalloc(&pool, std::max<size_t>(1, mine.size()) * page_elems * 2));
  CK(cudaMalloc(&whole, nblocks * page_elems * 2));
  CK(cudaMalloc(&q, std::max(1, rows) * (size_t)qd * 2));
  int32_t* d_mine = DevCopy(mine);
  int32_t* d_all = DevCopy(all);
  int32_t* d_qpos = DevCopy(qpos);
  FillPages<<<1024, 256>>>(pool, d_mine, static_cast<int>(mine.size()), a.kv_heads, bt, D);
  FillPages<<<1024, 256>>>(whole, d_all, static_cast<int>(nblocks), a.kv_heads, bt, D);
  if (rows) FillQueries<<<1024, 256>>>(q, d_qpos, rows, qd);
  CK(cudaDeviceSynchronize());
  // Views: the ring's pool holds this rank's pages at ids 0..n-1.
  std::vector<int32_t> local_ids(mine.size());
  for (size_t i = 0; i < mine.size(); ++i) local_ids[i] = static_cast<int32_t>(i);
  int32_t* d_local_ids = DevCopy(local_ids);
  int32_t* d_mine_pos = DevCopy(mine_pos);
  int32_t* d_all_pos = DevCopy(all_pos);
  int32_t* d_begin_mine = DevCopy(std::vector<int32_t>{0, static_cast<int32_t>(mine.size())});
  int32_t* d_tok_mine = DevCopy(std::vector<int32_t>{static_cast<int32_t>(mine.size() * bt)});
  int32_t* d_begin_all = DevCopy(std::vector<int32_t>{0, static_cast<int32_t>(nblocks)});
  int32_t* d_tok_all = DevCopy(std::vector<int32_t>{static_cast<int32_t>(nblocks * bt)});
  int32_t* d_rows = DevCopy(std::vector<int32_t>{0, rows});
  cuda::PagedKvView kv;
  kv.pool = pool;
  kv.page_stride = page_elems * 2;
  kv.block_tokens = bt;
  kv.layers = 1;
  kv.kv_heads = a.kv_heads;
  kv.head_dim = D;
  kv.page_ids = d_local_ids;
  kv.page_pos = d_mine_pos;
  kv.seq_page_begin = d_begin_mine;
  kv.seq_tokens = d_tok_mine;
  kv.num_seqs = 1;
  cuda::PagedKvView kv_all = kv;
  kv_all.pool = whole;
  kv_all.page_ids = d_all;
  kv_all.page_pos = d_all_pos;
  kv_all.seq_page_begin = d_begin_all;
  kv_all.seq_tokens = d_tok_all;
  cuda::QueryView qv;
  qv.q = q;
  qv.positions = d_qpos;
  qv.seq_row_begin = d_rows;
  qv.num_rows = rows;
  qv.q_heads = a.q_heads;
  qv.max_rows_per_seq = std::max(1, rows);
  float *out = nullptr, *lse = nullptr, *ref_out = nullptr, *ref_lse = nullptr;
  const size_t on = std::max(1, rows) * (size_t)qd;
  CK(cudaMalloc(&out, on * 4));
  CK(cudaMalloc(&lse, on / D * 4));
  CK(cudaMalloc(&ref_out, on * 4));
  CK(cudaMalloc(&ref_lse, on / D * 4));
  // Reference on this GPU, over the whole sequence.
  double single_ms = 0;
  if (rows) {
    absl::Status s = cuda::AttendLocal({}, qv, kv_all, {ref_out, ref_lse}, static_cast<int>(nblocks), nullptr);
    if (!s.ok()) {
      std::fprintf(stderr, "reference: %s\n", s.ToString().c_str());
      return 1;
    }
    CK(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < a.reps; ++i)
      (void)cuda::AttendLocal({}, qv, kv_all, {ref_out, ref_lse}, static_cast<int>(nblocks), nullptr);
    CK(cudaDeviceSynchronize());
    single_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / a.reps;
  }
  CK(cudaFree(whole));
  const std::string id = ShareId(a);
  auto t = NcclTransport::Create(a.rank, N, id, dev);
  if (!t.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", a.rank, t.status().ToString().c_str());
    return 1;
  }
  auto ring = [&](cuda::GpuRingStats* st) {
    cuda::GpuRingOptions o;
    return a.algo == "passq" ? cuda::GpuRingPassQ(**t, {}, qv, kv, {out, lse}, o, st)
                             : cuda::GpuRingPassKv(**t, {}, qv, kv, {out, lse}, o, st);
  };
  if (absl::Status s = ring(nullptr); !s.ok()) {
    std::fprintf(stderr, "rank %d ring: %s\n", a.rank, s.ToString().c_str());
    return 1;
  }
  CK(cudaDeviceSynchronize());
  double err = 0;
  if (rows) {
    std::vector<float> ho(on), hr(on);
    CK(cudaMemcpy(ho.data(), out, on * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hr.data(), ref_out, on * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (size_t i = 0; i < on; ++i) {
      num += (double(ho[i]) - hr[i]) * (double(ho[i]) - hr[i]);
      den += double(hr[i]) * hr[i];
    }
    err = std::sqrt(num / std::max(den, 1e-30));
  }
  std::vector<double> times;
  cuda::GpuRingStats sum;
  for (int i = 0; i < a.reps; ++i) {
    cuda::GpuRingStats st;
    if (absl::Status s = ring(&st); !s.ok()) {
      std::fprintf(stderr, "rank %d ring: %s\n", a.rank, s.ToString().c_str());
      return 1;
    }
    times.push_back(st.total_ms);
    sum.compute_ms += st.compute_ms / a.reps;
    sum.wait_ms += st.wait_ms / a.reps;
    sum.bytes_sent = st.bytes_sent;
  }
  std::sort(times.begin(), times.end());
  std::printf(
      "{\"rank\": %d, \"world\": %d, \"mode\": \"%s\", \"algo\": \"%s\", \"tokens\": %lld, \"q_heads\": %d, "
      "\"kv_heads\": %d, \"rows\": %d, \"ring_ms\": %.4f, \"compute_ms\": %.4f, \"exposed_comm_ms\": %.4f, "
      "\"bytes_sent\": %llu, \"single_gpu_ms\": %.4f, \"rel_err\": %.3e}\n",
      a.rank, N, a.mode.c_str(), a.algo.c_str(), static_cast<long long>(a.tokens), a.q_heads, a.kv_heads, rows,
      times[times.size() / 2], sum.compute_ms, sum.wait_ms, static_cast<unsigned long long>(sum.bytes_sent), single_ms,
      err);
  return err < 2e-2 ? 0 : 3;
}
