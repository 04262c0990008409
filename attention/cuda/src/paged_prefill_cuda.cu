// Paged prefill attention on tensor cores (FlashAttention-2 structure).
//
// CTA: 128 query rows of one (sequence, q head), 8 warps x 16 rows; the KV
// stream of the sequence (its listed pages, in position order) in tiles of
// 64 tokens, double-buffered in shared memory with cp.async (gathered page by
// page, 16-byte chunks, XOR-swizzled rows so ldmatrix is conflict-free).
// S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16/fp16 in, fp32
// accumulate); the softmax is online in registers, in the log2 domain. Q
// fragments stay in registers for the whole KV loop. Causal and window masks
// use absolute positions; tiles wholly outside the visible range are never
// loaded.
#include <cfloat>

#include "cuda_common.cuh"

namespace kvring::cuda {
namespace internal {
namespace {

constexpr int kBM = 128, kBN = 64, kWarps = 8, kThreads = kWarps * 32;

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4T(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void Mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma<__half>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <typename T>
__device__ __forceinline__ uint32_t Pack(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t Pack<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t Pack<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Byte offset of 16-byte chunk `c` of row `r` in a swizzled tile of D dims.
template <int D>
__device__ __forceinline__ uint32_t Swz(int r, int c) {
  constexpr int kChunks = D / 8;
  return (uint32_t)(r * kChunks + (c ^ (r & 7))) * 16u;
}

// Position of stream token i of a sequence (pages full but the last).
__device__ __forceinline__ int TokenPos(const PagedKvView& kv, int pb, int i) {
  const int pg = i / kv.block_tokens;
  return kv.page_pos[pb + pg] + (i - pg * kv.block_tokens);
}

// Number of stream tokens with position <= p (pages in increasing position order).
__device__ int CountUpTo(const PagedKvView& kv, int pb, int npages, int ntok, int p) {
  int lo = 0, hi = npages;  // first page whose token 0 is > p
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (kv.page_pos[pb + mid] > p) hi = mid; else lo = mid + 1;
  }
  if (lo == 0) return 0;
  const int page = lo - 1;
  const int in_page = min(kv.block_tokens, p - kv.page_pos[pb + page] + 1);
  return min(ntok, page * kv.block_tokens + in_page);
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads, 1) PrefillKernel(AttnParams p, QueryView q, PagedKvView kv, OutputView out) {
  constexpr int kKChunks = D / 16;  // k16 steps over the head dim
  constexpr int kDTiles = D / 8;    // n8 tiles of the output
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sq = smem;                        // kBM x D
  uint8_t* sk = smem + kBM * D * 2;          // 2 x kBN x D
  uint8_t* sv = sk + 2 * kBN * D * 2;        // 2 x kBN x D
  __shared__ int s_qmin, s_qmax;

  const int tile = blockIdx.x, hq = blockIdx.y, s = blockIdx.z;
  const int G = q.q_heads / kv.kv_heads;
  const int hk = hq / G;
  const int rb = q.seq_row_begin[s], re = q.seq_row_begin[s + 1];
  const int r0 = rb + tile * kBM;
  if (r0 >= re) return;
  const int nrows = min(kBM, re - r0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const float scale = (p.softmax_scale > 0 ? p.softmax_scale : rsqrtf((float)D)) * kLog2e;

  // Q tile -> smem (rows past the end zero-filled).
  {
    const T* qbase = static_cast<const T*>(q.q);
    for (int c = tid; c < kBM * (D / 8); c += kThreads) {
      const int r = c / (D / 8), ch = c % (D / 8);
      const bool valid = r < nrows;
      const T* src = qbase + ((size_t)(r0 + (valid ? r : 0)) * q.q_heads + hq) * D + ch * 8;
      CpAsync16(SmemAddr(sq + Swz<D>(r, ch)), src, valid);
    }
    CpAsyncCommit();
  }
  if (tid == 0) {
    s_qmin = INT32_MAX;
    s_qmax = INT32_MIN;
  }
  __syncthreads();
  for (int r = tid; r < nrows; r += kThreads) {
    atomicMin(&s_qmin, q.positions[r0 + r]);
    atomicMax(&s_qmax, q.positions[r0 + r]);
  }
  const int row_g = warp * 16 + g, row_g8 = row_g + 8;
  const int qpos0 = row_g < nrows ? q.positions[r0 + row_g] : INT32_MIN;
  const int qpos1 = row_g8 < nrows ? q.positions[r0 + row_g8] : INT32_MIN;

  // The stream tokens this tile can see: [n_begin, n_end).
  const int pb = kv.seq_page_begin[s], npages = kv.seq_page_begin[s + 1] - pb;
  const int ntok = kv.seq_tokens[s];
  __syncthreads();
  const int qmin = s_qmin, qmax = s_qmax;
  int n_end = ntok, n_begin = 0;
  if (p.causal) n_end = CountUpTo(kv, pb, npages, ntok, qmax);
  if (p.window > 0) n_begin = CountUpTo(kv, pb, npages, ntok, qmin - p.window);
  n_begin = (n_begin / kBN) * kBN;

  const char* pool = static_cast<const char*>(kv.pool);
  const uint64_t koff = PlaneOffset(kv, 0, hk) * sizeof(T), voff = PlaneOffset(kv, 1, hk) * sizeof(T);
  auto load_kv = [&](int n0, int buf) {
    for (int c = tid; c < kBN * (D / 8); c += kThreads) {
      const int r = c / (D / 8), ch = c % (D / 8);
      const int i = n0 + r;
      const bool valid = i < n_end;
      const char* src = pool;
      if (valid) {
        const int pg = i / kv.block_tokens, off = i - pg * kv.block_tokens;
        src = pool + (uint64_t)kv.page_ids[pb + pg] * kv.page_stride + ((uint64_t)off * D + ch * 8) * sizeof(T);
      }
      CpAsync16(SmemAddr(sk + buf * kBN * D * 2 + Swz<D>(r, ch)), src + koff * valid, valid);
      CpAsync16(SmemAddr(sv + buf * kBN * D * 2 + Swz<D>(r, ch)), src + voff * valid, valid);
    }
    CpAsyncCommit();
  };

  if (n_begin < n_end) load_kv(n_begin, 0);
  CpAsyncWait<(0)>();  // Q (and maybe the first KV tile; fine)
  __syncthreads();
  // Q fragments for this warp's 16 rows.
  uint32_t qa[kKChunks][4];
#pragma unroll
  for (int kk = 0; kk < kKChunks; ++kk) {
    const int mi = lane >> 3, rr = lane & 7;
    const int r = warp * 16 + (mi & 1) * 8 + rr, ch = 2 * kk + (mi >> 1);
    LdMatrixX4(SmemAddr(sq + Swz<D>(r, ch)), qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3]);
  }

  float o[kDTiles][4];
#pragma unroll
  for (int j = 0; j < kDTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  int buf = 0;
  for (int n0 = n_begin; n0 < n_end; n0 += kBN, buf ^= 1) {
    if (n0 + kBN < n_end) {
      load_kv(n0 + kBN, buf ^ 1);
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    const uint8_t* kt = sk + buf * kBN * D * 2;
    const uint8_t* vt = sv + buf * kBN * D * 2;
    // S = Q K^T : 16 x 64 per warp.
    float sc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKChunks; ++kk) {
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const int mi = lane >> 3, rr = lane & 7;
        const int tok = (j + (mi >> 1)) * 8 + rr, ch = 2 * kk + (mi & 1);
        uint32_t b0, b1, b2, b3;
        LdMatrixX4(SmemAddr(kt + Swz<D>(tok, ch)), b0, b1, b2, b3);
        Mma<T>(sc[j], qa[kk], b0, b1);
        Mma<T>(sc[j + 1], qa[kk], b2, b3);
      }
    }
    // Masks and the online softmax (rows g and g+8 of the warp). Positions
    // increase along the stream, so a tile needs masking only when it
    // straddles the tile's causal diagonal or window edge, or the end.
    const int last = min(n0 + kBN, n_end) - 1;
    const bool edge = n0 + kBN > n_end || (p.causal && TokenPos(kv, pb, last) > qmin) ||
                      (p.window > 0 && TokenPos(kv, pb, n0) <= qmax - p.window);
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = sc[j][e] * scale;
        if (edge) {
          const int i = n0 + j * 8 + tig * 2 + (e & 1);
          const int qp = e < 2 ? qpos0 : qpos1;
          bool vis = i < n_end;
          if (vis && (p.causal || p.window > 0)) {
            const int kp = TokenPos(kv, pb, i);
            if (p.causal) vis = kp <= qp;
            if (p.window > 0) vis = vis && kp > qp - p.window;
          }
          if (!vis) v = -INFINITY;
        }
        sc[j][e] = v;
      }
      mx0 = fmaxf(mx0, fmaxf(sc[j][0], sc[j][1]));
      mx1 = fmaxf(mx1, fmaxf(sc[j][2], sc[j][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);
    const float c0 = nm0 == -INFINITY ? 1.f : exp2f(m0 - nm0);
    const float c1 = nm1 == -INFINITY ? 1.f : exp2f(m1 - nm1);
    const float base0 = nm0 == -INFINITY ? 0.f : nm0, base1 = nm1 == -INFINITY ? 0.f : nm1;
    float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      sc[j][0] = exp2f(sc[j][0] - base0);
      sc[j][1] = exp2f(sc[j][1] - base0);
      sc[j][2] = exp2f(sc[j][2] - base1);
      sc[j][3] = exp2f(sc[j][3] - base1);
      rs0 += sc[j][0] + sc[j][1];
      rs1 += sc[j][2] + sc[j][3];
    }
    l0 = l0 * c0 + rs0;
    l1 = l1 * c1 + rs1;
    m0 = nm0;
    m1 = nm1;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      o[j][0] *= c0;
      o[j][1] *= c0;
      o[j][2] *= c1;
      o[j][3] *= c1;
    }
    // O += P V over the 4 k16 token chunks of the tile.
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      uint32_t pa[4];
      pa[0] = Pack<T>(sc[2 * t][0], sc[2 * t][1]);
      pa[1] = Pack<T>(sc[2 * t][2], sc[2 * t][3]);
      pa[2] = Pack<T>(sc[2 * t + 1][0], sc[2 * t + 1][1]);
      pa[3] = Pack<T>(sc[2 * t + 1][2], sc[2 * t + 1][3]);
#pragma unroll
      for (int dn = 0; dn < kDTiles; dn += 2) {
        const int mi = lane >> 3, rr = lane & 7;
        const int tok = 16 * t + (mi & 1) * 8 + rr, ch = dn + (mi >> 1);
        uint32_t b0, b1, b2, b3;
        LdMatrixX4T(SmemAddr(vt + Swz<D>(tok, ch)), b0, b1, b2, b3);
        Mma<T>(o[dn], pa, b0, b1);
        Mma<T>(o[dn + 1], pa, b2, b3);
      }
    }
    __syncthreads();  // the buffer is reloaded two iterations on
  }
  // Finish: full row sums across the quad, normalize, write.
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  if (row_g < nrows) {
    float* dst = out.out + ((size_t)(r0 + row_g) * q.q_heads + hq) * D;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      *reinterpret_cast<float2*>(dst + j * 8 + tig * 2) = make_float2(o[j][0] * inv0, o[j][1] * inv0);
    }
    if (tig == 0) out.lse[(size_t)(r0 + row_g) * q.q_heads + hq] = l0 > 0.f ? (m0 + log2f(l0)) * kLn2 : -INFINITY;
  }
  if (row_g8 < nrows) {
    float* dst = out.out + ((size_t)(r0 + row_g8) * q.q_heads + hq) * D;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      *reinterpret_cast<float2*>(dst + j * 8 + tig * 2) = make_float2(o[j][2] * inv1, o[j][3] * inv1);
    }
    if (tig == 0) out.lse[(size_t)(r0 + row_g8) * q.q_heads + hq] = l1 > 0.f ? (m1 + log2f(l1)) * kLn2 : -INFINITY;
  }
}

template <int D, typename T>
cudaError_t Launch(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out, cudaStream_t stream) {
  const size_t smem = (size_t)(kBM + 4 * kBN) * D * 2;
  cudaError_t e = cudaFuncSetAttribute(PrefillKernel<D, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return e;
  dim3 grid((q.max_rows_per_seq + kBM - 1) / kBM, q.q_heads, kv.num_seqs);
  PrefillKernel<D, T><<<grid, kThreads, smem, stream>>>(p, q, kv, out);
  return cudaGetLastError();
}

}  // namespace
}  // namespace internal

cudaError_t PagedPrefill(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                         cudaStream_t stream) {
  if (CheckViews(q, kv) != nullptr || out.out == nullptr || out.lse == nullptr) return cudaErrorInvalidValue;
  if (q.num_rows == 0) return cudaSuccess;
  if (kv.dtype == KvType::kBF16) {
    return kv.head_dim == 128 ? internal::Launch<128, __nv_bfloat16>(p, q, kv, out, stream)
                              : internal::Launch<64, __nv_bfloat16>(p, q, kv, out, stream);
  }
  return kv.head_dim == 128 ? internal::Launch<128, __half>(p, q, kv, out, stream)
                            : internal::Launch<64, __half>(p, q, kv, out, stream);
}

}  // namespace kvring::cuda
