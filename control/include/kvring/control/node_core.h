// NodeCore: what a daemon does for each request, independent of how the
// request arrived (gRPC: NodeService; UCX: UcxDataPlane, both thin adapters
// over node_wire.h, which parses the wire's messages into these types).
//
// Every call takes native types: keys, blocks with payload spans, held
// blocks out (PinnedBlock), and for Attend attend_batch.h (spans into the
// request's own buffers) with its output written into the caller's
// buffers; the attention
// itself runs on the node's AttentionBackend (CPU or CUDA). Attention
// sequences: blocks stored with PutSequence and blocks the node builds from
// appended K/V (Attend with new_k/new_v: decode in place). An append must
// continue each layer's tail on this node; once every layer of a block is
// filled the block is stored like any other (key: SequenceBlockKey) and
// recorded in the sequence table.
//
// Every request is authenticated (the tenant comes from the token, the
// namespace from the tenant) and validated (request_validation.h) before any
// of it is used; errors are statuses with messages, never crashes. A tenant
// only ever sees blocks of its own namespace or a shared one it belongs to.
// Payload bytes are never logged.
//
// Thread-safe: handlers run concurrently on the server's threads.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvring.pb.h"
#include "kvring/cache/block_store.h"
#include "kvring/common/clock.h"
#include "kvring/common/metrics.h"
#include "kvring/control/attend_batch.h"
#include "kvring/control/attention_backend.h"
#include "kvring/control/auth.h"
#include "kvring/control/device_delivery.h"
#include "kvring/control/request_validation.h"
#include "kvring/control/sequence_table.h"

namespace kvring {

struct ReclaimResult {
  uint64_t tenants = 0, blocks = 0, sequences = 0;
};

struct NodeCoreOptions {
  // This node's id, reported by Stats. Default: empty.
  std::string node_id;
  // The UCX data plane's address, advertised in Stats. Default: empty (none).
  std::string ucx_address;
  // Limits every request is validated against (request_validation.h).
  RequestLimits limits;
  // Check each block's checksum again before copying it into a same-host
  // caller's GPU memory. The bytes were checked when they entered the host
  // tier (and when read back from the cold tier), and the copy is one DMA
  // (PCIe is CRC-protected); this re-check of DRAM-resident bytes costs host
  // memory bandwidth the copies compete for: on the H200 host 19 GB/s with
  // it against 49 GB/s without (docs/DEVICE-DELIVERY.md). Default: false.
  bool delivery_checksum = false;
  // The time source of idle expiry (not owned; null: the system clock).
  const Clock* clock = nullptr;
};

struct LookupResult {
  uint32_t prefix_length = 0;
  std::vector<bool> held;  // with `each`: one per key
};

// A block of a Put, validated by the wire layer (layout, encoding, sizes).
struct PutBlockIn {
  BlockKey key, parent;  // parent zero: the first block of a chain
  BlockMeta meta;        // checksum 0: none given
  absl::Span<const uint8_t> payload;
  bool pin = false;                          // leave it pinned by the tenant
  const std::string* sequence_id = nullptr;  // a block of an attention sequence (PutSequence)
  uint64_t block_index = 0;
  // With sequence_id: no payload; the block this node holds under `key` (a
  // prefix-cache chain's, of meta.layout) becomes the sequence's block
  // `block_index`, shared (NOT_FOUND when the node does not hold it).
  bool by_reference = false;
};
struct PutOutcome {
  absl::Status status;
  bool inserted = false;  // false: already held (deduplicated)
};

// Where a same-host caller wants a Get's blocks in its GPU memory
// (kvring.proto DevicePlace; validated: one place per key).
struct DeviceTarget {
  std::string host_id;
  std::vector<std::string> handles;  // cudaIpcMemHandle_t bytes, one per allocation
  struct Place {
    uint32_t allocation = 0;
    uint64_t offset = 0, capacity = 0;
  };
  std::vector<Place> places;
};
// Where a same-host caller's Attend reads its inputs and writes its output
// (kvring.proto DeviceExchange): byte offsets into one allocation.
struct DeviceExchangeIn {
  std::string host_id;
  std::string ipc_handle;  // cudaIpcMemHandle_t bytes
  uint64_t queries = 0, new_k = 0, new_v = 0, out = 0, lse = 0;
  std::string inputs_ready_event;  // cudaIpcEventHandle_t bytes, or empty
  bool reply_when_queued = false;  // with inputs_ready_event: AttendStats::done_event may answer
  // With reply_when_queued: the word the node's stream sets to
  // done_flag_value when the work is done (value 0: none, an event instead).
  uint64_t done_flag = 0;
  uint32_t done_flag_value = 0;
};
struct GetBlockOut {
  absl::Status status;
  PinnedBlock block;  // OK: the block, held (its payload stays valid while held)
};
struct GetOut {
  std::vector<GetBlockOut> blocks;  // one per key
  bool delivered_to_device = false;
  std::string device_refusal;
};

// A node's Stats: its store, sequences, backend and the caller's usage.
struct NodeReport {
  std::string node_id, ucx_address;
  BlockStoreStats store;
  uint64_t sequences = 0, open_blocks = 0;
  TenantUsage tenant;
  // The caller's sequences here (its own namespace).
  uint64_t tenant_sequences = 0, tenant_sequence_blocks = 0, tenant_sequence_bytes = 0, tenant_sequence_open_blocks = 0;
  // Its full blocks by tier (a block shared by several of its sequences
  // counts once a sequence), and its HBM bytes (the backend's pages).
  uint64_t tenant_sequence_host_blocks = 0, tenant_sequence_cold_blocks = 0, tenant_sequence_hbm_bytes = 0;
  bool has_cold_tier = false;
  ColdTierStats cold;
  BackendStats backend;
  uint64_t device_delivered_bytes = 0;
};

// What DeleteSequence / TruncateSequence changed on this node.
struct SequenceChange {
  bool held = false;                 // this node held any of the sequence
  uint64_t blocks_erased = 0;        // full blocks of the sequence erased from the store
  uint64_t open_blocks_dropped = 0;  // open blocks given back (or, truncating, cut to nothing)
};

// A block of a sequence as ReadSequence returns it.
struct SequenceBlockOut {
  uint64_t index = 0;
  BlockKey key;                  // a full block's store key (zero for an open block)
  BlockMeta meta;                // layout, encoding, payload bytes, checksum
  std::vector<uint32_t> filled;  // an open block: tokens per layer (empty: full)
  std::vector<uint8_t> bytes;
};

// What ForkSequence did on this node.
struct ForkChange {
  bool held = false;           // this node held some of the source below the fork point
  uint64_t blocks_shared = 0;  // full blocks of the source the fork now holds too
  uint64_t blocks_copied = 0;  // partly filled blocks copied into open blocks of the fork
  uint64_t source_tokens = 0;  // the source's tokens here (its highest position + 1, layer 0)
};

class OpScope;

class NodeCore {
 public:
  // None of the pointers is owned; all must outlive the core. `delivery`
  // (optional; GPU nodes): Get into the GPU memory of callers on this host.
  NodeCore(NodeCoreOptions options, BlockStore* store, SequenceTable* sequences, AttentionBackend* backend,
           TenantDirectory* tenants, MetricsRegistry* metrics, DeviceDelivery* delivery = nullptr);

  absl::StatusOr<v1::Tenant> Authenticate(const std::string& token) const { return tenants_->ByToken(token); }
  TenantDirectory* tenants() const { return tenants_; }

  // Every call names the namespace it acts in as the request header spells
  // it ("" = the tenant's own; else one of its shared namespaces). The wire's
  // messages are parsed into these types by node_wire.h.

  // The longest held prefix of `keys` and, with `each`, whether each is held.
  absl::StatusOr<LookupResult> Lookup(const v1::Tenant& t, const std::string& ns, absl::Span<const BlockKey> keys,
                                      bool each);
  // Stores each block; `quantize` ("" = the tenant's encoding) is what plain
  // blocks become. Blocks succeed or fail one by one (the returned statuses);
  // the call's own status is for the request as a whole.
  absl::StatusOr<std::vector<PutOutcome>> Put(const v1::Tenant& t, const std::string& ns, const std::string& quantize,
                                              absl::Span<const PutBlockIn> blocks);
  // Reads each block: held in the store (PinnedBlock) for the caller to send.
  // With `device` (a caller on this host, this node with a GPU) the blocks are
  // copied into the caller's GPU memory instead, each after its checksum
  // check when delivery_checksum is on (GetOut::delivered_to_device); a node
  // that cannot deliver answers with held blocks and says why in
  // GetOut::device_refusal.
  absl::StatusOr<GetOut> Get(const v1::Tenant& t, const std::string& ns, absl::Span<const BlockKey> keys,
                             const DeviceTarget* device = nullptr);
  // Whether Get(t, ns, keys) would not touch the disk tier (every block in
  // host memory or not held; a request that fails validation counts as staying).
  bool GetStaysInMemory(const v1::Tenant& t, const std::string& ns, absl::Span<const BlockKey> keys);
  // Pins (or unpins) each block for the tenant; one status per key.
  absl::StatusOr<std::vector<absl::Status>> Pin(const v1::Tenant& t, const std::string& ns,
                                                absl::Span<const BlockKey> keys, bool unpin);
  // Appends, then attends, for every sequence of the batch; writes
  // out.out [num_rows, q_heads, head_dim] and out.lse [num_rows, q_heads].
  // `requested_ns`: the request header's namespace (empty: the tenant's).
  // Sequences succeed or fail one by one: a sequence this node cannot serve
  // (a block it does not hold, an append that does not continue its tail)
  // gets its own status in stats->sequence_status, its rows O = 0 and
  // LSE = -inf, and is left unchanged; the others are served. The returned
  // status is the request's (malformed, unauthorized, a backend failure: then
  // nothing was appended), or the sequence's own for a batch of one.
  absl::Status Attend(const v1::Tenant& t, const std::string& requested_ns, const AttendBatch& batch, PartialOutput out,
                      AttendStats* stats);
  // The same with the batch's queries, appended K/V and output in a
  // same-host caller's GPU memory (kvring.proto DeviceExchange; `batch`
  // parsed without bulk bytes): maps the caller's allocation, checks every
  // region against it, and runs the step on the device there. A node that
  // cannot (no GPU, another host, memory it cannot map, blocks or queries
  // its kernels do not take) does nothing, returns OK and says why in
  // stats->device_refusal. Rows of sequences not served are left unwritten.
  absl::Status AttendOnDevice(const v1::Tenant& t, const std::string& requested_ns, AttendBatch batch,
                              const DeviceExchangeIn& exchange, AttendStats* stats);
  // Ends a sequence on this node: its full blocks leave every tier (those
  // stored under the sequence's own keys; blocks PutSequence named by other
  // keys, e.g. a prefix-cache chain, stay as ordinary cached blocks), its
  // open blocks and backend memory (HBM) are given back (and their charge to
  // the tenant's budget), its records are deleted. Idempotent: an id this
  // node does not hold is OK with held = false.
  absl::StatusOr<SequenceChange> DeleteSequence(const v1::Tenant& t, const std::string& ns, const std::string& id);
  // Cuts a sequence back to its first `tokens` tokens on every layer (a
  // layer with fewer keeps what it has): blocks past the cut go as in
  // DeleteSequence; the block holding token `tokens` keeps its first
  // tokens % block_tokens tokens as an open block (a sealed one is reopened
  // from the store's copy), so that the next append at `tokens` is a new
  // token, not a conflict. Idempotent. FAILED_PRECONDITION when the cut
  // falls inside a quantized block (its plain bytes are gone).
  absl::StatusOr<SequenceChange> TruncateSequence(const v1::Tenant& t, const std::string& ns, const std::string& id,
                                                  uint64_t tokens);
  // Starts sequence `id` as the first `tokens` tokens of `source` (same
  // namespace), for what this node holds of the source: its full blocks
  // below the fork point are shared (recorded under the fork too, counted:
  // a block leaves the store only when no sequence holds it), the block
  // holding token `tokens` and any open block below it are copied into open
  // blocks of the fork (on every layer, their first tokens up to the fork
  // point). Records `placement` for the fork (every node is sent it, also
  // one holding nothing of the source). Idempotent: the same fork again is
  // OK and changes nothing. ALREADY_EXISTS when `id` is another sequence
  // here; FAILED_PRECONDITION when an open block of the source here holds
  // fewer tokens than the fork point needs, or the fork point falls inside a
  // quantized block. On error nothing of the fork stays.
  absl::StatusOr<ForkChange> ForkSequence(const v1::Tenant& t, const std::string& ns, const std::string& source,
                                          const std::string& id, uint64_t tokens, const SequencePlacement& placement);
  // The blocks this node holds of sequence `id` in [begin, end) (at most
  // 64), full ones from the store and open ones from the backend (with
  // their filled counts): what a client copies onto a new replica.
  absl::StatusOr<std::vector<SequenceBlockOut>> ReadSequence(const v1::Tenant& t, const std::string& ns,
                                                             const std::string& id, uint64_t begin, uint64_t end);
  // Deletes, as DeleteSequence does, every sequence of a tenant with a
  // sequence TTL (Tenant.sequence_ttl_s) that no call has named on this
  // node for longer than that (sequences in the tenant's own namespace; a
  // sequence recovered at start counts from the first sweep). Returns how
  // many. Call periodically, off the request path (kvringd: every
  // heartbeat).
  absl::StatusOr<uint64_t> ExpireIdleSequences();
  // The caller's sequences here, by id (kvring.proto SequenceInfo); only
  // those of `ids` when it is not empty.
  absl::StatusOr<std::vector<v1::SequenceInfo>> ListSequences(const v1::Tenant& t, const std::string& ns,
                                                              absl::Span<const std::string> ids = {});
  const RequestLimits& limits() const { return options_.limits; }
  // The node's counters and tiers, and the tenant's usage.
  NodeReport Stats(const v1::Tenant& t);

  // Applies every tenant's pinned-bytes quota to the store (after the
  // directory changes).
  void ApplyQuotas();
  // Reclaims what deleted tenants left on this node (the directory's
  // tombstones): every block of their namespaces in every tier, pinned or
  // not, and their attention sequences (records and backend memory). Their
  // blocks were unreachable from the moment of the delete (a namespace is
  // bound to a tenant id, never reused); this frees the space. Idempotent;
  // each tombstone is processed once per process (after a restart, once
  // again: the cold tier may have brought blocks back). Slow on a big store:
  // call it off the request path.
  absl::StatusOr<ReclaimResult> ReclaimDeletedTenants() ABSL_LOCKS_EXCLUDED(reclaim_mu_);

 private:
  struct OpMetrics {
    CounterMetric* requests;
    CounterMetric* errors;
    HistogramMetric* latency;
  };
  OpMetrics Op(const std::string& name);
  absl::StatusOr<NamespaceId> Namespace(const v1::Tenant& t, const std::string& requested) const;
  // Why this node will not deliver into the caller's device memory ("": it will).
  std::string DeviceRefusal(const std::string& caller_host) const;
  // A device exchange this node will not run: `why` into stats (OK: the
  // request did nothing, the caller sends it again without).
  absl::Status RefuseDeviceIo(std::string why, AttendStats* stats) const;
  // Get's device path: blocks checked, then copied into the caller's memory.
  // FAILED_PRECONDITION when the caller's memory cannot be mapped.
  absl::Status GetIntoDevice(NamespaceId ns, absl::Span<const BlockKey> keys, const DeviceTarget& device, GetOut* out);
  // A sequence block that arrived by Put: recorded, then offered to the backend.
  absl::Status AddSequenceBlock(const v1::Tenant& t, NamespaceId ns, const std::string& id, uint64_t index,
                                const BlockKey& key, const BlockMeta& meta, absl::Span<const uint8_t> payload);
  absl::Status PlanSequence(NamespaceId ns, TenantId tenant, const AttendBatch& b, size_t i, uint32_t row,
                            uint32_t arow, const BlockLayout& L, SequenceTable::Handle& h, StepSequence* ss,
                            std::vector<uint64_t>* opens);
  // Attend's stages, in order, over one AttendWork (node_core.cc):
  //  ResolveShape: the layout and encoding the sequences share; a sequence
  //    that cannot take part fails alone, a request that mixes shapes fails.
  //  Then the queries are checked against that shape (CheckStepShape), and
  //    a device exchange this backend will not run is refused, before
  //    anything changed.
  //  PlanStep: each sequence's appends and blocks (PlanSequence), then one
  //    StepPlan over those that planned, their rows compacted.
  //  RunStep: open the new blocks, the backend's Step, rows scattered back;
  //    a failure undoes the opens. CommitStep: filled counts, sealed blocks.
  //  Finish: failed sequences' rows, metrics and stats.
  struct AttendWork;
  absl::Status ResolveShape(NamespaceId ns, const AttendBatch& b, AttendWork& w);
  void PlanStep(NamespaceId ns, TenantId tenant, const AttendBatch& b, AttendWork& w);
  absl::Status RunStep(const AttendBatch& b, PartialOutput out, AttendWork& w);
  // A step over a quantized sequence's full blocks and its plain open tail:
  // the backends read one encoding a step, so it runs as two (the appends
  // and the full blocks, then the open blocks) and each row's partials merge
  // by LSE (exact). Host rows only: Attend refuses such a device exchange.
  static bool ReadsOpenTailOfQuantized(const StepPlan& plan);
  absl::Status StepTwoEncodings(const StepPlan& plan, PartialOutput out, StepTimes* times);
  void CommitStep(TenantId tenant, const AttendBatch& b, AttendWork& w);
  absl::Status RollBack(const StepPlan& plan, const std::vector<std::pair<size_t, uint64_t>>& opened, absl::Status why);
  absl::Status Finish(OpScope& op, std::chrono::steady_clock::time_point t0, const AttendBatch& b, const AttendWork& w,
                      PartialOutput out, AttendStats* stats);
  // OK when this node holds exactly the appended tokens [off, off + count)
  // of block `idx` on `layer` (a retried append); FAILED_PRECONDITION if
  // they differ.
  absl::Status SameTokens(NamespaceId ns, SequenceTable::Handle& h, uint64_t idx, uint32_t layer, uint32_t off,
                          uint32_t count, const AttendBatch& b, uint32_t src_row, const BlockLayout& L);
  // Forgets the sequence's full blocks from index `first` on, erasing from
  // the store those no sequence holds any more (EraseReleased).
  absl::Status DropFullBlocksFrom(SequenceTable::Handle& h, uint64_t first, SequenceChange* c);
  // Erases released blocks the node made (owned, or a sequence's own key
  // under layout `L`) from the store.
  void EraseReleased(const SequenceTable::Handle& h, const std::optional<BlockLayout>& L,
                     const std::vector<ReleasedBlock>& released, SequenceChange* c);
  // The key a block sealed from appends is stored under: the sequence's own
  // key for it, or a later generation of it while another sequence holds a
  // block under that key.
  BlockKey SealKey(SequenceTable::Handle& h, uint64_t index, const BlockLayout& L);
  // The sequences of namespace `ns` held here, or only `ids` (ListSequences;
  // Stats sums them).
  std::vector<v1::SequenceInfo> DescribeSequences(NamespaceId ns, absl::Span<const std::string> ids = {});
  // Learns a sequence's layout and encoding from its first full block when
  // this process has not seen them (after a restart the table holds only
  // keys); OK with nothing to learn. The error names the block.
  absl::Status LearnLayout(NamespaceId ns, SequenceState& st);
  // A block that keeps some of its tokens at a cut at `tokens` (truncate,
  // fork): its bytes, and per layer its tokens below the cut.
  struct KeptBlock {
    uint64_t index = 0;
    std::vector<uint32_t> filled;
    std::vector<uint8_t> bytes;
  };
  // The open blocks below the cut and the sealed block the cut falls in
  // (read from the store; FAILED_PRECONDITION when it is quantized or in
  // another layout, `cut` naming the operation in the message).
  absl::StatusOr<std::vector<KeptBlock>> KeptBlocks(SequenceTable::Handle& h, TenantId tenant, const BlockLayout& L,
                                                    uint64_t tokens, absl::string_view cut);
  // Put's work on a block by reference (PutBlockIn::by_reference).
  absl::Status RecordByReference(TenantId tenant, NamespaceId ns, const PutBlockIn& b);
  // ForkSequence's work on the locked source and fork.
  absl::StatusOr<ForkChange> ForkLocked(SequenceTable::Handle& src, SequenceTable::Handle& dst, TenantId tenant,
                                        uint64_t tokens);
  // DeleteSequence's work on a locked sequence.
  absl::StatusOr<SequenceChange> ForgetLocked(SequenceTable::Handle& h, TenantId tenant);
  absl::Time Now() const { return options_.clock != nullptr ? options_.clock->Now() : absl::Now(); }
  // Opens block `index` in the backend and appends, per layer, its first
  // filled[l] tokens from `bytes` (the block layout's bytes).
  absl::Status Reopen(const SequenceRef& ref, uint64_t index, const std::vector<uint32_t>& filled,
                      absl::Span<const uint8_t> bytes, const BlockLayout& L);
  // Stores every complete open block of the sequence as an ordinary block,
  // in its full blocks' encoding, or in `seal` when it has none yet.
  uint32_t SealCompleteBlocks(TenantId tenant, SequenceTable::Handle& h, const KvEncoding& seal);

  NodeCoreOptions options_;
  BlockStore* store_;
  SequenceTable* sequences_;
  AttentionBackend* backend_;
  TenantDirectory* tenants_;
  MetricsRegistry* metrics_;
  DeviceDelivery* delivery_;
  std::string host_id_;  // this host's boot id ("" if unknown: no device delivery)
  OpMetrics lookup_, put_, get_, pin_, attend_, stats_, sequence_ops_;
  CounterMetric* put_bytes_;
  CounterMetric* quantized_;
  CounterMetric* get_bytes_;
  CounterMetric* device_bytes_;
  CounterMetric* device_exchanges_;
  CounterMetric* appended_tokens_;
  CounterMetric* sealed_blocks_;
  HistogramMetric* attend_kernel_;
  CounterMetric* reclaimed_blocks_;
  CounterMetric* expired_sequences_;
  absl::Mutex reclaim_mu_;
  absl::flat_hash_set<uint32_t> reclaimed_ ABSL_GUARDED_BY(reclaim_mu_);
  friend class OpScope;
};

}  // namespace kvring
