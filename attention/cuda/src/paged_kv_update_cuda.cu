#include "kvring/attention/cuda/paged_kv_update.h"

namespace kvring::cuda {
namespace {

// One thread a 16-byte vector of one (token, K|V, head) row.
__global__ void ApplyKvUpdatesKernel(PagedKvView kv, const KvAppendOp* appends, int num_appends, const uint4* new_k,
                                     const uint4* new_v, const TableWriteOp* writes, int num_writes) {
  const int vecs = kv.head_dim * 2 / 16;  // 16-byte vectors a row (2-byte elements)
  const long per_op = 2L * kv.kv_heads * vecs;
  const long total = (long)num_appends * per_op;
  const uint64_t plane = (uint64_t)kv.block_tokens * kv.head_dim * 2;  // bytes of one (layer, K|V, head) plane
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total + num_writes;
       i += (long)gridDim.x * blockDim.x) {
    if (i >= total) {
      const TableWriteOp w = writes[i - total];
      *w.dst = w.value;
      continue;
    }
    const KvAppendOp op = appends[i / per_op];
    const int r = (int)(i % per_op);
    const int side = r / (kv.kv_heads * vecs);  // 0 K, 1 V
    const int head = (r / vecs) % kv.kv_heads;
    const int v = r % vecs;
    const uint4* src = (side == 0 ? new_k : new_v) + ((long)op.src_row * kv.kv_heads + head) * vecs + v;
    char* page = (char*)kv.pool + (uint64_t)op.page * kv.page_stride;
    uint4* dst = (uint4*)(page + (((uint64_t)kv.layer * 2 + side) * kv.kv_heads + head) * plane +
                          (uint64_t)op.token * kv.head_dim * 2) +
                 v;
    *dst = *src;
  }
}

__global__ void GatherPageTablesKernel(const TableSegment* segments, int32_t* ids_out, int32_t* pos_out) {
  const TableSegment s = segments[blockIdx.y];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < s.count; i += gridDim.x * blockDim.x) {
    ids_out[s.dst + i] = s.ids[i];
    pos_out[s.dst + i] = s.pos[i];
  }
}

}  // namespace

cudaError_t ApplyKvUpdates(const PagedKvView& kv, const KvAppendOp* appends, int num_appends, const void* new_k,
                           const void* new_v, const TableWriteOp* writes, int num_writes, cudaStream_t stream) {
  if (num_appends < 0 || num_writes < 0) return cudaErrorInvalidValue;
  if (num_appends + num_writes == 0) return cudaSuccess;
  if (num_appends > 0) {
    if (kv.pool == nullptr || appends == nullptr || new_k == nullptr || new_v == nullptr || kv.encoding.quantized() ||
        kv.head_dim % 8 != 0 || kv.kv_heads <= 0 || kv.layer < 0 || kv.layer >= kv.layers ||
        reinterpret_cast<uintptr_t>(kv.pool) % 16 != 0 || kv.page_stride % 16 != 0 ||
        reinterpret_cast<uintptr_t>(new_k) % 16 != 0 || reinterpret_cast<uintptr_t>(new_v) % 16 != 0) {
      return cudaErrorInvalidValue;
    }
  }
  if (num_writes > 0 && writes == nullptr) return cudaErrorInvalidValue;
  const long items = (long)num_appends * 2 * kv.kv_heads * (kv.head_dim * 2 / 16) + num_writes;
  const int threads = 256;
  const int blocks = (int)std::min<long>((items + threads - 1) / threads, 4096);
  ApplyKvUpdatesKernel<<<blocks, threads, 0, stream>>>(kv, appends, num_appends, static_cast<const uint4*>(new_k),
                                                       static_cast<const uint4*>(new_v), writes, num_writes);
  return cudaGetLastError();
}

cudaError_t GatherPageTables(const TableSegment* segments, int num_segments, int max_count, int32_t* ids_out,
                             int32_t* pos_out, cudaStream_t stream) {
  if (num_segments < 0 || max_count < 0) return cudaErrorInvalidValue;
  if (num_segments == 0 || max_count == 0) return cudaSuccess;
  if (segments == nullptr || ids_out == nullptr || pos_out == nullptr || num_segments > 65535)
    return cudaErrorInvalidValue;
  const int threads = 256;
  const dim3 grid((unsigned)std::min((max_count + threads - 1) / threads, 64), (unsigned)num_segments);
  GatherPageTablesKernel<<<grid, threads, 0, stream>>>(segments, ids_out, pos_out);
  return cudaGetLastError();
}

}  // namespace kvring::cuda
