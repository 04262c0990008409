// Part of the ring library (attention/ring/, target kvring_ring_gpu): a library
// that kvringd does not serve yet. The daemons serve pass-Q as the Attend
// call, fanned out by the client; these rings are exercised by tests and
// benches (bench/gpu/ring_bench.cu, bench/gpu/multi_gpu.sh).
//
// Rings of GPU shards: pass-KV and pass-Q over a Transport with device
// buffers (NcclTransport between GPUs, DeviceLoopbackTransport between ranks
// sharing one GPU). The same algorithms as the CPU rings (attention/ring/, kvring/attention/ring/ring.h),
// on device memory with the CUDA kernels:
//  - every rank holds one sequence's queries (any number of rows, possibly
//    none) and the pages of that sequence it owns (in position order);
//  - pass-KV: a rank's KV pages of the layer travel packed (one contiguous
//    buffer plus positions) around the ring, N-1 hops; each rank attends its
//    queries over every chunk and merges into its output (MergeInto);
//  - pass-Q: query chunks travel, N-1 hops; each rank attends every chunk
//    over its own KV; partials return to their owners in one all-to-all and
//    merge (MergePartials).
// Each step posts the next receive and the current send, flushes, then
// computes on the chunk in hand: communication overlaps the kernel (double
// buffering). Collective: all ranks call with the same options.
// Errors: statuses (cuda / transport); a failed rank makes its peers time
// out (DEADLINE_EXCEEDED), never return a partial result as complete.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvring/attention/cuda/paged_attention_cuda.h"
#include "kvring/transport/transport.h"

namespace kvring::cuda {

struct GpuRingOptions {
  absl::Duration timeout = absl::Seconds(60);
  cudaStream_t stream = nullptr;  // compute stream
};

struct GpuRingStats {
  double total_ms = 0;    // wall time of the call
  double compute_ms = 0;  // kernel time (CUDA events), summed over steps
  double wait_ms = 0;     // host time blocked on the transport after compute finished
  uint64_t bytes_sent = 0;
  int steps = 0;
};

absl::Status GpuRingPassKv(Transport& t, const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                           const GpuRingOptions& o, GpuRingStats* stats = nullptr);
absl::Status GpuRingPassQ(Transport& t, const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                          const GpuRingOptions& o, GpuRingStats* stats = nullptr);

// Single-GPU partial attention picking the kernel: decode (split-KV, CUDA
// cores) for few rows per sequence, prefill (tensor cores) otherwise.
// Allocates the decode workspace itself (stream-ordered).
absl::Status AttendLocal(const AttnParams& p, const QueryView& q, const PagedKvView& kv, OutputView out,
                         int max_pages_per_seq, cudaStream_t stream);

}  // namespace kvring::cuda
