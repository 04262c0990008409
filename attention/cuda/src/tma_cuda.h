// Tensor maps of the page pool for the Hopper tensor memory accelerator
// (internal to the attention kernels).
#pragma once

#include <cuda.h>

#include "kvring/attention/cuda/paged_attention_cuda.h"

namespace kvring::cuda::internal {

// A 5-d map of kv's pool: (64 columns, 64-column block, token of the page,
// plane = (layer, K|V, kv head), page), boxes of 64 columns x `box_tokens`
// tokens, 128-byte swizzle (16-byte chunk c of box row r lands at chunk
// c ^ (r % 8) of its 128-byte row). Page coordinates outside [0, 2^31) read
// as zeros. Returns false where TMA cannot serve the view (the device is not
// sm_90+, block_tokens is not a multiple of box_tokens, or the driver refuses
// the strides); the caller then gathers with cp.async. Host only; thread-safe.
// all_column_blocks: the map's dimensions are (64 columns, token, 64-column
// block, plane, page) and a box holds `box_tokens` tokens of every column
// block, landing as [D/64][box_tokens][128 B] (one copy where the other
// layout takes D/64).
// l2_promotion_bytes: the granularity L2 fetches a box's misses at (256,
// 128, 64, or 0 for none). Decode streams each byte once and asks for 128
// (256-byte promotion fetched lines it never read and cost it ~6% of its
// DRAM rate: docs/perf/prefill-and-first-kernels.md).
bool MakePoolMap(const PagedKvView& kv, int box_tokens, CUtensorMap* map, bool all_column_blocks = false,
                 int l2_promotion_bytes = 256);

// A 3-d map of q's query vectors: (64 columns, q head, row), boxes of 64
// columns x 1 head x `box_rows` rows with the 128-byte swizzle (a box lands
// as [box_rows][128 B]); rows past q.num_rows read as zeros. False where TMA
// cannot serve it (as MakePoolMap; also a query pointer that is not 16-byte
// aligned). Host only; thread-safe.
bool MakeQueryMap(const QueryView& q, int head_dim, int box_rows, CUtensorMap* map);

// Quantized pages (kv.encoding quantized, head_dim 64 or 128): a 5-d map of the
// pool's 1-byte codes (D bytes, token of the page, plane, 1, page) with boxes
// of D bytes x `box_tokens` tokens, landing as [box_tokens][D] swizzled:
// 16-byte chunk c of row r at chunk c ^ (r % 8) (D = 128, 128-byte swizzle)
// or c ^ (r / 2 % 4) (D = 64, 64-byte swizzle); the destination must be
// 1024-byte aligned. False where TMA cannot serve the view (as MakePoolMap).
// Host only. (The scales
// are read by 1-d bulk copies: a 2-d UINT32 tensor map of each page's words
// stopped the kernel with an illegal instruction on the H200 at its first
// load, compute-sanitizer: the 2-d TMA load.)
bool MakeQuantCodeMap(const PagedKvView& kv, int box_tokens, CUtensorMap* codes);

}  // namespace kvring::cuda::internal
