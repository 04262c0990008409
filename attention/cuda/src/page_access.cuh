// Reading a sequence out of the page pool (internal): plane offsets inside a
// page, token positions, and the counting the causal masks need.
#pragma once

#include <cstdint>

#include "kvring/attention/cuda/attention_views_cuda.h"

namespace kvring::cuda::internal {

// Element offset of the (layer, kv, head) plane inside a page.
__device__ __forceinline__ uint64_t PlaneOffset(const PagedKvView& kv, int which, int head) {
  return (((uint64_t)kv.layer * 2 + which) * kv.kv_heads + head) * (uint64_t)kv.block_tokens * kv.head_dim;
}

// Position of stream token i of a sequence (pages full but the last).
__device__ __forceinline__ int TokenPos(const PagedKvView& kv, int pb, int i) {
  const int pg = i / kv.block_tokens;
  return kv.page_pos[pb + pg] + (i - pg * kv.block_tokens);
}

// Whether a sequence's listed pages have contiguous positions (the first and
// last pages exactly npages - 1 pages apart: every page follows the one
// before, so token i sits at *p0 + i); *p0 is the first page's position.
__device__ __forceinline__ bool PagesContiguous(const PagedKvView& kv, int pb, int npages, int* p0) {
  *p0 = kv.page_pos[pb];
  return kv.page_pos[pb + npages - 1] == *p0 + (npages - 1) * kv.block_tokens;
}

// Number of stream tokens with position <= p (pages in increasing position order).
__device__ __forceinline__ int CountUpTo(const PagedKvView& kv, int pb, int npages, int ntok, int p) {
  if (npages == 0) return 0;
  int p0;
  if (PagesContiguous(kv, pb, npages, &p0)) return (int)max(0ll, min((long long)ntok, (long long)p - p0 + 1));
  int lo = 0, hi = npages;  // first page whose token 0 is > p
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (kv.page_pos[pb + mid] > p)
      hi = mid;
    else
      lo = mid + 1;
  }
  if (lo == 0) return 0;
  const int page = lo - 1;
  const int in_page = min(kv.block_tokens, p - kv.page_pos[pb + page] + 1);
  return min(ntok, page * kv.block_tokens + in_page);
}

}  // namespace kvring::cuda::internal
