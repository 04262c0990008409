// AttentionBackend: where a node keeps the KV of the attention sequences it
// serves and how it computes attention over it. Two implementations answer
// the same protocol: CpuAttentionBackend (host pages, the CPU kernels) and
// CudaAttentionBackend (HBM pages with device-resident page tables, the CUDA
// kernels), so a cluster may mix CPU and GPU nodes.
//
// The node core (node_core.h) owns the sequences' bookkeeping (which blocks
// are held, which are open and how far each layer is filled, validation,
// replication semantics) and tells the backend only what to hold and what to
// compute:
//  - a full block of a sequence is named by its store key; its bytes are in
//    the node's BlockStore (host DRAM or the cold tier), and the backend may
//    keep a copy of its own (a GPU node keeps sequence blocks in HBM);
//  - an open block (one being filled by appends) lives only in the backend
//    until every layer of it is filled; then the core reads its bytes out,
//    stores them as an ordinary block, and seals it under its key.
//
// Thread safety: calls may come from many threads at once, but the core
// never runs two calls naming the same sequence at the same time (it holds
// the sequence's lock around each). On error a call changes nothing the core
// can observe (a Step's partial writes into open blocks lie beyond their
// filled counts, which only the core advances).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvring/attention/tensors.h"
#include "kvring/cache/block_meta.h"
#include "kvring/control/attend_batch.h"

namespace kvring {

// A sequence as the backend knows it: its namespace, id and the tenant that
// acts on it (charged for the memory the backend holds for it).
struct SequenceRef {
  NamespaceId ns = 0;
  std::string id;
  TenantId tenant = 0;
};

// `count` appended tokens, rows [src_row, src_row + count) of new_k / new_v,
// written into open block `index` from token `offset` on.
struct StepAppend {
  uint64_t index = 0;
  uint32_t offset = 0;
  uint32_t count = 0;
  uint32_t src_row = 0;
};

// One sequence of a step. Its rows read the blocks of `ranges` (sorted,
// disjoint), which the core checked: each is a full block of `full` (its key
// there, its bytes in the store) or an open block of this backend; block i
// holds min(block_tokens, tokens - i * block_tokens) valid tokens on the
// step's layer (all but the sequence's last block are whole). `full` stays
// valid and unchanged for the call.
struct StepSequence {
  SequenceRef seq;
  std::vector<BlockRange> ranges;
  uint64_t tokens = 0;
  const std::map<uint64_t, BlockKey>* full = nullptr;
  std::vector<StepAppend> appends;   // applied before the attention
  uint32_t row_begin = 0, rows = 0;  // its query rows (rows > 0 iff ranges is non-empty)
  // Its first row in the request's batch: where a device plan's rows are
  // read and written (StepPlan::device; row_begin counts only the
  // sequences in the plan).
  uint32_t src_row = 0;

  uint64_t num_blocks() const {
    uint64_t n = 0;
    for (const BlockRange& r : ranges) n += r.size();
    return n;
  }
  uint32_t BlockTokens(uint64_t index, uint32_t block_tokens) const {
    return static_cast<uint32_t>(std::min<uint64_t>(block_tokens, tokens - index * block_tokens));
  }
};

// One step on one layer: appends, then attention of every query row over its
// sequence's listed blocks.
struct StepPlan {
  BlockLayout layout;                      // of every sequence in the step
  KvEncoding encoding;                     // of the full blocks (open blocks are plain)
  StepShape shape;                         // the batch's, num_rows counting only the plan's rows
  absl::Span<const uint8_t> queries;       // [num_rows, q_heads, head_dim]
  absl::Span<const int64_t> positions;     // [num_rows]
  absl::Span<const uint8_t> new_k, new_v;  // [append rows, kv_heads, head_dim] in layout.dtype
  std::vector<StepSequence> sequences;
  // Set (a backend whose DeviceIoRefusal was ""): queries, positions' rows,
  // new_k/new_v and the output are in the caller's GPU memory, rows at each
  // sequence's src_row; `queries`, `new_k`, `new_v` and Step's `out` are
  // empty. Positions stay on the host, compacted like row_begin.
  const AttendDeviceIo* device = nullptr;
};

struct StepTimes {
  double kernel_seconds = 0;
  double copy_seconds = 0;
  // Set when Step returned with its device work still queued (a device plan
  // with reply_when_queued, on a backend that can): a cudaIpcEventHandle_t
  // that completes with the work. The times are then an earlier step's.
  std::string done_event;
  // Instead of done_event: AttendDeviceIo::done_flag is set to its value
  // on the device once the work is done.
  bool done_flag = false;
};

struct BackendStats {
  std::string name;
  uint64_t pages = 0, free_pages = 0, page_bytes = 0;  // the backend's own page pool (HBM); 0 on the CPU
  uint64_t resident_blocks = 0, hits = 0, misses = 0, demotions = 0, open_blocks = 0;
  // Pages (of `pages`) that more than one sequence's table holds: a fork's
  // blocks shared with its source, kept once.
  uint64_t shared_pages = 0;
  bool healthy = true;
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  // "cpu" or "cuda:<device>".
  virtual std::string name() const = 0;

  // A full block of `seq` was stored on this node (PutSequence). `payload`
  // is the store's host copy. A GPU backend copies it into HBM now;
  // RESOURCE_EXHAUSTED when HBM cannot take it (the block stays in the store
  // and is promoted when attended).
  virtual absl::Status AdmitBlock(const SequenceRef& seq, uint64_t index, const BlockKey& key, const BlockMeta& meta,
                                  absl::Span<const uint8_t> payload) = 0;
  // A new open block `index` of `seq`, zero-filled, plain `layout`.
  // RESOURCE_EXHAUSTED when there is no memory for it.
  virtual absl::Status OpenBlock(const SequenceRef& seq, uint64_t index, const BlockLayout& layout) = 0;
  // Gives an open block's memory back (the core rolls a failed step back).
  virtual void DiscardOpenBlock(const SequenceRef& seq, uint64_t index) = 0;
  // Why this backend cannot run a step whose inputs and output are in a
  // same-host caller's GPU memory (StepPlan::device) for these blocks and
  // queries; "" when it can.
  virtual std::string DeviceIoRefusal(const BlockLayout& layout, const KvEncoding& encoding, DType q_dtype) const {
    return "this node attends on the CPU";
  }
  // Runs the plan's appends, then its attention; writes every row's O
  // [num_rows, q_heads, head_dim] and LSE [num_rows, q_heads] into `out`.
  // Every open block the plan names was opened; every full block is in the
  // node's store under its key.
  virtual absl::Status Step(const StepPlan& plan, PartialOutput out, StepTimes* times) = 0;
  // Copies open block `index` (every layer filled) into `dst`
  // (layout.bytes()).
  virtual absl::Status ReadOpenBlock(const SequenceRef& seq, uint64_t index, absl::Span<uint8_t> dst) = 0;
  // The open block is now full block `key` in the store, stored in
  // `stored` (the sequence's encoding: plain, or quantized from the open
  // block's plain bytes). The backend keeps its copy when it holds the
  // stored bytes (a GPU node, plain) or frees it (CPU; a quantized block,
  // which is read, or promoted, from the store from now on).
  virtual void SealBlock(const SequenceRef& seq, uint64_t index, const BlockKey& key, const KvEncoding& stored) = 0;
  // The sequence ended (its tenant was deleted): gives back everything the
  // backend holds for it, open blocks included.
  virtual void ForgetSequence(const SequenceRef& seq) = 0;
  // Per-tenant cap on the bytes the backend holds for a tenant's sequences
  // (the tenant's pinned-bytes quota; UINT64_MAX: none).
  virtual void SetTenantQuota(TenantId tenant, uint64_t max_bytes) = 0;
  virtual BackendStats stats() = 0;
  // Bytes of the backend's own memory (HBM pages) charged to `tenant`'s
  // sequences; 0 for a backend without one.
  virtual uint64_t TenantBytes(TenantId tenant) { return 0; }
};

}  // namespace kvring
