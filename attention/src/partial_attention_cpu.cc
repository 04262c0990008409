// CPU PartialAttention: tiles of one block's K and V for one kv head are
// converted to fp32 once and reused by every query head of the GQA group and
// every query row of the task; scores, an online softmax and the P*V
// accumulation run on vectorizable loops (8 independent lanes), compiled for
// AVX2+FMA and a baseline x86-64 clone chosen at run time.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvring/attention/partial_attention.h"
#include "kvring/layout/float_convert.h"
#include "kvring/layout/fp8.h"

namespace kvring {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr uint32_t kRowsPerTask = 8;

#if defined(__x86_64__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define KVRING_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVRING_MULTIVERSION
#endif
// Helpers are force-inlined so each clone of RunTask gets its own
// (AVX2 or baseline) copy of them.
#define KVRING_INLINE inline __attribute__((always_inline))

const std::array<float, 256>& Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = Fp8E4M3ToFloat(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

// exp(x) for x <= 0 (scores minus their max), ~2 ulp; 0 below -87.3; NaN
// (from a non-finite value in a stored KV block) stays NaN, without the
// undefined float-to-int conversion.
KVRING_INLINE float ExpNonPositive(float x) {
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  const float in = x;
  const bool nan = x != x;
  const bool under = x < -87.3f;
  x = (under || nan) ? -87.3f : x;
  const float z = x * kLog2e;
  const int n = static_cast<int>(z - 0.5f);  // round to nearest for z <= 0
  const float fn = static_cast<float>(n);
  const float r = x - fn * kLn2Hi - fn * kLn2Lo;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  uint32_t bits;
  const int e = n + 127;
  bits = static_cast<uint32_t>(e > 0 ? e : 0) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return nan ? in : under ? 0.0f : y * scale;
}

// 8-lane float vectors (GCC vector extensions): AVX in the x86-64-v3 clone,
// pairs of SSE registers in the baseline one.
typedef float V8 __attribute__((vector_size(32)));
KVRING_INLINE V8 Load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
KVRING_INLINE void Store8(float* p, V8 v) { std::memcpy(p, &v, sizeof(v)); }
KVRING_INLINE float Sum8(V8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

// Scores of 2 query vectors against 4 keys: 8 independent accumulators hide
// the FMA latency; each k load serves two queries.
KVRING_INLINE void Dot2x4(const float* __restrict q0, const float* __restrict q1, const float* __restrict k,
                          size_t kstride, uint32_t D, float* __restrict s0, float* __restrict s1) {
  V8 a00 = {}, a01 = {}, a02 = {}, a03 = {}, a10 = {}, a11 = {}, a12 = {}, a13 = {};
  const float* k0 = k;
  const float* k1 = k + kstride;
  const float* k2 = k + 2 * kstride;
  const float* k3 = k + 3 * kstride;
  for (uint32_t i = 0; i < D; i += 8) {
    const V8 x0 = Load8(q0 + i), x1 = Load8(q1 + i);
    const V8 y0 = Load8(k0 + i), y1 = Load8(k1 + i), y2 = Load8(k2 + i), y3 = Load8(k3 + i);
    a00 += x0 * y0;
    a01 += x0 * y1;
    a02 += x0 * y2;
    a03 += x0 * y3;
    a10 += x1 * y0;
    a11 += x1 * y1;
    a12 += x1 * y2;
    a13 += x1 * y3;
  }
  s0[0] = Sum8(a00);
  s0[1] = Sum8(a01);
  s0[2] = Sum8(a02);
  s0[3] = Sum8(a03);
  s1[0] = Sum8(a10);
  s1[1] = Sum8(a11);
  s1[2] = Sum8(a12);
  s1[3] = Sum8(a13);
}

KVRING_INLINE float Dot(const float* __restrict a, const float* __restrict b, uint32_t n) {
  V8 s0 = {}, s1 = {};
  uint32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 += Load8(a + i) * Load8(b + i);
    s1 += Load8(a + i + 8) * Load8(b + i + 8);
  }
  for (; i < n; i += 8) s0 += Load8(a + i) * Load8(b + i);
  return Sum8(s0 + s1);
}

// S[v][t] = q_v . k_t for v < nv, t < n (S row stride `sstride`).
KVRING_INLINE void Scores(const float* q, uint32_t nv, const float* k, uint32_t n, uint32_t D, float* S,
                          uint32_t sstride) {
  uint32_t v = 0;
  for (; v + 2 <= nv; v += 2) {
    const float* q0 = q + size_t{v} * D;
    const float* q1 = q0 + D;
    uint32_t t = 0;
    for (; t + 4 <= n; t += 4)
      Dot2x4(q0, q1, k + size_t{t} * D, D, D, S + size_t{v} * sstride + t, S + size_t{v + 1} * sstride + t);
    for (; t < n; ++t) {
      S[size_t{v} * sstride + t] = Dot(q0, k + size_t{t} * D, D);
      S[size_t{v + 1} * sstride + t] = Dot(q1, k + size_t{t} * D, D);
    }
  }
  for (; v < nv; ++v) {
    for (uint32_t t = 0; t < n; ++t) S[size_t{v} * sstride + t] = Dot(q + size_t{v} * D, k + size_t{t} * D, D);
  }
}

// acc[0..D) = acc * corr + sum_{t in [lo,hi)} e[t] * V[t], 32 columns at a
// time held in registers across the tokens (head_dim is a multiple of 8).
KVRING_INLINE void AccumulatePV(float* __restrict acc, float corr, const float* __restrict e, const float* __restrict V,
                                uint32_t lo, uint32_t hi, uint32_t D) {
  uint32_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    V8 a0 = Load8(acc + d0) * corr, a1 = Load8(acc + d0 + 8) * corr;
    V8 a2 = Load8(acc + d0 + 16) * corr, a3 = Load8(acc + d0 + 24) * corr;
    for (uint32_t t = lo; t < hi; ++t) {
      const float et = e[t];
      const float* vr = V + size_t{t} * D + d0;
      a0 += et * Load8(vr);
      a1 += et * Load8(vr + 8);
      a2 += et * Load8(vr + 16);
      a3 += et * Load8(vr + 24);
    }
    Store8(acc + d0, a0);
    Store8(acc + d0 + 8, a1);
    Store8(acc + d0 + 16, a2);
    Store8(acc + d0 + 24, a3);
  }
  for (; d0 < D; d0 += 8) {
    V8 a = Load8(acc + d0) * corr;
    for (uint32_t t = lo; t < hi; ++t) a += e[t] * Load8(V + size_t{t} * D + d0);
    Store8(acc + d0, a);
  }
}

// Converts the (layer, kv, head) plane of a block, first `n` tokens, to fp32.
KVRING_INLINE void LoadTile(const PagedKv& kv, const KvBlockRef& b, uint32_t layer, uint32_t which, uint32_t head,
                            uint32_t n, float* __restrict dst) {
  const BlockLayout& L = kv.layout;
  const uint32_t D = L.head_dim;
  const uint64_t base = L.plane_index(layer, which, head);
  const size_t count = size_t{n} * D;
  if (!kv.encoding.quantized()) {
    switch (L.dtype) {
      case DType::kF32:
        std::memcpy(dst, reinterpret_cast<const float*>(b.data) + base, count * 4);
        return;
      case DType::kBF16: {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(b.data) + base;
        for (size_t i = 0; i < count; ++i) {
          const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
          std::memcpy(dst + i, &bits, 4);
        }
        return;
      }
      case DType::kF16: {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(b.data) + base;
        for (size_t i = 0; i < count; ++i) dst[i] = F16ToFloat(src[i]);
        return;
      }
      default:
        return;
    }
  }
  const uint8_t* codes = b.data + base;
  const float* scales = reinterpret_cast<const float*>(b.data + L.elements());
  const ScaleMode mode = kv.encoding.scales;
  const bool fp8 = kv.encoding.codec == KvCodec::kFp8E4M3;
  const std::array<float, 256>& t8 = Fp8Table();
  for (uint32_t t = 0; t < n; ++t) {
    const uint8_t* c = codes + size_t{t} * D;
    float* out = dst + size_t{t} * D;
    if (mode == ScaleMode::kKChannelVToken && which == 0) {
      const float* ch = scales + ScaleIndex(L, mode, layer, 0, head, 0, 0);
      for (uint32_t d = 0; d < D; ++d)
        out[d] = (fp8 ? t8[c[d]] : static_cast<float>(static_cast<int8_t>(c[d]))) * ch[d];
    } else {
      const float s = scales[ScaleIndex(L, mode, layer, which, head, t, 0)];
      for (uint32_t d = 0; d < D; ++d) out[d] = (fp8 ? t8[c[d]] : static_cast<float>(static_cast<int8_t>(c[d]))) * s;
    }
  }
}

KVRING_INLINE float LoadQ(const QueryTensor& q, size_t idx) {
  switch (q.dtype) {
    case DType::kF32:
      return static_cast<const float*>(q.data)[idx];
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(q.data)[idx]);
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(q.data)[idx]);
    default:
      return 0;
  }
}

struct Task {
  uint32_t seq;
  uint32_t kv_head;
  uint32_t row_begin, row_end;  // into the row list of `seq`
};

struct Scratch {
  std::vector<float> q, acc, m, l, ktile, vtile, s;
  std::vector<int64_t> pos;
};

KVRING_MULTIVERSION
void RunTask(const AttentionOptions& o, const QueryTensor& q, const PagedKv& kv, const uint32_t* rows, const Task& task,
             float scale, PartialOutput out, Scratch& sc) {
  const BlockLayout& L = kv.layout;
  const uint32_t D = L.head_dim;
  const uint32_t G = q.q_heads / L.kv_heads;
  const uint32_t nrows = task.row_end - task.row_begin;
  const uint32_t nv = nrows * G;
  sc.q.resize(size_t{nv} * D);
  sc.acc.assign(size_t{nv} * D, 0.0f);
  sc.m.assign(nv, kNegInf);
  sc.l.assign(nv, 0.0f);
  sc.pos.resize(nv);
  sc.ktile.resize(size_t{L.block_tokens} * D);
  sc.vtile.resize(size_t{L.block_tokens} * D);
  sc.s.resize(size_t{nv} * L.block_tokens);
  int64_t min_pos = std::numeric_limits<int64_t>::max(), max_pos = std::numeric_limits<int64_t>::min();
  for (uint32_t r = 0; r < nrows; ++r) {
    const uint32_t row = rows[task.row_begin + r];
    const int64_t p = q.positions ? q.positions[row] : 0;
    min_pos = std::min(min_pos, p);
    max_pos = std::max(max_pos, p);
    for (uint32_t g = 0; g < G; ++g) {
      const uint32_t v = r * G + g;
      const uint32_t head = task.kv_head * G + g;
      const size_t src = (size_t{row} * q.q_heads + head) * D;
      for (uint32_t d = 0; d < D; ++d) sc.q[size_t{v} * D + d] = LoadQ(q, src + d) * scale;
      sc.pos[v] = p;
    }
  }
  const bool use_pos = o.causal || o.window > 0;
  for (uint32_t bi = kv.seq_begin[task.seq]; bi < kv.seq_begin[task.seq + 1]; ++bi) {
    const KvBlockRef& b = kv.blocks[bi];
    const uint32_t n = b.num_tokens;
    const int64_t first = b.start_pos, last = b.start_pos + n - 1;
    if (o.causal && first > max_pos) continue;
    if (o.window > 0 && last <= min_pos - o.window) continue;
    LoadTile(kv, b, o.layer, 0, task.kv_head, n, sc.ktile.data());
    LoadTile(kv, b, o.layer, 1, task.kv_head, n, sc.vtile.data());
    const uint32_t BT = L.block_tokens;
    Scores(sc.q.data(), nv, sc.ktile.data(), n, D, sc.s.data(), BT);
    for (uint32_t v = 0; v < nv; ++v) {
      uint32_t lo = 0, hi = n;
      if (use_pos) {
        const int64_t p = sc.pos[v];
        if (o.causal) hi = static_cast<uint32_t>(std::clamp<int64_t>(p - first + 1, 0, n));
        if (o.window > 0) lo = static_cast<uint32_t>(std::clamp<int64_t>(p - o.window + 1 - first, 0, n));
      }
      if (lo >= hi) continue;
      float* sv = sc.s.data() + size_t{v} * BT;
      float mx = kNegInf;
      for (uint32_t t = lo; t < hi; ++t) mx = std::max(mx, sv[t]);
      const float m_old = sc.m[v];
      const float m_new = std::max(m_old, mx);
      const float corr = m_old == kNegInf ? 0.0f : std::exp(m_old - m_new);
      float sum = 0;
      for (uint32_t t = lo; t < hi; ++t) {
        const float e = ExpNonPositive(sv[t] - m_new);
        sv[t] = e;
        sum += e;
      }
      AccumulatePV(sc.acc.data() + size_t{v} * D, corr, sv, sc.vtile.data(), lo, hi, D);
      sc.l[v] = sc.l[v] * corr + sum;
      sc.m[v] = m_new;
    }
  }
  for (uint32_t r = 0; r < nrows; ++r) {
    const uint32_t row = rows[task.row_begin + r];
    for (uint32_t g = 0; g < G; ++g) {
      const uint32_t v = r * G + g;
      const uint32_t head = task.kv_head * G + g;
      float* o_row = out.out + (size_t{row} * q.q_heads + head) * D;
      const float lsum = sc.l[v];
      if (lsum > 0 || std::isnan(lsum)) {  // NaN (a non-finite stored value) propagates, never reads as "no keys"
        const float inv = 1.0f / lsum;
        for (uint32_t d = 0; d < D; ++d) o_row[d] = sc.acc[size_t{v} * D + d] * inv;
        out.lse[size_t{row} * q.q_heads + head] = sc.m[v] + std::log(lsum);
      } else {
        std::memset(o_row, 0, sizeof(float) * D);
        out.lse[size_t{row} * q.q_heads + head] = kNegInf;
      }
    }
  }
}

// Rows grouped by sequence (stable), with per-sequence offsets.
void GroupRows(const QueryTensor& q, uint32_t nseq, std::vector<uint32_t>* rows, std::vector<uint32_t>* begin) {
  begin->assign(nseq + 1, 0);
  for (uint32_t r = 0; r < q.num_rows; ++r) ++(*begin)[(q.seq_ids ? q.seq_ids[r] : 0) + 1];
  for (uint32_t s = 0; s < nseq; ++s) (*begin)[s + 1] += (*begin)[s];
  rows->resize(q.num_rows);
  std::vector<uint32_t> fill(begin->begin(), begin->end() - 1);
  for (uint32_t r = 0; r < q.num_rows; ++r) (*rows)[fill[q.seq_ids ? q.seq_ids[r] : 0]++] = r;
}

}  // namespace

absl::Status ValidateAttention(const AttentionOptions& o, const QueryTensor& q, const PagedKv& kv) {
  const char* why = nullptr;
  if (!kv.layout.IsValid(&why)) return absl::InvalidArgumentError(absl::StrCat("KV layout: ", why));
  if (!IsFloatKvDType(q.dtype)) return absl::InvalidArgumentError("queries must be f32, f16 or bf16");
  if (q.num_rows > 0 && q.data == nullptr) return absl::InvalidArgumentError("queries have no data");
  if (q.head_dim != kv.layout.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("query head_dim ", q.head_dim, " != KV head_dim ", kv.layout.head_dim));
  }
  if (q.q_heads == 0 || q.q_heads % kv.layout.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("q_heads ", q.q_heads, " must be a positive multiple of kv_heads ", kv.layout.kv_heads));
  }
  if (o.layer >= kv.layout.layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", o.layer, " out of range [0, ", kv.layout.layers, ")"));
  }
  if (o.window < 0) return absl::InvalidArgumentError("window must be >= 0");
  if (!(o.softmax_scale >= 0) || std::isinf(o.softmax_scale))
    return absl::InvalidArgumentError("softmax_scale must be finite and >= 0");
  if ((o.causal || o.window > 0) && q.num_rows > 0 && q.positions == nullptr) {
    return absl::InvalidArgumentError("causal or windowed attention needs query positions");
  }
  KvEncoding e;
  if (!KvEncoding::Unpack(kv.encoding.Pack(), &e)) return absl::InvalidArgumentError("unknown KV encoding");
  const uint32_t nseq = kv.num_sequences();
  if (kv.seq_begin.empty()) return absl::InvalidArgumentError("seq_begin must have num_sequences + 1 entries");
  if (kv.seq_begin[0] != 0 || kv.seq_begin[nseq] != kv.blocks.size()) {
    return absl::InvalidArgumentError("seq_begin must start at 0 and end at the number of blocks");
  }
  for (uint32_t s = 0; s < nseq; ++s) {
    if (kv.seq_begin[s] > kv.seq_begin[s + 1]) return absl::InvalidArgumentError("seq_begin must be non-decreasing");
  }
  for (size_t i = 0; i < kv.blocks.size(); ++i) {
    const KvBlockRef& b = kv.blocks[i];
    if (b.data == nullptr) return absl::InvalidArgumentError(absl::StrCat("KV block ", i, " has no data"));
    if (b.num_tokens == 0 || b.num_tokens > kv.layout.block_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV block ", i, " has ", b.num_tokens, " tokens; must be in [1, ", kv.layout.block_tokens, "]"));
    }
    if (b.start_pos < 0) return absl::InvalidArgumentError(absl::StrCat("KV block ", i, " has a negative position"));
  }
  if (q.seq_ids != nullptr) {
    for (uint32_t r = 0; r < q.num_rows; ++r) {
      if (q.seq_ids[r] >= nseq) {
        return absl::InvalidArgumentError(
            absl::StrCat("query row ", r, " names sequence ", q.seq_ids[r], " of ", nseq));
      }
    }
  } else if (q.num_rows > 0 && nseq == 0) {
    return absl::InvalidArgumentError("queries given but the KV batch has no sequence");
  }
  // Queries come from the caller: a NaN or Inf in them is refused here (a
  // non-finite value stored in a KV block yields NaN outputs, never UB).
  const uint64_t nq = uint64_t{q.num_rows} * q.q_heads * q.head_dim;
  for (uint64_t i = 0; i < nq; ++i) {
    float v;
    if (q.dtype == DType::kF32)
      v = static_cast<const float*>(q.data)[i];
    else if (q.dtype == DType::kF16)
      v = F16ToFloat(static_cast<const uint16_t*>(q.data)[i]);
    else
      v = Bf16ToFloat(static_cast<const uint16_t*>(q.data)[i]);
    if (!std::isfinite(v)) {
      const uint64_t per_row = uint64_t{q.q_heads} * q.head_dim;
      return absl::InvalidArgumentError(
          absl::StrCat("query row ", i / per_row, " head ", (i % per_row) / q.head_dim, " has a non-finite value"));
    }
  }
  return absl::OkStatus();
}

absl::Status PartialAttention(const AttentionOptions& o, const QueryTensor& q, const PagedKv& kv, PartialOutput out,
                              ThreadPool* pool) {
  if (absl::Status s = ValidateAttention(o, q, kv); !s.ok()) return s;
  if (q.num_rows == 0) return absl::OkStatus();
  if (out.out == nullptr || out.lse == nullptr) return absl::InvalidArgumentError("output buffers are null");
  const uint32_t nseq = kv.num_sequences();
  std::vector<uint32_t> rows, begin;
  GroupRows(q, nseq, &rows, &begin);
  std::vector<Task> tasks;
  for (uint32_t s = 0; s < nseq; ++s) {
    for (uint32_t h = 0; h < kv.layout.kv_heads; ++h) {
      for (uint32_t r = begin[s]; r < begin[s + 1]; r += kRowsPerTask) {
        tasks.push_back(Task{s, h, r, std::min(begin[s + 1], r + kRowsPerTask)});
      }
    }
  }
  const float scale = o.softmax_scale > 0 ? o.softmax_scale : 1.0f / std::sqrt(static_cast<float>(q.head_dim));
  ParallelForOrInline(pool, tasks.size(), [&](size_t i) {
    thread_local Scratch sc;
    RunTask(o, q, kv, rows.data(), tasks[i], scale, out, sc);
  });
  return absl::OkStatus();
}

double AttentionFlops(const AttentionOptions& o, const QueryTensor& q, const PagedKv& kv) {
  double visible = 0;
  for (uint32_t r = 0; r < q.num_rows; ++r) {
    const uint32_t s = q.seq_ids ? q.seq_ids[r] : 0;
    const int64_t p = q.positions ? q.positions[r] : 0;
    for (uint32_t bi = kv.seq_begin[s]; bi < kv.seq_begin[s + 1]; ++bi) {
      const KvBlockRef& b = kv.blocks[bi];
      int64_t lo = b.start_pos, hi = b.start_pos + b.num_tokens;  // [lo, hi)
      if (o.causal) hi = std::min<int64_t>(hi, p + 1);
      if (o.window > 0) lo = std::max<int64_t>(lo, p - o.window + 1);
      if (hi > lo) visible += static_cast<double>(hi - lo);
    }
  }
  return 4.0 * q.head_dim * q.q_heads * visible;
}

}  // namespace kvring
