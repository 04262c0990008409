// What a prefill CTA works out before its main loop (internal; used by
// paged_prefill_cuda.cu and paged_prefill_sm90_cuda.cu).
#pragma once

#include "device_ptx.cuh"
#include "page_access.cuh"

namespace kvring::cuda::internal {

// Min and max of positions[0, n) over the CTA: every thread calls it (it
// holds two __syncthreads); s_min / s_max are two shared ints of the caller.
__device__ __forceinline__ int2 BlockMinMax(const int32_t* positions, int n, int* s_min, int* s_max) {
  if (threadIdx.x == 0) {
    *s_min = INT32_MAX;
    *s_max = INT32_MIN;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < n; r += blockDim.x) {
    atomicMin(s_min, positions[r]);
    atomicMax(s_max, positions[r]);
  }
  __syncthreads();
  return make_int2(*s_min, *s_max);
}
// The stream tokens that rows with positions in [qmin, qmax] can see (causal
// and window masks): [x, y), x rounded down to a multiple of `tile`.
__device__ __forceinline__ int2 VisibleKeys(const AttnParams& p, const PagedKvView& kv, int pb, int npages, int ntok,
                                            int qmin, int qmax, int tile) {
  int n_end = ntok, n_begin = 0;
  if (p.causal) n_end = CountUpTo(kv, pb, npages, ntok, qmax);
  if (p.window > 0) n_begin = CountUpTo(kv, pb, npages, ntok, qmin - p.window);
  return make_int2((n_begin / tile) * tile, n_end);
}

}  // namespace kvring::cuda::internal
