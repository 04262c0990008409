// CudaAttentionBackend: attention_backend.h's contract on a GPU. The KV of
// the node's attention sequences lives in HBM pages (one cudaMalloc'd pool,
// so the kernels address pages by id), each sequence with page tables of its
// own kept on the device and updated in place as blocks arrive, open, or are
// promoted (never rebuilt from the host per call). Full blocks keep their
// home in the node's BlockStore (host DRAM -> RocksDB), which makes the HBM
// tier inclusive: a full block's HBM page can be dropped at any time and is
// promoted back from the store when attended. Open blocks (being appended
// to) live only in HBM until sealed, and are never dropped.
//
// A step runs on one of `lanes` lanes (a CUDA stream with pinned staging and
// device buffers of its own, so that concurrent requests overlap): the
// queries, appended K/V, positions and table updates go to the device in one
// copy; the update kernel writes the new tokens into their pages and the
// table entries; a gather kernel assembles a batch's page tables (skipped for
// one sequence served from one contiguous run of its table); one attention
// launch serves the whole batch (PagedDecode for few rows a sequence or
// quantized pages, PagedPrefill otherwise); out and LSE come back in one
// copy. No host synchronization between these; one at the end.
//
// Memory: when HBM is full, the full-block pages of the least recently used
// sequence not in a step are dropped (counted as demotions; their blocks stay
// in the store); when nothing can be dropped the answer is
// RESOURCE_EXHAUSTED. Each tenant's HBM pages are capped by its quota.
//
// Errors: a CUDA error in a call becomes INTERNAL naming the CUDA error; the
// backend keeps serving. An error that poisons the CUDA context (an illegal
// address, a launch failure...) marks the backend unhealthy: every later call
// is UNAVAILABLE and `on_fatal` runs once (the daemon exits so that a
// supervisor restarts it; the host and cold tiers keep their blocks).
//
// Layouts the kernels do not take (KV dtypes other than bf16/fp16, head_dim
// other than 64/128/256) are served by a CPU backend inside this one, per
// sequence, so a GPU node answers every request a CPU node answers.
//
// Thread-safe as the interface requires. In a build without CUDA,
// MakeCudaAttentionBackend returns UNIMPLEMENTED.
#pragma once

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "kvring/cache/block_store.h"
#include "kvring/common/thread_pool.h"
#include "kvring/control/attention_backend.h"

namespace kvring {

struct CudaBackendOptions {
  // CUDA device ordinal. Default: 0.
  int device = 0;
  // HBM for sequence pages, cut into pages of `page_bytes` (one allocation).
  // Required: at least one page.
  uint64_t hbm_bytes = 0;
  // Bytes per HBM page: the node's page size (the largest block it takes).
  // Default: 2 MiB (one 16-token Llama-3-8B block).
  uint64_t page_bytes = 2 << 20;
  // Requests on the GPU at once, each with its own stream and staging
  // buffers. More lanes overlap more requests' copies and kernels; each lane
  // holds pinned and device buffers that grow to the largest request it
  // served. Default: 4.
  int lanes = 4;
  // Called once, from the thread that met it, when a CUDA error poisoned the
  // context. Default: none.
  std::function<void(const absl::Status&)> on_fatal;
};

// `store` and `cpu_pool` (optional, for the CPU fallback) are not owned and
// must outlive the backend. FAILED_PRECONDITION when the device does not
// exist; RESOURCE_EXHAUSTED when HBM cannot be allocated.
absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaAttentionBackend(const CudaBackendOptions& options,
                                                                           BlockStore* store, ThreadPool* cpu_pool);

// Host-memory registration with the CUDA driver (cudaHostRegister), for the
// host tier of a GPU node: promotions from it then run at DMA speed.
// UNIMPLEMENTED without CUDA.
absl::Status CudaRegisterHostMemory(void* p, size_t n);
void CudaUnregisterHostMemory(void* p);

}  // namespace kvring
