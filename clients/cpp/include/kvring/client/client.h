// kvring::Client: what an inference engine links to use a kvring cluster.
//
// Connect() asks the coordinator who the token belongs to (its tenant and
// namespace) and for the shard map, which it caches and refreshes (every
// `map_refresh`, and at once after a node failure); data never passes
// through the coordinator. Each block goes to its home shards by consistent
// hashing (R replicas, W acknowledgements); reads try the replicas in
// preference order and move on when one is down or misses; every payload
// read back is checked against its XXH3-64 checksum (DATA_LOSS, never
// served, if it does not match). Bulk payloads use a daemon's UCX data plane
// when it advertises one, gRPC otherwise.
//
// Attention sequences are placed by sequence (contiguous chunks of blocks,
// each chunk on R shards). Step() sends the queries to one live replica
// of every chunk at once (pass-Q fan-out), each shard attends over exactly
// the block ranges it is told to, and the partials merge exactly; if some
// chunk has no live replica the answer is UNAVAILABLE, never a partial
// result. A step may also carry the new tokens' K and V for its layer (decode
// in place, or a prefill chunk): they are appended on the write replicas of
// the chunks that own the sequence's tail (the attending replica in the same
// request), so an engine that offloads a sequence keeps no KV for it. One
// request per shard carries every sequence of the batch.
//
// Thread-safe: one Client may be used from many threads.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvring/attention/tensors.h"
#include "kvring/cache/block_key.h"
#include "kvring/cache/block_meta.h"
#include "kvring/client/sequence.h"
#include "kvring/common/tls_config.h"
#include "kvring/layout/kv_encoding.h"
#include "kvring/transport/ucx_rpc.h"

namespace kvring {

struct ClientOptions {
  // The coordinator's gRPC address (host:port), or every coordinator of a
  // cluster that runs several (host:port,host:port,...: calls move on to the
  // leader; coordinator_channel.h). Default: 127.0.0.1:7000.
  std::string coordinator = "127.0.0.1:7000";
  // The tenant's bearer token (required).
  std::string token;
  // Namespace to act in: empty for the tenant's own, or one of its shared
  // namespaces ("shared/<name>"). Default: empty.
  std::string ns;
  // Use a daemon's UCX data plane for payloads when it has one (else gRPC
  // carries them). Default: true.
  bool use_ucx = true;
  // How the client's UCX progress threads wait (latency against a busy
  // core; ucx_rpc.h). Default: the host-size-dependent spin, sleeping between.
  UcxLoopOptions ucx_loop;
  // Deadline of each call to one node; a node that misses it counts as down
  // for this call (its replicas are tried). Default: 10 s.
  absl::Duration rpc_timeout = absl::Seconds(10);
  // How often the shard map is refreshed from the coordinator (also at once
  // after a node failure). Shorter: node changes seen sooner, more
  // coordinator calls. Default: 2 s.
  absl::Duration map_refresh = absl::Seconds(2);
  // Largest Put/Get message to one node; bigger batches are split (and their
  // parts sent in parallel). Must not exceed the daemons' max_message_bytes.
  // Default: 64 MiB.
  uint64_t max_batch_bytes = 64ull << 20;
  // Fan-out threads: the most calls to nodes in flight at once. 0: 16.
  size_t threads = 0;
  // Have the nodes quantize plain blocks at Put into this encoding (int8 or
  // fp8 codes; per-head, per-token or KIVI scales); a plain KvEncoding{}
  // stores them plain; nullopt: the tenant's kv_encoding. Get then returns
  // the codes (meta.encoding says which; DequantizeBlock restores the dtype)
  // and Attend reads them directly. The same choice applies to the blocks a
  // step's appends complete (a sequence built by decode or chunked prefill
  // is sealed in this encoding, block by block; a sequence that already has
  // full blocks on a node keeps theirs). Flags and the C ABI spell it as a string
  // ("int8/kivi", "none", "" for the tenant's): ParseQuantizeOption.
  // Default: nullopt.
  std::optional<KvEncoding> quantize;
  // Same-host GPU memory (CUDA IPC), with GPU nodes on this host:
  //  - GetInto on_device: the node copies the blocks straight into the
  //    destinations (one DMA from its host tier, no network, no staging
  //    here). Needs destinations in cudaMalloc memory (the default of
  //    torch's allocator; not cudaMallocAsync pools or expandable segments,
  //    which fall back).
  //  - Step with device_buffers: the node reads the queries and appended K/V
  //    and writes its partial in an exchange buffer this client allocates
  //    (cudaMalloc, outside the engine's allocator), and the partials are
  //    merged on the device.
  // Elsewhere, and with false, bytes cross the network through pinned
  // staging. Default: true.
  bool device_delivery = true;
  // A step with device tensors goes through the exchange when its queries,
  // appended K/V and partials come to at least this many bytes; smaller
  // steps are staged. Default: 0, every such step, decode included: under
  // MPS (what the GPU deployments start) a decode step inside transformers'
  // generate took 313 us through the exchange against 429 us staged
  // (bench/RESULTS.md). Without MPS the exchange's gather and merge each pay
  // a GPU context switch: there, 1 MiB keeps decode steps staged.
  uint64_t device_exchange_min_bytes = 0;
  // A step on the caller's stream (AttendStep::stream_ordered) lets a GPU
  // node on this host answer once its work is queued: the caller's stream
  // waits on the device for a word of the exchange buffer that the node's
  // stream sets when the work is done (DeviceExchange.reply_when_queued,
  // done_flag_offset), not this thread on the node's kernel. Asked only
  // where this process's driver has stream memory operations (the word);
  // a node that cannot set it answers with an event or once done. Inside
  // transformers' generate (H200, 32K): the step on the stream 301 us
  // against 418 answered once done on 1 shard, 388 against 432 on 4, and
  // tokens/s 1-7% higher (bench/RESULTS.md). (Answering early by an
  // interprocess event instead cost tokens/s: docs/MPS.md.) Default: true.
  bool node_reply_when_queued = true;
  // With node_reply_when_queued: a decode step on the caller's stream whose
  // nodes all take its request at once returns without waiting for their
  // replies: the waits on the nodes' words and the merge are queued on the
  // stream right after the requests go, and the replies are collected on a
  // thread of the client's (at most 8 steps ahead of them). A step that
  // failed there is not retried on another replica: its node's word is set
  // so that the stream goes on, and the next Step (or a call that changes a
  // sequence, which first waits for the replies in flight) returns the
  // error: the failed step's output, and what the engine computed from it,
  // are wrong. Measured on an H100 (bench/RESULTS.md, "Detached steps"):
  // the engine's call about half as long, tokens/s higher on 4 shards; not
  // the default until a failed step is recomputed on another replica
  // (docs/PERFORMANCE-NOTES.md). Default: false.
  bool detach_device_steps = false;
  // TLS towards the coordinator and the nodes (common/tls_config.h): set
  // tls.ca_file (and cert_file/key_file for mutual TLS). With TLS on,
  // payloads go over gRPC: use_ucx is ignored (UCX is not encrypted).
  TlsConfig tls;
};

// ClientOptions::quantize from its spelling: "" -> nullopt (the tenant's
// encoding), "none" -> plain, "int8", "fp8/kivi"... -> that encoding;
// INVALID_ARGUMENT naming the text otherwise.
absl::StatusOr<std::optional<KvEncoding>> ParseQuantizeOption(std::string_view text);

struct BlockData {
  BlockKey key;
  BlockKey parent;  // zero for the first block of a sequence
  BlockLayout layout;
  KvEncoding encoding;
  absl::Span<const uint8_t> payload;
  bool pin = false;
  // The payload is GPU memory (e.g. a slice of an engine's KV pool): it is
  // copied to pinned host memory once, then sent.
  bool payload_on_device = false;
};

struct GetResult {
  absl::Status status;
  BlockMeta meta;
  BlockKey parent;
  std::vector<uint8_t> payload;
  std::string node_id;  // which replica answered
  // GetInto on_device: the node copied the block into the destination itself
  // (same host, CUDA IPC), instead of sending it.
  bool delivered_in_place = false;
};

struct PutReport {
  uint64_t blocks = 0, inserted = 0, replicas_written = 0, bytes = 0;
};

struct AttendReport {
  int shards = 0;
  // Of those, the shards that read the queries and wrote their partials in
  // this process's GPU memory (device tensors, a GPU node on this host).
  int shards_in_place = 0;
  uint64_t blocks = 0;
  // Serialized request and reply bytes (queries, appended K/V, block ranges,
  // partials).
  uint64_t bytes_sent = 0, bytes_received = 0;
  int retries = 0;
  // Write replicas brought up to date from another (their chunk's blocks
  // copied) before they took the step's append: the new replica after a
  // node's death.
  int repairs = 0;
  uint32_t appended_tokens = 0;  // per replica that acknowledged
  double seconds = 0;            // the whole call
  // The slowest shard's own time on its request, and within it the
  // attention computation and the host<->device copies (GPU nodes).
  double node_seconds = 0, kernel_seconds = 0, copy_seconds = 0;
  double merge_seconds = 0;  // merging the shards' partials here
  // Where the rest of `seconds` went, at this end: checking and routing the
  // step (before the first request), the device-tensor copies into the
  // exchange buffer (and waiting for them where not stream-ordered), and the
  // slowest shard's requests (send to reply) with, of that, the part outside
  // its node's own time (`transport`: messages, wake-ups, this end's
  // serialization).
  double plan_seconds = 0, stage_seconds = 0, round_trip_seconds = 0, transport_seconds = 0;
  // A stream-ordered step (AttendStep::stream_ordered) whose nodes waited
  // for the inputs on the device (an event on the caller's stream), not the
  // client on the host.
  bool inputs_waited_on_device = false;
  // Shards (of shards_in_place) that answered once the step's work was
  // queued on their GPU, not done: the merge waits for it on the caller's
  // stream (an event each), so the caller's thread never waits for a node's
  // kernel.
  uint32_t shards_replied_queued = 0;
  // Of those, the shards whose work the stream waited for by a word the
  // node's stream set in the exchange buffer (AttendResponse.done_flag), not
  // by an interprocess event.
  uint32_t shards_done_by_flag = 0;
  // Shards whose replies this step did not wait for
  // (ClientOptions::detach_device_steps): they are collected later, and a
  // failure among them is returned by a later call.
  uint32_t shards_detached = 0;
};

// One sequence of an attention step.
struct AttendSequence {
  std::string sequence_id;
  // Tokens of the sequence already in kvring on the step's layer.
  uint64_t context_tokens = 0;
  // Query rows of this sequence: the next `rows` rows of the step's queries.
  uint32_t rows = 0;
  // New tokens whose K/V this step appends (the next `append_tokens` rows of
  // new_k / new_v), at positions [context_tokens, context_tokens + append_tokens).
  uint32_t append_tokens = 0;
};

// A batched step of one layer: query rows grouped by sequence, positions
// required (q.seq_ids unused); rows see the sequence's tokens causally,
// appended ones included.
struct AttendStep {
  BlockLayout layout;  // the sequences' block layout
  std::vector<AttendSequence> sequences;
  QueryTensor q;
  // [sum of append_tokens, kv_heads, head_dim] each, in layout.dtype.
  const void* new_k = nullptr;
  const void* new_v = nullptr;
  AttentionOptions options;  // layer, softmax scale, causal, window
  // q.data, new_k, new_v and the output are GPU memory (positions stay on
  // the host). GPU nodes on this host read the inputs and write their
  // partials in this process's GPU memory, and the partials are merged
  // there (ClientOptions::device_delivery; queries in the layout's dtype);
  // otherwise the inputs cross to the host once and the merged output back
  // once.
  bool device_buffers = false;
  // With device_buffers: the step is ordered on the caller's CUDA stream
  // `stream` (a cudaStream_t; null is the legacy default stream), as a
  // kernel launched there would be. The inputs are read once the stream's
  // earlier work is done (no need to synchronize before the call), and the
  // call returns once the nodes have answered and the output's last work is
  // queued on the stream: later work there sees the output, the host must
  // synchronize the stream before reading it. Nodes on this host wait on an
  // event recorded on the stream instead of the client waiting for it.
  // Unset: the client orders the step on its own stream and waits for it.
  bool stream_ordered = false;
  void* stream = nullptr;
  // With device_buffers: the merged O is also written here, GPU memory of
  // [num_rows, q_heads, head_dim] in out_cast_dtype (kBF16 or kF16): the
  // model's attention output in its own dtype, written by the step's last
  // merge instead of a conversion after it. The float32 output and LSE are
  // written as always. Null: not.
  void* out_cast = nullptr;
  DType out_cast_dtype = DType::kBF16;
};

struct NodeStats {
  std::string node_id, address, state;
  uint64_t blocks = 0, host_blocks = 0, cold_blocks = 0, pinned_blocks = 0, free_pages = 0, num_pages = 0;
  uint64_t puts = 0, hits = 0, misses = 0, evictions = 0, demotions = 0, promotions = 0, sequences = 0;
  uint64_t cold_stored_bytes = 0, cold_raw_bytes = 0;
  // The node's attention backend ("cpu", "cuda:0") and its HBM tier.
  std::string backend;
  uint64_t hbm_pages = 0, hbm_free_pages = 0, hbm_page_bytes = 0, hbm_blocks = 0, hbm_hits = 0, hbm_misses = 0,
           hbm_demotions = 0, open_blocks = 0;
  // Get payload bytes the node copied straight into callers' GPU memory
  // (same host, CUDA IPC: GetInto with on_device).
  uint64_t device_delivered_bytes = 0;
  // The caller's attention sequences on the node: count, full blocks and
  // their bytes, open blocks and their bytes (charged to its budget).
  uint64_t tenant_sequences = 0, tenant_sequence_blocks = 0, tenant_sequence_bytes = 0, tenant_sequence_open_blocks = 0,
           tenant_open_bytes = 0;
  uint64_t hbm_shared_pages = 0;  // HBM pages several sequences hold (forks' shared blocks)
  // The caller's full sequence blocks by tier, and its sequences' HBM bytes.
  uint64_t tenant_sequence_host_blocks = 0, tenant_sequence_cold_blocks = 0, tenant_sequence_hbm_bytes = 0;
  absl::Status status;
};

// Administration (the coordinator's admin token): creates a tenant and
// returns its token, shown once.
struct TenantSpec {
  std::string name;
  std::vector<std::string> shared_namespaces;
  uint64_t max_pinned_bytes = 0;  // 0: unlimited
  std::string kv_encoding;        // the tenant's default quantization ("" = plain)
  uint64_t sequence_ttl_s = 0;    // idle attention sequences are deleted after this long (0: never)
};
struct CreatedTenant {
  std::string token;
  uint32_t id = 0;
  std::string namespace_name;
};
absl::StatusOr<CreatedTenant> CreateTenant(const std::string& coordinator, const std::string& admin_token,
                                           const TenantSpec& spec, const TlsConfig& tls = {});

class ClientImpl;

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::string& tenant_name() const;
  // The namespace this client hashes and stores under.
  const std::string& namespace_name() const;
  // Keys for `model_id` blocks of `layout` in this client's namespace.
  BlockKeyHasher Hasher(const std::string& model_id, const BlockLayout& layout) const;

  // --- block cache (hash placement) ---
  absl::StatusOr<size_t> LookupPrefix(absl::Span<const BlockKey> chain);
  absl::StatusOr<PutReport> Put(absl::Span<const BlockData> blocks);
  std::vector<GetResult> Get(absl::Span<const BlockKey> keys);
  // The same, into caller buffers (one per key, each at least the block's
  // size): no allocation per block; over UCX the bytes land in place.
  // results[i].payload stays empty; results[i].meta says how many bytes.
  // With `on_device`, the destinations are GPU memory (an engine's KV pool):
  // a GPU node on this host copies the blocks into them itself (CUDA IPC;
  // ClientOptions::device_delivery, results[i].delivered_in_place); from
  // other nodes the bytes land in pinned staging, are checked there, and go
  // to the device in one copy per block. The destinations must stay
  // allocated for the call.
  std::vector<GetResult> GetInto(absl::Span<const BlockKey> keys, absl::Span<const absl::Span<uint8_t>> dsts,
                                 bool on_device = false);
  absl::Status Pin(absl::Span<const BlockKey> keys, bool unpin = false);

  // --- attention sequences (sequence placement) ---
  // Stores blocks [first_block, first_block + blocks.size()) of `sequence_id`.
  absl::StatusOr<PutReport> PutSequence(const std::string& sequence_id, uint64_t first_block,
                                        absl::Span<const BlockData> blocks);
  // Runs `step`: appends its new K/V, then attends; writes every row's
  // merged O [rows, q_heads, head_dim] and LSE [rows, q_heads] into `out`.
  // A row whose sequence holds no token gets O = 0, LSE = -inf.
  absl::Status StepInto(const AttendStep& step, PartialOutput out, AttendReport* report = nullptr);
  absl::StatusOr<PartialResult> Step(const AttendStep& step, AttendReport* report = nullptr);
  // Attention of `q` over the first `num_tokens` tokens of one sequence
  // (layer `options.layer`), no append.
  absl::StatusOr<PartialResult> Attend(const std::string& sequence_id, const BlockLayout& layout, uint64_t num_tokens,
                                       const QueryTensor& q, const AttentionOptions& options,
                                       AttendReport* report = nullptr);

  // Sequence lifecycle (attention sequences placed by sequence). Each goes
  // to every UP node of the map (a sequence's chunks and replicas may be on
  // any of them) and succeeds when every node answered; both are idempotent.
  // DeleteSequence ends the sequence: full blocks, open blocks (HBM, host),
  // records and their charge to the tenant's budget. TruncateSequence cuts it
  // back to its first `tokens` tokens on every layer: the next append at
  // `tokens` is a new token (speculative decoding's rejected drafts, an
  // edited turn). The result says how much was freed in all.
  absl::StatusOr<SequenceChangeReport> DeleteSequence(const std::string& sequence_id);
  absl::StatusOr<SequenceChangeReport> TruncateSequence(const std::string& sequence_id, uint64_t tokens);
  // Starts `sequence_id` as the first `tokens` tokens of `source_id`,
  // without copying them: the fork's chunks that hold those tokens are
  // placed where the source's are, their full blocks are shared (counted
  // per node: neither side's delete or truncate takes the other's bytes),
  // and only the partly filled block at the fork point is copied, on the
  // same node. Appends to either side never change the other. Goes to every
  // UP node. NOT_FOUND when no node holds the source; FAILED_PRECONDITION
  // when it holds fewer than `tokens` tokens; ALREADY_EXISTS when
  // `sequence_id` is another sequence (the same fork again is OK). On error
  // the fork is deleted again. Sequences of one namespace (the caller's).
  absl::StatusOr<ForkReport> ForkSequence(const std::string& source_id, const std::string& sequence_id,
                                          uint64_t tokens);
  // Starts `sequence_id` from a prefix-cache chain (blocks Put by hash
  // placement, e.g. an engine's stored prompt), so that one stored prompt
  // serves pass-Q sessions: the sequence's blocks [0, h) are the chain's
  // first h blocks, h the prefix cache's hit (LookupPrefix), in `layout`
  // (the chain's; its encoding stays the stored one). A replica of the
  // sequence's chunk that holds a block already records it by key (shared,
  // no bytes moved: the block stays the prefix cache's too, never erased
  // with the sequence); the others are sent its bytes from the prefix
  // cache's copy. The result says h (0: nothing started); the engine appends
  // or prefills from token h * block_tokens. ALREADY_EXISTS when
  // `sequence_id` holds tokens; on an error nothing of the sequence stays.
  absl::StatusOr<PrefixStartReport> StartSequenceFromPrefix(const std::string& sequence_id, const BlockLayout& layout,
                                                            absl::Span<const BlockKey> chain);
  // The caller's sequences on every UP node, merged by id (sorted); only
  // `ids` when it is not empty. An error when a node does not answer.
  absl::StatusOr<std::vector<SequenceListing>> ListSequences(absl::Span<const std::string> ids = {});
  std::vector<NodeStats> Stats();
  // The cached shard map version, and a forced refresh.
  uint64_t map_version() const;
  absl::Status RefreshMap();

 private:
  explicit Client(std::unique_ptr<ClientImpl> impl);
  std::unique_ptr<ClientImpl> impl_;
};

}  // namespace kvring
