// ClientImpl: the client library's state and operations behind kvring::Client
// (internal to the client library; Client in kvring/client/client.h is the
// public face and forwards to it).
//
// One ClientImpl per connected Client: the coordinator's channel, the shard
// map and the nodes' channels, the fan-out pool, the device copier, and the
// sequences' routes and placements. Its definitions are in three files, one
// per area: client.cc (connecting, the map, blocks: Put, Get, Lookup, Pin,
// Stats), client_step.cc (attention steps: the planner Route and the
// executor's rounds, StepRound) and client_sequences.cc (the sequence
// lifecycle: delete, truncate, list, fork, start from a prefix).
//
// Thread-safe: every operation may be called from many threads at once; the
// map, the node table and the suspicions are under mu_, the device copier
// under dev_mu_, and ChunkRoutes and SequencePlacements lock themselves.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "detached_rounds.h"
#include "kvring.grpc.pb.h"
#include "kvring/attention/step/step_shape.h"
#include "kvring/cache/quantize.h"
#include "kvring/client/client.h"
#include "kvring/client/device_memory.h"
#include "kvring/common/process.h"
#include "kvring/common/thread_pool.h"
#include "kvring/protocol/chunk_routes.h"
#include "kvring/protocol/coordinator_channel.h"
#include "kvring/protocol/shard_ring.h"
#include "kvring/protocol/wire.h"
#include "node_channel.h"
#include "sequence_placements.h"

namespace kvring {

class ClientImpl {
 public:
  // A status that says the node did not answer (the caller tries a replica).
  static bool IsNodeFailure(const absl::Status& s) {
    return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsCancelled(s);
  }
  static absl::Status StatusOf(const v1::Status& s) { return StatusFromProto(s); }
  // A PutBlock's block header: key, parent (none when zero), layout, and the
  // payload's encoding, size and checksum; by reference (PutBlock.by_reference:
  // no bytes travel), none of those three.
  static void PutBlockToProto(const BlockKey& key, const BlockKey& parent, const BlockLayout& layout,
                              const KvEncoding& encoding, absl::Span<const uint8_t> payload, bool by_reference,
                              v1::PutBlock* pb);

  using Node = NodeConnection;

  // Detached steps whose replies may be outstanding at once
  // (ClientOptions::detach_device_steps).
  static constexpr size_t kMaxDetachedSteps = 8;
  // The rows a node takes of a detached step: GPU nodes serve steps of up
  // to 64 rows on their UCX thread, in the order they arrive
  // (UcxDataPlane's inline_attend_rows); larger ones could pass each other.
  static constexpr uint32_t kMaxDetachedRows = 64;

  explicit ClientImpl(const ClientOptions& o)
      : o_(o),
        quantize_wire_(!o.quantize               ? ""
                       : o.quantize->quantized() ? KvEncodingName(*o.quantize)
                                                 : "none"),
        pool_(o.threads ? o.threads : 16) {
    node_events_ok_ = o.node_reply_when_queued;
  }
  // Detached steps' replies collected first, while the node connections
  // they arrive on are still here.
  ~ClientImpl() {
    std::unique_ptr<DetachedRounds> d;
    {
      absl::MutexLock l(&dev_mu_);
      d = std::move(detached_);
    }
  }

  absl::Status Init();

  std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout) const;

  v1::RequestHeader Header() const;

  absl::Status RefreshMap();

  std::shared_ptr<const ShardRing> Ring();

  std::shared_ptr<Node> NodeFor(const std::string& id);

  // The device copier, created on first use (the process may have no GPU).
  absl::StatusOr<DeviceMemory*> Dev();
  // The collector of detached steps (ClientOptions::detach_device_steps),
  // created with the device copier; null when the option is off or there is
  // no device.
  DetachedRounds* Detached();
  // Before a call that changes a sequence: the replies of detached steps in
  // flight collected (an append of theirs reaches the node before this
  // call), and the failure of one not returned yet.
  absl::Status SettleDetached();

  void Suspect(const std::string& id);
  bool Suspected(const std::string& id);

  // Node indices for a ring position: live, unsuspected nodes first.
  std::vector<int> Candidates(const ShardRing& ring, uint64_t pos) { return Demoted(ring, ring.ReadCandidates(pos)); }
  // `nodes` with the down and suspected ones moved last, in order.
  std::vector<int> Demoted(const ShardRing& ring, absl::Span<const int> nodes);

  // The nodes of each chunk of a step's sequences, live and unsuspected
  // first: the cached routes (ChunkRoutes), reordered only while this client
  // suspects a node.
  struct StepRoutes {
    std::vector<std::shared_ptr<const ChunkRoutes::Route>> routes;  // per sequence
    std::vector<std::vector<std::vector<int>>> reordered;           // per sequence and chunk, when suspecting
    absl::Span<const int> operator()(size_t seq, uint64_t chunk) const {
      return reordered.empty() ? routes[seq]->candidates(chunk) : absl::MakeConstSpan(reordered[seq][chunk]);
    }
    // The digest of the placement sequence `seq` is routed by.
    uint64_t digest(size_t seq) const { return routes[seq]->placement_digest; }
  };
  StepRoutes RoutesOf(const std::shared_ptr<const ShardRing>& ring, const AttendStep& st,
                      const std::vector<uint64_t>& nchunks);

  // One round of calls to nodes, the shape of every operation's fan-out:
  // call(j, node) for each job j, in parallel on the fan-out pool (job j
  // goes to node `nodes[j]` of `ring`; a node this client does not know gets
  // unknown_node(j)). Then every node whose result failed(result) says did
  // not answer (a node failure) is suspected, once: its replicas serve the
  // next round and the map is refreshed.
  template <typename R>
  std::vector<R> FanOut(const ShardRing& ring, absl::Span<const int> nodes, absl::FunctionRef<R(size_t, Node&)> call,
                        absl::FunctionRef<R(size_t)> unknown_node, absl::FunctionRef<bool(const R&)> failed) {
    std::vector<R> res(nodes.size());
    pool_.ParallelFor(nodes.size(), [&](size_t j) {
      std::shared_ptr<Node> node = NodeFor(ring.node(nodes[j]).node_id());
      res[j] = node ? call(j, *node) : unknown_node(j);
    });
    SuspectFailed(ring, nodes, res, failed);
    return res;
  }
  // Every node whose result failed(result) says did not answer is suspected, once.
  template <typename R>
  void SuspectFailed(const ShardRing& ring, absl::Span<const int> nodes, const std::vector<R>& res,
                     absl::FunctionRef<bool(const R&)> failed) {
    std::set<int> down;
    for (size_t j = 0; j < nodes.size(); ++j) {
      if (failed(res[j])) down.insert(nodes[j]);
    }
    for (int i : down) Suspect(ring.node(i).node_id());
  }
  // The same for calls with one status: a node failure status is a node that
  // did not answer.
  template <typename T>
  std::vector<absl::StatusOr<T>> FanOut(const ShardRing& ring, absl::Span<const int> nodes,
                                        absl::FunctionRef<absl::StatusOr<T>(size_t, Node&)> call) {
    return FanOut<absl::StatusOr<T>>(
        ring, nodes, call, [](size_t) { return absl::StatusOr<T>(absl::UnavailableError("unknown node")); },
        [](const absl::StatusOr<T>& r) { return !r.ok() && IsNodeFailure(r.status()); });
  }
  template <typename Job>
  static std::vector<int> NodesOf(const std::vector<Job>& jobs) {
    std::vector<int> nodes;
    nodes.reserve(jobs.size());
    for (const Job& j : jobs) nodes.push_back(NodeIndex(j));
    return nodes;
  }
  static int NodeIndex(const std::pair<int, std::vector<size_t>>& job) { return job.first; }
  // A plan's items per node cut into jobs of at most max_batch_bytes each
  // (`bytes_of(item)`; an item larger than that is a job of its own): the
  // node's message limit holds, and a node's jobs run in parallel.
  std::vector<std::pair<int, std::vector<size_t>>> CutIntoMessages(const std::map<int, std::vector<size_t>>& plan,
                                                                   absl::FunctionRef<uint64_t(size_t)> bytes_of) const;

  // ---- per-node calls ----
  absl::StatusOr<v1::PutResponse> PutOn(Node& n, v1::PutRequest req,
                                        const std::vector<absl::Span<const uint8_t>>& payloads);

  // Names, in `req`, where each destination lies in this process's GPU
  // memory (the allocations as IPC handles, one place per key). False (and
  // `req` without places) when some destination cannot be exported.
  bool AddDevicePlaces(DeviceMemory& dev, const std::vector<absl::Span<uint8_t>>& dsts, v1::GetRequest* req);

  // A Get reply's block header into `r` (meta and parent); remembers the
  // block size for sizing later replies. INVALID_ARGUMENT for a bad layout.
  absl::Status HeaderInto(const v1::BlockHeader& h, GetResult* r);

  // Where a Get reply's payloads came: landed in a single destination
  // already, or the bulk buffer of a UCX reply (in the destinations, the
  // staging, the landing buffer or a buffer of its own), else inline in the
  // reply; in_dsts: the bulk lies in the destinations themselves.
  struct ReplyPayloads {
    bool landed = false, via_ucx = false, in_dsts = false;
    absl::Span<const uint8_t> bulk;
  };
  // Where a Get's UCX payload should land (GetOn): the staging (device
  // destinations), the destinations themselves when they follow one another
  // (*in_dsts), this thread's landing buffer, or a single block's
  // destination (or its result's payload, sized by the last block seen);
  // empty when the payloads come inline or as their own buffer.
  absl::Span<uint8_t> LandingFor(const NodeChannel& ch, bool device_places, DeviceMemory::Staging* staging,
                                 size_t nkeys, const std::vector<absl::Span<uint8_t>>& dsts,
                                 std::vector<GetResult>* out, bool* in_dsts);
  // A Get reply's blocks into their results or destinations (dev: device
  // destinations, each checked in host memory, then copied), every payload
  // checked against its checksum.
  void PlaceBlocks(const Node& n, const std::vector<BlockKey>& keys, const std::vector<absl::Span<uint8_t>>& dsts,
                   DeviceMemory* dev, const v1::GetResponse& resp, const ReplyPayloads& from,
                   std::vector<GetResult>* out);

  // `dsts` (empty, or one per key): where payloads go; else into results.
  absl::StatusOr<std::vector<GetResult>> GetOn(Node& n, const std::vector<BlockKey>& keys,
                                               const std::vector<absl::Span<uint8_t>>& dsts, bool on_device = false);

  absl::StatusOr<uint32_t> LookupOn(Node& n, const std::vector<BlockKey>& keys);

  absl::StatusOr<v1::PinResponse> PinOn(Node& n, const std::vector<BlockKey>& keys, bool unpin);

  // One Attend to one node: `parts` is the bulk payload (queries || new_k ||
  // new_v, as spans); the reply's out || lse lands in `reply` (sized for it).
  absl::StatusOr<v1::AttendResponse> AttendOn(Node& n, v1::AttendRequest req,
                                              const std::vector<absl::Span<const uint8_t>>& parts,
                                              const std::vector<absl::Span<const uint8_t>>& k_parts,
                                              const std::vector<absl::Span<const uint8_t>>& v_parts,
                                              absl::Span<uint8_t> reply);

  // ---- public operations ----
  // With `missing_on` (a sequence's blocks): by reference, no bytes sent
  // (PutBlock.by_reference); the nodes that do not hold block i go to
  // (*missing_on)[i] and count toward its write quorum (the caller sends
  // them the bytes).
  absl::StatusOr<PutReport> PutBlocks(absl::Span<const BlockData> blocks, const std::string* seq, uint64_t first_block,
                                      std::vector<std::vector<int>>* missing_on = nullptr);

  // PutBlocks once every payload is in host memory: each block to its
  // candidates in rounds (a node that failed: the next candidate), until R
  // replicas hold it or none is left; an error when a block has fewer than
  // W (the pins it placed then taken back).
  absl::StatusOr<PutReport> PutPlaced(absl::Span<const BlockData> blocks, const std::string* seq, uint64_t first_block,
                                      std::vector<std::vector<int>>* missing_on);
  // One message of a Put to one node: blocks[idx] (by reference: no bytes,
  // PutBlock.by_reference), and each one's outcome there.
  struct PutOutcome {
    absl::Status status;
    bool inserted = false;
  };
  std::vector<PutOutcome> PutJob(Node& node, absl::Span<const BlockData> blocks, const std::vector<size_t>& idx,
                                 const std::string* seq, uint64_t first_block, bool by_reference);

  // Unpins block i on each node of pinned_on[i] (one request per node).
  absl::Status UnpinPlaced(const ShardRing& ring, absl::Span<const BlockData> blocks,
                           const std::vector<std::vector<int>>& pinned_on);

  std::vector<GetResult> GetBlocks(absl::Span<const BlockKey> keys, absl::Span<const absl::Span<uint8_t>> dsts,
                                   bool on_device = false);

  absl::StatusOr<size_t> Lookup(absl::Span<const BlockKey> chain);

  // ---- attention steps ----
  // The plan of a step: which node attends which chunks of which sequence,
  // and which nodes take which appended tokens.
  struct SeqPart {
    size_t seq = 0;                             // index into step.sequences
    std::vector<uint64_t> chunks;               // chunks this node attends (ascending)
    uint64_t append_begin = 0, append_end = 0;  // appended positions it takes
  };
  struct NodeJob {
    int node = 0;
    std::vector<SeqPart> parts;
  };
  static int NodeIndex(const NodeJob& job) { return job.node; }
  // The appended tokens [begin, end) of sequence `seq` that fall in `chunk`,
  // and the replicas that acknowledged them.
  struct AppendUnit {
    size_t seq;
    uint64_t chunk, begin, end;
    int acks = 0;
    absl::Status last;
    std::vector<int> acked_on;    // nodes that acknowledged it
    std::vector<int> missing_on;  // nodes that refused it for tokens they lack before it (DATA_LOSS)
  };
  // An attended chunk a node did not serve: retried on the next replica, or
  // (same_node_again) on the same one without the append that was refused.
  struct FailedChunk {
    size_t seq = 0;
    uint64_t chunk = 0;
    bool same_node_again = false;
    std::string why;
    absl::StatusCode code = absl::StatusCode::kUnavailable;  // the node's answer
  };

  // A step whose tensors are in this process's GPU memory, run through
  // exchange buffers (kvring.proto DeviceExchange): each round's queries and
  // K/V gathered into one on the device, the nodes on this host reading them
  // and writing their partials there, the partials merged there into the
  // caller's output. A node that refuses is served from the same buffer
  // through pinned staging.
  struct DeviceStep {
    DeviceMemory* dev = nullptr;
    void* stream = nullptr;       // where the step's device work is queued
    bool stream_ordered = false;  // the caller's stream: no wait for the device at the end
    bool initialized = false;     // the output holds a first merge (every row written)
  };

  absl::Status StepInto(const AttendStep& in, PartialOutput out, AttendReport* report);

  // A step, routed once more when a node says a sequence of it is a fork
  // this client has not resolved (ABORTED: the node served nothing of that
  // sequence): the placements are learned from the nodes first. What other
  // nodes applied of the first routing is applied again with the same bytes
  // (idempotent), and the output is written anew.
  absl::Status StepOnHost(const AttendStep& st, PartialOutput out, AttendReport* report, DeviceStep* dx = nullptr);

  // Copies what node `from` holds of sequence `id` in blocks [b0, b1) onto
  // node `to`: full blocks stored there as they are (under the sequence's
  // own keys: its delete erases them), the open block's tokens appended
  // layer by layer. `to` then holds what `from` holds of those blocks
  // (tokens it held already are compared, not written again).
  absl::Status CopyReplica(const ShardRing& ring, int from, int to, const std::string& id, const BlockLayout& L,
                           uint64_t b0, uint64_t b1, uint64_t digest);

  // The step in the vocabulary the nodes take it in (kvring/attention/step).
  static StepShape ShapeOf(const AttendStep& st);

  // A step's request shape, checked before any routing, by the rules a node
  // checks it by (CheckStepShape).
  static absl::Status CheckStep(const AttendStep& st);

  // The plan of a step (StepRouted's planner): each sequence's rows,
  // appended rows, length after the step and chunks; each chunk's nodes; the
  // appended tokens by chunk (their acks counted by the rounds); round 0's
  // parts per node.
  struct RoutedStep {
    StepShape shape;
    std::vector<uint32_t> row_begin, app_begin;
    std::vector<uint64_t> total, nchunks;
    StepRoutes cands;
    std::vector<AppendUnit> units;
    std::map<int, std::map<size_t, SeqPart>> appends;  // node -> sequence -> the appended tokens it takes
    bool two_phase = false;                            // a node takes non-adjacent parts of one append
  };
  RoutedStep Route(const std::shared_ptr<const ShardRing>& ring, const AttendStep& st);

  absl::Status StepRouted(const AttendStep& st, PartialOutput out, AttendReport* report, DeviceStep* dx);

  // The step's rounds: with a two-phase plan its appends first (one request
  // per node and contiguous part); then every chunk attended on its first
  // candidate with the appends beside, and the chunks a node did not serve
  // on their next candidate, until every chunk is served or one has no
  // candidate left.
  absl::Status RunRounds(const ShardRing& ring, const AttendStep& st, RoutedStep& rs, PartialOutput out, DeviceStep* dx,
                         AttendReport* rep);

  // A chunk no candidate served. When every replica that answered refused
  // for the same reason (NOT_FOUND, FAILED_PRECONDITION, DATA_LOSS with the
  // first lost position...), that is the step's error class, one the engine
  // can act on (a dead replica beside them cannot serve the chunk either);
  // with no answer at all, UNAVAILABLE.
  static absl::Status NoReplicaLeft(const std::string& id, uint64_t chunk, const std::vector<FailedChunk>& tried);

  // After the rounds: a write replica that lacks the tokens before an
  // append (the new replica after a node's death, or one that restarted
  // without its open block) gets the chunk's blocks copied from a replica
  // that acknowledged the append (repair), so the sequence keeps R copies
  // and W=R steps go on; then every append needs its write quorum.
  absl::Status SettleAppends(const ShardRing& ring, const AttendStep& st, RoutedStep& rs, AttendReport* rep);

  // What the rounds of one step share (StepRouted computes it once).
  struct PlannedStep {
    const AttendStep& st;
    const StepShape& shape;                  // st's
    const std::vector<uint32_t>& row_begin;  // each sequence's first query row
    const std::vector<uint32_t>& app_begin;  // each sequence's first row of new_k / new_v
    const std::vector<uint64_t>& total;      // each sequence's tokens after the step
    const StepRoutes& routes;                // each chunk's nodes, each sequence's placement digest
  };

  // A step's places in the exchange buffer (device tensors), per job: its
  // partial rows (from a multiple of 64 rows, so every region is 256-byte
  // aligned), their LSE, its queries and K/V; then the merge's row lists.
  struct JobPlace {
    uint64_t q = 0, k = 0, v = 0;
    uint32_t rows = 0, app = 0, part_row = 0;
  };
  struct ExchangeStage {
    std::vector<JobPlace> place;
    DeviceMemory::Exchange xb;
    std::string inputs_event;  // the inputs' event (cudaIpcEventHandle_t bytes), or empty: waited for
    uint64_t l_base = 0, csr_off = 0;
    // Per job, the 32-bit word a node sets when it answered before its work
    // was done (DeviceExchange.done_flag_offset): at flags_off + 4 j, set to
    // flag_base + j (never 0; a fresh range every round).
    uint64_t flags_off = 0;
    uint32_t flag_base = 0;
    std::vector<int> same_rows_as;  // per job: an earlier job whose copy of the queries it reads, or -1
  };
  // Plans the exchange buffer of `jobs` (ex->place, l_base, csr_off,
  // same_rows_as; jobs that attend the same sequences share one copy of
  // their queries) and returns its size in bytes.
  static uint64_t PlaceJobs(const PlannedStep& sh, const std::vector<NodeJob>& jobs, ExchangeStage* ex);

  // Copies each job's rows of the engine's tensors into its place in the
  // exchange buffer, in the order its request lists them, on dx's stream.
  absl::Status CopyIntoExchange(const PlannedStep& sh, const std::vector<NodeJob>& jobs, DeviceStep* dx,
                                ExchangeStage* ex);

  // Plans the exchange buffer of `jobs` and copies the engine's rows into it
  // (adjacent runs of one tensor as one copy; jobs that attend the same
  // sequences share one copy of their queries); on the caller's stream, the
  // nodes wait on an event recorded after the copies, else this waits.
  absl::Status StageExchange(const PlannedStep& sh, const std::vector<NodeJob>& jobs, DeviceStep* dx,
                             ExchangeStage* ex);

  // Where a round's outcome goes: the appends' acks, the output, the report,
  // the last refusal and (when the caller retries) the chunks not served.
  struct RoundSink {
    std::vector<AppendUnit>& units;
    PartialOutput out;
    DeviceStep* dx;
    AttendReport* rep;
    absl::Status* last_error;
    std::vector<FailedChunk>* failed = nullptr;
  };

  // One round of a step: one request per job (every job's request built
  // first, then sent from this thread where the carrier allows it, else on
  // the pool), the replies turned into acks, retries and partials, and the
  // partials merged into the output (on the host, or in one MergeRows launch
  // over the exchange buffer). Attended chunks whose node failed or did not
  // hold them go to sink.failed (retried on the next replica); any other
  // refusal is the round's error. Lives for one RunJobs call on its thread;
  // Call runs on pool threads for different jobs at once.
  class StepRound;

  absl::Status RunJobs(const PlannedStep& sh, const ShardRing& ring, const std::vector<NodeJob>& jobs, RoundSink k);

  // The nodes of `ring` marked UP (the lifecycle calls go to each of them).
  static std::vector<int> UpNodes(const ShardRing& ring);

  absl::StatusOr<SequenceChangeReport> ChangeSequence(const std::string& id, bool truncate, uint64_t tokens);

  // The caller's sequences (or `ids`) on every UP node, merged by id. With
  // `tolerant`, nodes that do not answer are left out (an error only when
  // none answered).
  absl::StatusOr<std::vector<SequenceListing>> ListSequences(absl::Span<const std::string> ids, bool tolerant = false);

  // Learns the placement of each of `ids` from the nodes (every node records
  // a fork's).
  absl::Status ResolvePlacements(absl::Span<const std::string> ids);

  static absl::StatusOr<SequencePlacement> PlacementOf(const SequenceListing& l);

  absl::StatusOr<PrefixStartReport> StartFromPrefix(const std::string& id, const BlockLayout& L,
                                                    absl::Span<const BlockKey> chain);

  absl::StatusOr<ForkReport> ForkSequence(const std::string& source, const std::string& id, uint64_t tokens);

  std::vector<NodeStats> Stats();

  absl::Status PinBlocks(absl::Span<const BlockKey> keys, bool unpin);

  std::atomic<size_t> last_block_bytes_{0};
  const std::string host_id_ = HostBootId().value_or("");  // for same-host delivery ("": never asked)
  // Steps on the caller's stream hand nodes an event to wait on (false once
  // this device or a node cannot: then the client waits for the inputs).
  std::atomic<bool> events_ok_{true};
  // Nodes may answer steps on the caller's stream once their work is queued
  // (DeviceExchange.reply_when_queued); false once a node's event could not
  // be waited for here.
  std::atomic<bool> node_events_ok_{true};
  // The values a round's done flags start from (ExchangeStage::flag_base).
  std::atomic<uint32_t> next_flag_{1};
  absl::Mutex dev_mu_;
  std::unique_ptr<DeviceMemory> dev_ ABSL_GUARDED_BY(dev_mu_);
  // (after dev_: destroyed first, its rounds' buffers going back to dev_)
  std::unique_ptr<DetachedRounds> detached_ ABSL_GUARDED_BY(dev_mu_);
  ClientOptions o_;
  const std::string quantize_wire_;  // PutRequest.quantize: o_.quantize spelled for the wire
  std::shared_ptr<grpc::ChannelCredentials> creds_;
  v1::Tenant tenant_;
  std::string ns_;
  NamespaceId ns_id_ = 0;
  std::unique_ptr<CoordinatorChannel> coord_;
  ThreadPool pool_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const ShardRing> ring_ ABSL_GUARDED_BY(mu_);
  absl::Time last_refresh_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Node>> nodes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, absl::Time> suspect_until_ ABSL_GUARDED_BY(mu_);
  SequencePlacements placements_;  // the forks this client knows
  ChunkRoutes routes_;             // the nodes of the chunks of the sequences this client steps
};

}  // namespace kvring
