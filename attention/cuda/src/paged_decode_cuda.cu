// Paged decode attention (flash-decoding) on CUDA cores.
//
// Grid (splits, kv_heads x vector groups, sequences), 128 threads. A CTA
// owns one kv head of one sequence, a contiguous range of its pages (the
// split), and up to NV query vectors (query row x q head of the GQA group).
// Each lane holds VEC consecutive dims of one key per step (16-byte loads,
// coalesced along the row), so a warp covers TPS keys per step and every K/V
// byte is read from HBM once per CTA; dot products reduce across the LPT
// lanes of a key with shuffles. Scores live in the log2 domain (scale *
// log2 e folded into q). Each warp keeps an online softmax per vector; warps
// merge in shared memory; the CTA writes one (O, LSE) partial per vector,
// and a second kernel merges the splits (or the CTA writes the final result
// when there is one split).
#include <cfloat>

#include "cuda_common.cuh"

namespace kvring::cuda {
namespace internal {
namespace {

constexpr int kWarps = 4;

template <int D, int NV, typename T>
__global__ void __launch_bounds__(128) DecodeKernel(AttnParams p, QueryView q, PagedKvView kv, int num_splits,
                                                    int vec_groups, float* part_out, float* part_lse, float* out,
                                                    float* lse) {
  constexpr int VEC = 8;           // elements per 16-byte load
  constexpr int LPT = D / VEC;     // lanes per key: 16 (D=128) or 8 (D=64)
  constexpr int TPS = 32 / LPT;    // keys per warp step
  const int sp = blockIdx.x;
  const int h = blockIdx.y / vec_groups;
  const int vg = blockIdx.y % vec_groups;
  const int s = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int G = q.q_heads / kv.kv_heads;
  const int rb = q.seq_row_begin[s], re = q.seq_row_begin[s + 1];
  const int v0 = vg * NV;
  const int nvec_total = (re - rb) * G;
  if (v0 >= nvec_total) return;
  const int nv = min(NV, nvec_total - v0);
  const float scale = (p.softmax_scale > 0 ? p.softmax_scale : rsqrtf((float)D)) * kLog2e;

  const int bt = kv.block_tokens;
  const int pb = kv.seq_page_begin[s], npages = kv.seq_page_begin[s + 1] - pb;
  const int ntok = kv.seq_tokens[s];
  const int pps = (npages + num_splits - 1) / num_splits;
  const int page_lo = sp * pps;
  const int tok_lo = page_lo * bt;
  const int tok_hi = min(ntok, min(npages, page_lo + pps) * bt);

  const int sub = lane / LPT;
  const int dl = (lane % LPT) * VEC;
  float qr[NV][VEC];
  int qpos[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    qpos[j] = INT32_MIN;
    if (j < nv) {
      const int v = v0 + j;
      const int row = rb + v / G, head = h * G + v % G;
      const T* src = static_cast<const T*>(q.q) + ((size_t)row * q.q_heads + head) * D + dl;
      float f[VEC];
      Vec8<T>::ToFloat(*reinterpret_cast<const uint4*>(src), f);
#pragma unroll
      for (int d = 0; d < VEC; ++d) qr[j][d] = f[d] * scale;
      qpos[j] = q.positions[row];
    } else {
#pragma unroll
      for (int d = 0; d < VEC; ++d) qr[j][d] = 0.f;
    }
  }
  float m[NV], l[NV], acc[NV][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.f;
#pragma unroll
    for (int d = 0; d < VEC; ++d) acc[j][d] = 0.f;
  }
  const char* pool = static_cast<const char*>(kv.pool);
  const uint64_t koff = PlaneOffset(kv, 0, h) * sizeof(T), voff = PlaneOffset(kv, 1, h) * sizeof(T);

  // kUnroll steps per iteration: their loads are all issued before any use,
  // so each lane keeps 2 x kUnroll 16-byte loads in flight.
  constexpr int kUnroll = 4;
  for (int t0 = tok_lo + warp * TPS; t0 < tok_hi; t0 += kUnroll * kWarps * TPS) {
    uint4 kraw[kUnroll], vraw[kUnroll];
    int pos[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * kWarps * TPS + sub;
      valid[u] = t < tok_hi;
      kraw[u] = vraw[u] = make_uint4(0, 0, 0, 0);
      pos[u] = 0;
      if (valid[u]) {
        const int pg = t / bt, off = t - pg * bt;
        const int page = kv.page_ids[pb + pg];
        pos[u] = kv.page_pos[pb + pg] + off;
        const char* base = pool + (uint64_t)page * kv.page_stride + ((uint64_t)off * D + dl) * sizeof(T);
        kraw[u] = LoadNc(base + koff);
        vraw[u] = LoadNc(base + voff);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (t0 + u * kWarps * TPS >= tok_hi) break;  // uniform across the warp
      float kf[VEC], vf[VEC];
      Vec8<T>::ToFloat(kraw[u], kf);
      Vec8<T>::ToFloat(vraw[u], vf);
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        float dot = 0.f;
#pragma unroll
        for (int d = 0; d < VEC; ++d) dot = fmaf(qr[j][d], kf[d], dot);
#pragma unroll
        for (int o = LPT / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        bool vis = valid[u] && j < nv;
        if (p.causal) vis = vis && pos[u] <= qpos[j];
        if (p.window > 0) vis = vis && pos[u] > qpos[j] - p.window;
        const float sc = vis ? dot : -INFINITY;
        float mx = sc;
#pragma unroll
        for (int o = LPT; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float nm = fmaxf(m[j], mx);
        if (nm == -INFINITY) continue;  // uniform across the warp
        const float corr = exp2f(m[j] - nm);
        const float pe = vis ? exp2f(sc - nm) : 0.f;
        float ps = pe;
#pragma unroll
        for (int o = LPT; o < 32; o <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        l[j] = l[j] * corr + ps;
#pragma unroll
        for (int d = 0; d < VEC; ++d) acc[j][d] = fmaf(pe, vf[d], acc[j][d] * corr);
        m[j] = nm;
      }
    }
  }
  // Sum the keys of a step (lanes of the same dims, different subs).
#pragma unroll
  for (int j = 0; j < NV; ++j) {
#pragma unroll
    for (int d = 0; d < VEC; ++d) {
#pragma unroll
      for (int o = LPT; o < 32; o <<= 1) acc[j][d] += __shfl_xor_sync(0xffffffffu, acc[j][d], o);
    }
  }
  // Merge the warps.
  __shared__ float sm_m[kWarps][NV], sm_l[kWarps][NV];
  __shared__ float sm_acc[kWarps][NV][D];
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      sm_m[warp][j] = m[j];
      sm_l[warp][j] = l[j];
    }
  }
  if (sub == 0) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
#pragma unroll
      for (int d = 0; d < VEC; ++d) sm_acc[warp][j][dl + d] = acc[j][d];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < nv * D; idx += blockDim.x) {
    const int j = idx / D, d = idx % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][j]);
    float L = 0.f, o = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = sm_m[w][j] == -INFINITY ? 0.f : exp2f(sm_m[w][j] - M);
        L += sm_l[w][j] * f;
        o += sm_acc[w][j][d] * f;
      }
    }
    const int v = v0 + j;
    const int row = rb + v / G, head = h * G + v % G;
    const size_t rh = (size_t)row * q.q_heads + head;
    const float val = L > 0.f ? o / L : 0.f;
    const float ls = L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY;
    if (num_splits == 1) {
      out[rh * D + d] = val;
      if (d == 0) lse[rh] = ls;
    } else {
      const size_t rows_heads = (size_t)q.num_rows * q.q_heads;
      part_out[((size_t)sp * rows_heads + rh) * D + d] = val;
      if (d == 0) part_lse[(size_t)sp * rows_heads + rh] = ls;
    }
  }
}

template <int D, int NV, typename T>
cudaError_t LaunchDecode(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                         float* part_out, float* part_lse, cudaStream_t stream) {
  const int G = q.q_heads / kv.kv_heads;
  const int vec_groups = (q.max_rows_per_seq * G + NV - 1) / NV;
  dim3 grid(splits, kv.kv_heads * vec_groups, kv.num_seqs);
  DecodeKernel<D, NV, T><<<grid, 128, 0, stream>>>(p, q, kv, splits, vec_groups, part_out, part_lse, out.out, out.lse);
  return cudaGetLastError();
}

template <int D, typename T>
cudaError_t DispatchNV(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int splits,
                       float* po, float* pl, cudaStream_t s) {
  const int nvec = q.max_rows_per_seq * (q.q_heads / kv.kv_heads);
  if (nvec <= 1) return LaunchDecode<D, 1, T>(p, q, kv, out, splits, po, pl, s);
  if (nvec <= 2) return LaunchDecode<D, 2, T>(p, q, kv, out, splits, po, pl, s);
  if (nvec <= 4) return LaunchDecode<D, 4, T>(p, q, kv, out, splits, po, pl, s);
  return LaunchDecode<D, 8, T>(p, q, kv, out, splits, po, pl, s);
}

}  // namespace
}  // namespace internal

const char* CheckViews(const QueryView& q, const PagedKvView& kv) {
  if (kv.pool == nullptr || kv.page_ids == nullptr || kv.page_pos == nullptr || kv.seq_page_begin == nullptr ||
      kv.seq_tokens == nullptr) {
    return "KV view has null pointers";
  }
  if (q.q == nullptr || q.positions == nullptr || q.seq_row_begin == nullptr) return "query view has null pointers";
  if (kv.head_dim != 64 && kv.head_dim != 128) return "head_dim must be 64 or 128";
  if (kv.kv_heads <= 0 || q.q_heads <= 0 || q.q_heads % kv.kv_heads != 0) return "q_heads must be a multiple of kv_heads";
  if (kv.layer < 0 || kv.layer >= kv.layers) return "layer out of range";
  if (kv.block_tokens <= 0 || kv.block_tokens > 256) return "block_tokens must be in [1, 256]";
  if (kv.page_stride < (uint64_t)kv.layers * 2 * kv.kv_heads * kv.block_tokens * kv.head_dim * 2) {
    return "page_stride smaller than a block";
  }
  if (kv.num_seqs <= 0 || q.max_rows_per_seq <= 0) return "no sequences";
  return nullptr;
}

int DefaultDecodeSplits(const QueryView& q, const PagedKvView& kv, int max_pages_per_seq, int sm_count) {
  const int G = q.q_heads / kv.kv_heads;
  const int vec_groups = (q.max_rows_per_seq * G + 7) / 8;
  const long ctas = (long)kv.num_seqs * kv.kv_heads * vec_groups;
  const long target = 4L * sm_count * 4;  // ~4 waves of 4 CTAs per SM
  long splits = (target + ctas - 1) / ctas;
  splits = std::min<long>(splits, std::max(1, max_pages_per_seq / 4));  // >= 4 pages per split
  return (int)std::max<long>(1, std::min<long>(splits, 256));
}

size_t DecodeWorkspaceBytes(const QueryView& q, int num_splits, int head_dim) {
  if (num_splits <= 1) return 0;
  const size_t rh = (size_t)q.num_rows * q.q_heads;
  return (size_t)num_splits * rh * (head_dim + 1) * sizeof(float);
}

cudaError_t PagedDecode(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, int num_splits,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (CheckViews(q, kv) != nullptr || out.out == nullptr || out.lse == nullptr || num_splits < 1) {
    return cudaErrorInvalidValue;
  }
  if (q.num_rows == 0) return cudaSuccess;
  const int D = kv.head_dim;
  if (workspace_bytes < DecodeWorkspaceBytes(q, num_splits, D)) return cudaErrorInvalidValue;
  float* po = static_cast<float*>(workspace);
  float* pl = po == nullptr ? nullptr : po + (size_t)num_splits * q.num_rows * q.q_heads * D;
  cudaError_t e;
  if (kv.dtype == KvType::kBF16) {
    e = D == 128 ? internal::DispatchNV<128, __nv_bfloat16>(p, q, kv, out, num_splits, po, pl, stream)
                 : internal::DispatchNV<64, __nv_bfloat16>(p, q, kv, out, num_splits, po, pl, stream);
  } else {
    e = D == 128 ? internal::DispatchNV<128, __half>(p, q, kv, out, num_splits, po, pl, stream)
                 : internal::DispatchNV<64, __half>(p, q, kv, out, num_splits, po, pl, stream);
  }
  if (e != cudaSuccess || num_splits == 1) return e;
  return MergePartials(po, pl, num_splits, q.num_rows * q.q_heads, D, out, stream);
}

}  // namespace kvring::cuda
