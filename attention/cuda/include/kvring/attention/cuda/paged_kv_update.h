// Device-side updates of a paged KV cache, enqueued ahead of an attention
// launch on the same stream (paged_attention_cuda.h's conventions: plain
// views, a stream, no allocation, cudaError_t; asynchronous, complete when
// the stream is):
//  - the new tokens' K and V written into their pages (decode in place);
//  - entries of device-resident page tables set;
//  - the page tables of a batch gathered from per-sequence tables into the
//    CSR arrays PagedDecode / PagedPrefill read.
// Every pointer argument is device memory; ops arrays are read on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvring/attention/cuda/paged_attention_cuda.h"

namespace kvring::cuda {

// One appended token: K and V of row `src_row` of new_k / new_v
// ([rows, kv_heads, head_dim] in kv.dtype) go to token slot `token` of pool
// page `page`, layer kv.layer.
struct KvAppendOp {
  int32_t page = 0;
  int32_t token = 0;
  int32_t src_row = 0;
  int32_t pad = 0;
};

// *dst = value.
struct TableWriteOp {
  int32_t* dst = nullptr;
  int32_t value = 0;
  int32_t pad = 0;
};

// `count` consecutive entries of a sequence's (ids, pos) tables, copied to
// entries [dst, dst + count) of the batch's tables.
struct TableSegment {
  const int32_t* ids = nullptr;
  const int32_t* pos = nullptr;
  int32_t count = 0;
  int32_t dst = 0;
};

// Appends then table writes (one launch; the two touch disjoint memory).
// new_k, new_v and the pool must be 16-byte aligned; plain bf16/f16 pages.
cudaError_t ApplyKvUpdates(const PagedKvView& kv, const KvAppendOp* appends, int num_appends, const void* new_k,
                           const void* new_v, const TableWriteOp* writes, int num_writes, cudaStream_t stream);

cudaError_t GatherPageTables(const TableSegment* segments, int num_segments, int max_count, int32_t* ids_out,
                             int32_t* pos_out, cudaStream_t stream);

}  // namespace kvring::cuda
