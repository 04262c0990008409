// Packing one layer of KV pages into a contiguous wire buffer on the GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvring/attention/cuda/attention_views_cuda.h"

namespace kvring::cuda {

// Copies the `layer` slice ([K|V][kv_head][token][head_dim]) of each listed
// page into `dst`, one slice after another: the packed form a KV chunk takes
// on the wire, itself a page pool of one-layer pages (stride = slice bytes).
cudaError_t PackLayerPages(const PagedKvView& kv, const int32_t* page_ids, int num_pages, void* dst,
                           cudaStream_t stream);
// Bytes of one packed slice.
inline uint64_t LayerSliceBytes(const PagedKvView& kv) {
  return 2ull * kv.kv_heads * kv.block_tokens * kv.head_dim * 2;
}
// Fills dst[i] = i for i < n (page ids of a packed buffer).
cudaError_t Iota(int32_t* dst, int n, cudaStream_t stream);

}  // namespace kvring::cuda
