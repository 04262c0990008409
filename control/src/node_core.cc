#include "kvring/control/node_core.h"

#include <chrono>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "kvring/attention/merge.h"
#include "kvring/cache/quantize.h"
#include "kvring/common/logging.h"
#include "kvring/common/process.h"
#include "kvring/common/status_macros.h"
#include "kvring/layout/token_rows.h"

namespace kvring {

// Counts a request and its latency; an error status counts as an error.
class OpScope {
 public:
  explicit OpScope(const NodeCore::OpMetrics& m) : m_(m), start_(std::chrono::steady_clock::now()) {
    m_.requests->Add();
  }
  absl::Status Done(absl::Status s) {
    Record(s);
    return s;
  }
  // The same, for a call that returns something else than the status.
  void Record(const absl::Status& s) {
    m_.latency->Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
    if (!s.ok()) m_.errors->Add();
  }

 private:
  const NodeCore::OpMetrics& m_;
  std::chrono::steady_clock::time_point start_;
};

namespace {
double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

NodeCore::NodeCore(NodeCoreOptions options, BlockStore* store, SequenceTable* sequences, AttentionBackend* backend,
                   TenantDirectory* tenants, MetricsRegistry* metrics, DeviceDelivery* delivery)
    : options_(std::move(options)),
      store_(store),
      sequences_(sequences),
      backend_(backend),
      tenants_(tenants),
      metrics_(metrics),
      delivery_(delivery),
      host_id_(HostBootId().value_or("")) {
  lookup_ = Op("lookup");
  put_ = Op("put");
  get_ = Op("get");
  pin_ = Op("pin");
  attend_ = Op("attend");
  stats_ = Op("stats");
  sequence_ops_ = Op("sequence_lifecycle");
  put_bytes_ = metrics_->Counter("kvring_put_bytes_total", "Payload bytes accepted by Put");
  quantized_ =
      metrics_->Counter("kvring_quantized_blocks_total",
                        "Plain blocks quantized by this node: at Put, or as a sequence's appends complete them");
  get_bytes_ = metrics_->Counter("kvring_get_bytes_total", "Payload bytes served by Get");
  device_bytes_ = metrics_->Counter("kvring_get_device_delivered_bytes_total",
                                    "Payload bytes Get copied straight into the GPU memory of callers on this host");
  device_exchanges_ =
      metrics_->Counter("kvring_attend_device_exchanges_total",
                        "Attends whose queries, K/V and output stayed in the GPU memory of a caller on this host");
  appended_tokens_ =
      metrics_->Counter("kvring_appended_tokens_total", "Tokens appended to attention sequences (per layer)");
  sealed_blocks_ = metrics_->Counter("kvring_sealed_blocks_total", "Blocks built from appends and stored");
  attend_kernel_ =
      metrics_->Histogram("kvring_attend_kernel_seconds", "Time of the attention computation of an Attend");
  reclaimed_blocks_ =
      metrics_->Counter("kvring_reclaimed_blocks_total", "Blocks of deleted tenants reclaimed from every tier");
  expired_sequences_ = metrics_->Counter("kvring_expired_sequences_total",
                                         "Attention sequences deleted here after their tenant's idle TTL");
}

NodeCore::OpMetrics NodeCore::Op(const std::string& name) {
  const std::string l = absl::StrCat("op=\"", name, "\"");
  return OpMetrics{metrics_->Counter("kvring_requests_total", "Requests handled, by operation", l),
                   metrics_->Counter("kvring_request_errors_total", "Requests that returned an error", l),
                   metrics_->Histogram("kvring_request_seconds", "Request latency in seconds", l)};
}

absl::StatusOr<NamespaceId> NodeCore::Namespace(const v1::Tenant& t, const std::string& requested) const {
  if (requested.size() > options_.limits.max_namespace_bytes)
    return absl::InvalidArgumentError("namespace name too long");
  KVRING_ASSIGN_OR_RETURN(std::string ns, ResolveNamespace(t, requested));
  return NamespaceIdOf(ns);
}

void NodeCore::ApplyQuotas() {
  for (const v1::Tenant& t : tenants_->tenants()) {
    TenantQuota q;
    if (t.max_pinned_bytes() > 0) q.max_pinned_bytes = t.max_pinned_bytes();
    store_->SetTenantQuota(t.id(), q);
    backend_->SetTenantQuota(t.id(), q.max_pinned_bytes);
  }
}

absl::StatusOr<ReclaimResult> NodeCore::ReclaimDeletedTenants() {
  absl::MutexLock l(&reclaim_mu_);
  std::vector<uint32_t> ids;
  absl::flat_hash_set<NamespaceId> dead;
  for (uint32_t id : tenants_->deleted_tenant_ids()) {
    if (reclaimed_.contains(id)) continue;
    ids.push_back(id);
    dead.insert(NamespaceIdOf(TenantNamespace(id)));
  }
  ReclaimResult r;
  if (dead.empty()) return r;
  for (const auto& [ns, id] : sequences_->SequencesIn(dead)) {
    SequenceTable::Handle h = sequences_->Lock(ns, id);
    const SequenceRef ref{ns, id, 0};
    backend_->ForgetSequence(ref);                // open blocks included
    KVRING_RETURN_IF_ERROR(h.Forget().status());  // the namespace's blocks are purged below
    ++r.sequences;
  }
  KVRING_ASSIGN_OR_RETURN(r.blocks, store_->PurgeNamespaces(dead));
  reclaimed_.insert(ids.begin(), ids.end());
  r.tenants = ids.size();
  reclaimed_blocks_->Add(r.blocks);
  return r;
}

absl::StatusOr<LookupResult> NodeCore::Lookup(const v1::Tenant& t, const std::string& requested,
                                              absl::Span<const BlockKey> keys, bool each) {
  OpScope op(lookup_);
  auto ns = Namespace(t, requested);
  if (!ns.ok()) return op.Done(ns.status());
  if (absl::Status s = ValidateKeys(keys, options_.limits); !s.ok()) return op.Done(s);
  LookupResult r;
  r.prefix_length = static_cast<uint32_t>(store_->LookupPrefix(*ns, keys));
  if (each) r.held = store_->Contains(*ns, keys);
  op.Record(absl::OkStatus());
  return r;
}

absl::StatusOr<std::vector<PutOutcome>> NodeCore::Put(const v1::Tenant& t, const std::string& requested,
                                                      const std::string& request_quantize,
                                                      absl::Span<const PutBlockIn> blocks) {
  OpScope op(put_);
  auto ns = Namespace(t, requested);
  if (!ns.ok()) return op.Done(ns.status());
  // What plain blocks become here: the request's choice, else the tenant's.
  KvEncoding target;
  const std::string& quantize = request_quantize.empty() ? t.kv_encoding() : request_quantize;
  if (absl::Status s = ParseKvEncoding(quantize, &target); !s.ok()) {
    return op.Done(absl::InvalidArgumentError(absl::StrCat("quantize: ", s.message())));
  }
  std::vector<PutOutcome> out(blocks.size());
  std::vector<uint8_t> quantized;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const PutBlockIn& b = blocks[i];
    BlockMeta meta = b.meta;
    absl::Span<const uint8_t> payload = b.payload;
    PutOutcome* r = &out[i];
    if (b.by_reference) {
      r->status = b.sequence_id == nullptr ? absl::InvalidArgumentError("a block by reference belongs to a sequence")
                                           : RecordByReference(t.id(), *ns, b);
      continue;
    }
    if (payload.size() != meta.payload_bytes) {
      r->status = absl::InvalidArgumentError(
          absl::StrCat("payload has ", payload.size(), " bytes; the header says ", meta.payload_bytes));
      continue;
    }
    if (target.quantized() && !meta.encoding.quantized()) {
      // The sender's checksum covers the plain bytes: check it before they
      // are replaced by codes (the store then checksums the codes).
      if (meta.checksum != 0 && PayloadChecksum(payload.data(), payload.size()) != meta.checksum) {
        r->status = absl::DataLossError("payload checksum mismatch (before quantization)");
        continue;
      }
      if (absl::Status s = QuantizeBlock(meta.layout, payload, target, &quantized); !s.ok()) {
        r->status = s;
        continue;
      }
      meta.encoding = target;
      meta.payload_bytes = static_cast<uint32_t>(quantized.size());
      meta.checksum = 0;
      payload = quantized;
      quantized_->Add(1);
    }
    PutArgs a;
    a.tenant = t.id();
    a.ns = *ns;
    a.key = b.key;
    a.parent = b.parent;
    a.meta = meta;
    a.pin = b.pin;
    absl::StatusOr<PutResult> pr;
    if (b.sequence_id != nullptr) {
      // The sequence's lock covers the store write, so an append never
      // races a Put of the same block.
      SequenceTable::Handle h = sequences_->Lock(*ns, *b.sequence_id);
      const uint64_t index = b.block_index;
      SequenceState& st = h.state();
      st.last_use = Now();
      if (st.open.count(index)) {
        pr = absl::FailedPreconditionError(
            absl::StrCat("block ", index, " of sequence '", h.id(), "' is being filled by appends on this node"));
      } else if (st.layout.has_value() && !(*st.layout == meta.layout)) {
        pr = absl::FailedPreconditionError(
            absl::StrCat("block ", index, " of sequence '", h.id(), "' has another layout than the sequence's blocks"));
      } else if (!st.blocks.empty() && st.layout.has_value() && !(st.encoding == meta.encoding)) {
        pr = absl::FailedPreconditionError(absl::StrCat("block ", index, " of sequence '", h.id(),
                                                        "' has another encoding than the sequence's blocks"));
      } else {
        pr = store_->Put(a, payload);
        if (pr.ok()) {
          if (absl::Status s = h.Record(index, a.key, /*owned=*/false); !s.ok()) {
            pr = s;
          } else {
            st.layout = meta.layout;
            st.encoding = meta.encoding;
            absl::Status adm = backend_->AdmitBlock(SequenceRef{*ns, h.id(), t.id()}, index, a.key, meta, payload);
            if (!adm.ok()) KVRING_LOG(DEBUG) << "sequence block not admitted to the backend: " << adm;
          }
        }
      }
    } else {
      pr = store_->Put(a, payload);
    }
    r->status = pr.status();
    if (pr.ok()) {
      r->inserted = pr->inserted;
      put_bytes_->Add(payload.size());
    }
  }
  op.Record(absl::OkStatus());
  return out;
}

absl::Status NodeCore::RecordByReference(TenantId tenant, NamespaceId ns, const PutBlockIn& b) {
  SequenceTable::Handle h = sequences_->Lock(ns, *b.sequence_id);
  const uint64_t index = b.block_index;
  SequenceState& st = h.state();
  st.last_use = Now();
  if (st.open.count(index)) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", index, " of sequence '", h.id(), "' is being filled by appends on this node"));
  }
  absl::StatusOr<PinnedBlock> held = store_->Acquire(ns, b.key);
  if (absl::IsNotFound(held.status())) {
    return absl::NotFoundError(absl::StrCat("block ", b.key.ToHex(), " is not on this node"));
  }
  KVRING_RETURN_IF_ERROR(held.status());
  const BlockMeta& meta = held->meta();
  if (!(meta.layout == b.meta.layout)) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", b.key.ToHex(), " on this node has another layout than the one named"));
  }
  if (st.layout.has_value() && !(*st.layout == meta.layout)) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", index, " of sequence '", h.id(), "' has another layout than the sequence's blocks"));
  }
  if (!st.blocks.empty() && st.layout.has_value() && !(st.encoding == meta.encoding)) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", index, " of sequence '", h.id(), "' has another encoding than the sequence's blocks"));
  }
  KVRING_RETURN_IF_ERROR(h.Record(index, b.key, /*owned=*/false));
  st.layout = meta.layout;
  st.encoding = meta.encoding;
  absl::Status adm = backend_->AdmitBlock(SequenceRef{ns, h.id(), tenant}, index, b.key, meta, held->payload());
  if (!adm.ok()) KVRING_LOG(DEBUG) << "sequence block not admitted to the backend: " << adm;
  return absl::OkStatus();
}

absl::StatusOr<GetOut> NodeCore::Get(const v1::Tenant& t, const std::string& requested, absl::Span<const BlockKey> keys,
                                     const DeviceTarget* device) {
  OpScope op(get_);
  auto ns = Namespace(t, requested);
  if (!ns.ok()) return op.Done(ns.status());
  if (absl::Status s = ValidateKeys(keys, options_.limits); !s.ok()) return op.Done(s);
  GetOut out;
  if (device != nullptr) {
    std::string refusal = DeviceRefusal(device->host_id);
    if (refusal.empty()) {
      absl::Status s = GetIntoDevice(*ns, keys, *device, &out);
      if (!absl::IsFailedPrecondition(s)) {
        op.Record(s);
        if (!s.ok()) return s;
        return out;
      }
      refusal = std::string(s.message());  // the caller's memory cannot be mapped here: payloads instead
      out = GetOut();
    }
    out.device_refusal = refusal;
  }
  out.blocks.resize(keys.size());
  uint64_t total = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    GetBlockOut& o = out.blocks[i];
    absl::StatusOr<PinnedBlock> b = store_->Acquire(*ns, keys[i]);
    if (!b.ok()) {
      o.status = b.status();
      continue;
    }
    total += b->meta().payload_bytes;
    if (total > options_.limits.max_request_bytes) {
      o.status = absl::ResourceExhaustedError("response would exceed the request size limit; get fewer blocks at once");
      continue;
    }
    get_bytes_->Add(b->meta().payload_bytes);
    o.block = std::move(*b);
  }
  op.Record(absl::OkStatus());
  return out;
}

std::string NodeCore::DeviceRefusal(const std::string& caller_host) const {
  if (delivery_ == nullptr) return "this node has no GPU to deliver from, or delivery is off (--device_delivery)";
  if (host_id_.empty()) return "this node cannot tell which host it is on";
  if (caller_host != host_id_) return "the caller is on another host";
  return "";
}

absl::Status NodeCore::RefuseDeviceIo(std::string why, AttendStats* stats) const {
  if (stats != nullptr) {
    stats->device_refusal = std::move(why);
    stats->backend = backend_->name();
  }
  return absl::OkStatus();
}

absl::Status NodeCore::AttendOnDevice(const v1::Tenant& t, const std::string& requested_ns, AttendBatch batch,
                                      const DeviceExchangeIn& x, AttendStats* stats) {
  if (std::string why = DeviceRefusal(x.host_id); !why.empty()) return RefuseDeviceIo(std::move(why), stats);
  const std::string handles[] = {x.ipc_handle};
  absl::StatusOr<std::unique_ptr<DeviceDelivery::Batch>> mapped = delivery_->Begin(handles);
  if (absl::IsFailedPrecondition(mapped.status())) {
    return RefuseDeviceIo(std::string(mapped.status().message()), stats);
  }
  if (!mapped.ok()) return mapped.status();
  // (shared: a backend that returns with the step's work queued holds it
  // until the work completes)
  std::shared_ptr<DeviceDelivery::Batch> held = std::move(*mapped);
  DeviceDelivery::Batch& m = *held;
  const StepShape& shape = batch.shape;
  const uint64_t kv_bytes = batch.layout.has_value() ? uint64_t{batch.append_rows()} * batch.layout->kv_row_bytes() : 0;
  AttendDeviceIo io;
  KVRING_ASSIGN_OR_RETURN(uint8_t * q, m.Region(0, x.queries, shape.query_bytes()));
  KVRING_ASSIGN_OR_RETURN(uint8_t * k, m.Region(0, x.new_k, kv_bytes));
  KVRING_ASSIGN_OR_RETURN(uint8_t * v, m.Region(0, x.new_v, kv_bytes));
  KVRING_ASSIGN_OR_RETURN(uint8_t * o, m.Region(0, x.out, shape.out_floats() * sizeof(float)));
  KVRING_ASSIGN_OR_RETURN(uint8_t * l, m.Region(0, x.lse, shape.lse_floats() * sizeof(float)));
  io.queries = q;
  io.new_k = k;
  io.new_v = v;
  io.out = reinterpret_cast<float*>(o);
  io.lse = reinterpret_cast<float*>(l);
  if (!x.inputs_ready_event.empty()) {
    absl::StatusOr<void*> ev = m.InputsReady(x.inputs_ready_event);
    if (absl::IsFailedPrecondition(ev.status())) return RefuseDeviceIo(std::string(ev.status().message()), stats);
    if (!ev.ok()) return ev.status();
    io.inputs_ready = *ev;
  }
  io.read = [&m](const uint8_t* src, absl::Span<uint8_t> dst) { return m.Read(src, dst); };
  io.reply_when_queued = x.reply_when_queued && io.inputs_ready != nullptr;
  if (io.reply_when_queued && x.done_flag_value != 0) {
    KVRING_ASSIGN_OR_RETURN(uint8_t * f, m.Region(0, x.done_flag, sizeof(uint32_t)));
    io.done_flag = reinterpret_cast<uint32_t*>(f);
    io.done_flag_value = x.done_flag_value;
  }
  io.keepalive = held;
  batch.device = &io;
  absl::Status s = Attend(t, requested_ns, batch, PartialOutput{nullptr, nullptr}, stats);
  if (s.ok() && (stats == nullptr || stats->device_refusal.empty())) device_exchanges_->Add(1);
  return s;
}

absl::Status NodeCore::GetIntoDevice(NamespaceId ns, absl::Span<const BlockKey> keys, const DeviceTarget& device,
                                     GetOut* out) {
  KVRING_ASSIGN_OR_RETURN(std::unique_ptr<DeviceDelivery::Batch> batch, delivery_->Begin(device.handles));
  // Every block is found and checked first, then every copy is queued at
  // once: the GPU sees one deep queue (on a GPU shared by several daemons a
  // context gets the copy engines in time slices; a queue fed block by block
  // leaves its slices half idle). The blocks stay held until their copies
  // have landed (batch->Finish).
  out->blocks.resize(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    GetBlockOut& o = out->blocks[i];
    absl::StatusOr<PinnedBlock> b = store_->Acquire(ns, keys[i]);
    absl::Status st = b.status();
    const DeviceTarget::Place& place = device.places[i];
    if (st.ok() && b->meta().payload_bytes > place.capacity) {
      st = absl::InvalidArgumentError(
          absl::StrCat("device place of ", place.capacity, " bytes for a block of ", b->meta().payload_bytes));
    }
    // The bytes reach the caller without passing through its hands: with
    // delivery_checksum they are checked here, against the writer's checksum.
    if (st.ok() && options_.delivery_checksum &&
        PayloadChecksum(b->payload().data(), b->payload().size()) != b->meta().checksum) {
      st = absl::DataLossError(absl::StrCat("block ", keys[i].ToHex(), " fails its checksum on this node"));
    }
    o.status = st;
    if (st.ok()) o.block = std::move(*b);
  }
  uint64_t bytes = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    GetBlockOut& o = out->blocks[i];
    if (!o.status.ok()) continue;
    const DeviceTarget::Place& place = device.places[i];
    o.status = batch->Add(place.allocation, place.offset, o.block.payload());
    if (absl::IsInternal(o.status)) return o.status;  // a CUDA error: the request fails
    if (o.status.ok()) bytes += o.block.meta().payload_bytes;
  }
  KVRING_RETURN_IF_ERROR(batch->Finish());
  get_bytes_->Add(bytes);
  device_bytes_->Add(bytes);
  out->delivered_to_device = true;
  return absl::OkStatus();
}

bool NodeCore::GetStaysInMemory(const v1::Tenant& t, const std::string& requested, absl::Span<const BlockKey> keys) {
  auto ns = Namespace(t, requested);
  if (!ns.ok() || !ValidateKeys(keys, options_.limits).ok()) return true;
  return store_->InMemoryOrAbsent(*ns, keys);
}

absl::StatusOr<std::vector<absl::Status>> NodeCore::Pin(const v1::Tenant& t, const std::string& requested,
                                                        absl::Span<const BlockKey> keys, bool unpin) {
  OpScope op(pin_);
  auto ns = Namespace(t, requested);
  if (!ns.ok()) return op.Done(ns.status());
  if (absl::Status s = ValidateKeys(keys, options_.limits); !s.ok()) return op.Done(s);
  std::vector<absl::Status> out;
  out.reserve(keys.size());
  for (const BlockKey& k : keys) out.push_back(unpin ? store_->Unpin(t.id(), *ns, k) : store_->Pin(t.id(), *ns, k));
  op.Record(absl::OkStatus());
  return out;
}

namespace {
// Whether `rg` reads an open block of a sequence whose full blocks are
// `full`. A sequence's open blocks are its tail, so a range reads one iff its
// last block is not full.
bool ReadsOpenBlock(const std::map<uint64_t, BlockKey>& full, const BlockRange& rg) {
  return !full.contains(rg.end - 1);
}
}  // namespace

// The state of one Attend as its stages pass it on: the sequences' locks
// and statuses, the shape they share, the plan, and what the step did.
struct NodeCore::AttendWork {
  std::vector<SequenceTable::Handle> hs;
  std::vector<absl::Status> seq_status;      // per request sequence
  std::optional<BlockLayout> layout;         // the step's (unknown: every sequence failed first)
  KvEncoding encoding;                       // of the full blocks the step reads (open blocks are plain)
  KvEncoding seal;                           // what blocks the appends complete become (a new sequence's)
  std::vector<bool> learned;                 // sequences this step introduces to the node
  StepPlan plan;                             // over the sequences that planned
  std::vector<size_t> batch_of;              // plan sequence -> request sequence
  std::vector<std::vector<uint64_t>> opens;  // per plan sequence: blocks the step opens
  // The planned sequences' query rows and outputs, compacted when some
  // request sequences did not plan (host batches only).
  bool compact = false;
  std::vector<uint8_t> q_compact;
  std::vector<int64_t> pos_compact;
  std::vector<float> out_compact, lse_compact;
  std::vector<std::pair<uint32_t, uint32_t>> row_map;  // (request row, rows) per compacted sequence
  StepTimes times;
  uint32_t appended = 0, sealed = 0, nblocks = 0;

  void Fail(const AttendBatch& b, size_t i, absl::StatusCode code, absl::string_view why) {
    seq_status[i] = absl::Status(code, absl::StrCat("sequence '", b.sequences[i].sequence_id, "': ", why));
  }
};

absl::Status NodeCore::Attend(const v1::Tenant& t, const std::string& requested_ns, const AttendBatch& b,
                              PartialOutput out, AttendStats* stats) {
  OpScope op(attend_);
  const auto t0 = std::chrono::steady_clock::now();
  auto ns = Namespace(t, requested_ns);
  if (!ns.ok()) return op.Done(ns.status());
  AttendWork w;
  if (b.quantize.has_value()) {
    w.seal = *b.quantize;
  } else if (absl::Status s = ParseKvEncoding(t.kv_encoding(), &w.seal); !s.ok()) {
    return op.Done(absl::FailedPreconditionError(absl::StrCat("the tenant's kv_encoding: ", s.message())));
  }
  std::vector<std::string> ids;
  ids.reserve(b.sequences.size());
  for (const auto& s : b.sequences) ids.push_back(s.sequence_id);
  w.hs = sequences_->LockMany(*ns, ids);
  w.seq_status.resize(b.sequences.size());
  if (absl::Status s = ResolveShape(*ns, b, w); !s.ok()) return op.Done(s);
  if (!w.layout.has_value()) return Finish(op, t0, b, w, out, stats);  // every sequence failed first
  if (absl::Status s = CheckStepShape(b.shape, &*w.layout); !s.ok()) {
    return op.Done(absl::InvalidArgumentError(absl::StrCat("against the sequences' blocks: ", s.message())));
  }
  if (b.device != nullptr) {
    // Nothing is planned or applied before this: a refused exchange changes
    // nothing (OK, with the reason in stats: the caller sends it again without).
    if (std::string why = backend_->DeviceIoRefusal(*w.layout, w.encoding, b.shape.q_dtype); !why.empty()) {
      return op.Done(RefuseDeviceIo(std::move(why), stats));
    }
    if (w.encoding.quantized()) {
      for (size_t i = 0; i < b.sequences.size(); ++i) {
        const auto& full = w.hs[i].state().blocks;
        const auto& ranges = b.sequences[i].ranges;
        if (std::any_of(ranges.begin(), ranges.end(), [&](const BlockRange& rg) { return ReadsOpenBlock(full, rg); })) {
          return op.Done(RefuseDeviceIo(
              "a quantized sequence's open tail is attended in a second pass merged on the host (StepTwoEncodings)",
              stats));
        }
      }
    }
  }
  PlanStep(*ns, t.id(), b, w);
  if (absl::Status s = RunStep(b, out, w); !s.ok()) return op.Done(s);
  CommitStep(t.id(), b, w);
  return Finish(op, t0, b, w, out, stats);
}

absl::Status NodeCore::ResolveShape(NamespaceId ns, const AttendBatch& b, AttendWork& w) {
  // One layout and one encoding for the step: the sequences' own, or the
  // request's for a sequence this node has not seen yet.
  const size_t n = b.sequences.size();
  w.layout = b.layout;
  std::optional<KvEncoding> encoding;
  w.learned.assign(n, false);
  for (size_t i = 0; i < n; ++i) {
    SequenceState& st = w.hs[i].state();
    const AttendSequenceSpec& spec = b.sequences[i];
    if (st.placement_digest != 0 && spec.placement_digest != st.placement_digest) {
      // A fork the caller routed by another placement (one it has not
      // resolved): this node may not be where the request's chunks are.
      w.Fail(b, i, absl::StatusCode::kAborted,
             "a fork placed with its source's chunks, routed by another placement: resolve its placement "
             "(ListSequences) and route again");
      continue;
    }
    if (absl::Status s = LearnLayout(ns, st); !s.ok()) {
      w.Fail(b, i, s.code(), s.message());
      continue;
    }
    if (!st.layout.has_value()) {
      if (spec.append_tokens == 0) {
        w.Fail(b, i, absl::StatusCode::kNotFound, "no blocks on this node");
        continue;
      }
      w.learned[i] = true;  // recorded once the step succeeds
    } else {
      if (b.layout.has_value() && !(*b.layout == *st.layout)) {
        w.Fail(b, i, absl::StatusCode::kFailedPrecondition, "the request's layout differs from the sequence's blocks");
        continue;
      }
      if (!w.layout.has_value()) w.layout = st.layout;
      if (!(*w.layout == *st.layout)) {
        return absl::InvalidArgumentError("the sequences of one Attend must share one block layout");
      }
    }
    // The full blocks' encoding (a sequence without any here reads only
    // open blocks, which are plain, and agrees with any).
    if (st.blocks.empty()) continue;
    if (encoding.has_value() && !(*encoding == st.encoding)) {
      return absl::InvalidArgumentError("the sequences of one Attend must share one KV encoding");
    }
    encoding = st.encoding;
  }
  if (encoding.has_value()) w.encoding = *encoding;
  return absl::OkStatus();
}

void NodeCore::PlanStep(NamespaceId ns, TenantId tenant, const AttendBatch& b, AttendWork& w) {
  // The plan of each sequence: appends (each continues its layer's tail
  // here, or repeats tokens held), then the blocks its rows read.
  const size_t n = b.sequences.size();
  const BlockLayout& L = *w.layout;
  std::vector<StepSequence> planned(n);
  std::vector<std::vector<uint64_t>> opens(n);
  std::vector<uint32_t> row_of(n);
  for (size_t i = 0, row = 0, arow = 0; i < n; ++i) {
    row_of[i] = static_cast<uint32_t>(row);
    if (w.seq_status[i].ok()) {
      absl::Status s = PlanSequence(ns, tenant, b, i, static_cast<uint32_t>(row), static_cast<uint32_t>(arow), L,
                                    w.hs[i], &planned[i], &opens[i]);
      if (!s.ok()) w.Fail(b, i, s.code(), s.message());
    }
    row += b.sequences[i].rows;
    arow += b.sequences[i].append_tokens;
  }
  // The step over the sequences that planned; their query rows compacted
  // when some did not. A device batch's queries and output stay where they
  // are: the backend reads and writes each sequence's rows at its src_row
  // (only the host positions are compacted).
  StepPlan& plan = w.plan;
  plan.layout = L;
  plan.encoding = w.encoding;
  plan.shape = b.shape;
  plan.shape.num_rows = 0;  // counts the planned sequences' rows below
  plan.new_k = b.new_k;
  plan.new_v = b.new_v;
  plan.device = b.device;
  plan.queries = b.queries;
  plan.positions = b.positions;
  const size_t qrow = b.shape.query_row_bytes();
  for (size_t i = 0; i < n; ++i) w.compact |= !w.seq_status[i].ok() && b.sequences[i].rows > 0;
  const bool host_rows = b.device == nullptr;
  for (size_t i = 0; i < n; ++i) {
    if (!w.seq_status[i].ok()) continue;
    StepSequence ss = std::move(planned[i]);
    ss.row_begin = plan.shape.num_rows;
    ss.src_row = row_of[i];
    if (w.compact && ss.rows > 0) {
      if (host_rows) {
        w.q_compact.insert(w.q_compact.end(), b.queries.begin() + row_of[i] * qrow,
                           b.queries.begin() + (row_of[i] + ss.rows) * qrow);
      }
      w.pos_compact.insert(w.pos_compact.end(), b.positions.begin() + row_of[i],
                           b.positions.begin() + row_of[i] + ss.rows);
      w.row_map.emplace_back(row_of[i], ss.rows);
    }
    plan.shape.num_rows += ss.rows;
    plan.sequences.push_back(std::move(ss));
    w.batch_of.push_back(i);
    w.opens.push_back(std::move(opens[i]));
  }
  if (w.compact) {
    plan.positions = w.pos_compact;
    if (host_rows) plan.queries = w.q_compact;
  }
}

namespace {
// The first block of `rg` that is not a full block of `s` (rg.end: none).
// A sequence's open blocks are its tail, so a range's full blocks are a
// prefix of it: a binary search.
uint64_t FirstOpenBlock(const StepSequence& s, const BlockRange& rg) {
  uint64_t lo = rg.begin, hi = rg.end;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (s.full->contains(mid)) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// One pass of a two-encoding step: its plan over some of the step's blocks,
// with the rows of the sequences that read any of them gathered from the
// step's (host rows).
struct EncodingPass {
  StepPlan plan;
  std::vector<uint8_t> queries;
  std::vector<int64_t> positions;
  std::vector<size_t> step_index;  // per pass sequence: its index in the step
  PartialResult out;

  // Sequence i of `step` reads `ranges` in this pass (its rows only if it
  // reads any; its appends, if `appends`).
  void Add(const StepPlan& step, size_t i, std::vector<BlockRange> ranges, bool appends) {
    const StepSequence& s = step.sequences[i];
    if (ranges.empty() && (!appends || s.appends.empty())) return;
    step_index.push_back(i);
    StepSequence p = s;
    p.ranges = std::move(ranges);
    if (!appends) p.appends.clear();
    p.rows = p.ranges.empty() ? 0 : s.rows;
    p.row_begin = plan.shape.num_rows;
    const size_t qrow = step.shape.query_row_bytes();
    queries.insert(queries.end(), step.queries.begin() + size_t{s.row_begin} * qrow,
                   step.queries.begin() + size_t{s.row_begin + p.rows} * qrow);
    positions.insert(positions.end(), step.positions.begin() + s.row_begin,
                     step.positions.begin() + s.row_begin + p.rows);
    plan.shape.num_rows += p.rows;
    plan.sequences.push_back(std::move(p));
  }
};
}  // namespace

bool NodeCore::ReadsOpenTailOfQuantized(const StepPlan& plan) {
  if (!plan.encoding.quantized()) return false;
  for (const StepSequence& s : plan.sequences) {
    for (const BlockRange& rg : s.ranges) {
      if (ReadsOpenBlock(*s.full, rg)) return true;
    }
  }
  return false;
}

absl::Status NodeCore::StepTwoEncodings(const StepPlan& plan, PartialOutput out, StepTimes* times) {
  if (plan.device != nullptr) {  // Attend refuses these exchanges first
    return absl::InternalError("a two-encoding step with its rows in GPU memory");
  }
  // Pass 1: the appends and the full blocks, in the sequences' encoding.
  // Pass 2: the open blocks (the appended tail, with pass 1's appends), plain.
  EncodingPass full, tail;
  for (EncodingPass* p : {&full, &tail}) {
    p->plan.layout = plan.layout;
    p->plan.shape = plan.shape;
    p->plan.shape.num_rows = 0;
  }
  full.plan.encoding = plan.encoding;
  full.plan.new_k = plan.new_k;
  full.plan.new_v = plan.new_v;
  for (size_t i = 0; i < plan.sequences.size(); ++i) {
    const StepSequence& s = plan.sequences[i];
    std::vector<BlockRange> fr, tr;
    for (const BlockRange& rg : s.ranges) {
      const uint64_t cut = FirstOpenBlock(s, rg);
      if (cut > rg.begin) fr.push_back({rg.begin, cut});
      if (cut < rg.end) tr.push_back({cut, rg.end});
    }
    full.Add(plan, i, std::move(fr), /*appends=*/true);
    tail.Add(plan, i, std::move(tr), /*appends=*/false);
  }
  StepTimes t;
  for (EncodingPass* p : {&full, &tail}) {
    if (p->plan.sequences.empty()) continue;
    p->plan.queries = p->queries;
    p->plan.positions = p->positions;
    p->out = PartialResult(p->plan.shape.num_rows, plan.shape.q_heads, plan.shape.head_dim);
    KVRING_RETURN_IF_ERROR(backend_->Step(p->plan, p->out.view(), &t));
    if (times != nullptr) {
      times->kernel_seconds += t.kernel_seconds;
      times->copy_seconds += t.copy_seconds;
    }
  }
  // Each row: its partials of the two passes merged by LSE.
  const StepShape& sh = plan.shape;
  std::fill(out.out, out.out + sh.out_floats(), 0.f);
  std::fill(out.lse, out.lse + sh.lse_floats(), -std::numeric_limits<float>::infinity());
  for (const EncodingPass* p : {&full, &tail}) {
    for (size_t j = 0; j < p->plan.sequences.size(); ++j) {
      const StepSequence& ps = p->plan.sequences[j];
      if (ps.rows == 0) continue;
      const uint32_t r0 = plan.sequences[p->step_index[j]].row_begin;
      MergeInto(PartialOutput{out.out + size_t{r0} * sh.row_elems(), out.lse + size_t{r0} * sh.q_heads},
                ConstPartial{p->out.out.data() + size_t{ps.row_begin} * sh.row_elems(),
                             p->out.lse.data() + size_t{ps.row_begin} * sh.q_heads},
                ps.rows, sh.q_heads, sh.head_dim);
    }
  }
  return absl::OkStatus();
}

absl::Status NodeCore::RunStep(const AttendBatch& b, PartialOutput out, AttendWork& w) {
  const StepPlan& plan = w.plan;
  const bool compact_out = w.compact && b.device == nullptr;
  const size_t orow = b.shape.row_elems(), hq = b.shape.q_heads;
  PartialOutput step_out = out;
  if (compact_out) {
    w.out_compact.resize(plan.shape.out_floats());
    w.lse_compact.resize(plan.shape.lse_floats());
    step_out = PartialOutput{w.out_compact.data(), w.lse_compact.data()};
  }
  // Open the new blocks: a failure undoes the step's opens and fails it.
  std::vector<std::pair<size_t, uint64_t>> opened;  // (plan index, block)
  for (size_t k = 0; k < plan.sequences.size(); ++k) {
    for (uint64_t idx : w.opens[k]) {
      absl::Status s = backend_->OpenBlock(plan.sequences[k].seq, idx, plan.layout);
      if (!s.ok()) return RollBack(plan, opened, s);
      opened.emplace_back(k, idx);
    }
  }
  if (!plan.sequences.empty()) {
    absl::Status s = ReadsOpenTailOfQuantized(plan) ? StepTwoEncodings(plan, step_out, &w.times)
                                                    : backend_->Step(plan, step_out, &w.times);
    if (!s.ok()) return RollBack(plan, opened, s);
  }
  if (compact_out) {
    for (size_t r = 0, k = 0; k < w.row_map.size(); ++k) {
      const auto [row, rows] = w.row_map[k];
      std::memcpy(out.out + size_t{row} * orow, w.out_compact.data() + r * orow, rows * orow * 4);
      std::memcpy(out.lse + size_t{row} * hq, w.lse_compact.data() + r * hq, size_t{rows} * hq * 4);
      r += rows;
    }
  }
  return absl::OkStatus();
}

void NodeCore::CommitStep(TenantId tenant, const AttendBatch& b, AttendWork& w) {
  // Advance the filled counts, store the blocks that are complete.
  const BlockLayout& L = *w.layout;
  const uint32_t layer = b.shape.options.layer;
  for (size_t k = 0; k < w.plan.sequences.size(); ++k) {
    const size_t i = w.batch_of[k];
    const StepSequence& ss = w.plan.sequences[k];
    SequenceState& st = w.hs[i].state();
    if (w.learned[i]) {
      st.layout = L;
      st.encoding = KvEncoding{};
    }
    for (const StepAppend& a : ss.appends) {
      OpenBlockState& ob = st.open[a.index];
      if (ob.filled.empty()) ob.filled.assign(L.layers, 0);
      ob.filled[layer] = a.offset + a.count;
      w.appended += a.count;
    }
    w.nblocks += static_cast<uint32_t>(ss.num_blocks());
    if (!ss.appends.empty()) w.sealed += SealCompleteBlocks(tenant, w.hs[i], w.seal);
  }
}

absl::Status NodeCore::RollBack(const StepPlan& plan, const std::vector<std::pair<size_t, uint64_t>>& opened,
                                absl::Status why) {
  for (const auto& [k, idx] : opened) backend_->DiscardOpenBlock(plan.sequences[k].seq, idx);
  return why;
}

absl::Status NodeCore::Finish(OpScope& op, std::chrono::steady_clock::time_point t0, const AttendBatch& b,
                              const AttendWork& w, PartialOutput out, AttendStats* stats) {
  const std::vector<absl::Status>& seq_status = w.seq_status;
  const StepTimes& times = w.times;
  const uint32_t appended = w.appended, sealed = w.sealed, nblocks = w.nblocks;
  // Rows of the sequences that failed see nothing: O = 0, LSE = -inf (a
  // device batch's are left as they were: the caller reads no row of a
  // sequence not served).
  const size_t orow = b.shape.row_elems(), hq = b.shape.q_heads;
  for (size_t i = 0, row = 0; b.device == nullptr && i < b.sequences.size(); row += b.sequences[i].rows, ++i) {
    if (seq_status[i].ok() || b.sequences[i].rows == 0) continue;
    std::fill(out.out + row * orow, out.out + (row + b.sequences[i].rows) * orow, 0.f);
    std::fill(out.lse + row * hq, out.lse + (row + b.sequences[i].rows) * hq, -std::numeric_limits<float>::infinity());
  }
  appended_tokens_->Add(appended);
  attend_kernel_->Observe(times.kernel_seconds);
  if (stats != nullptr) {
    stats->blocks_used = nblocks;
    stats->appended_tokens = appended;
    stats->completed_blocks = sealed;
    stats->kernel_seconds = times.kernel_seconds;
    stats->copy_seconds = times.copy_seconds;
    stats->done_event = times.done_event;
    stats->done_flag = times.done_flag;
    stats->compute_seconds = Since(t0);
    stats->backend = backend_->name();
    stats->sequence_status = seq_status;
  }
  // One sequence of one: its error is the request's.
  if (b.sequences.size() == 1 && !seq_status[0].ok()) return op.Done(seq_status[0]);
  return op.Done(absl::OkStatus());
}

namespace {

// A step's reads of one sequence (NodeCore::PlanSequence): each range's
// blocks are full here, or open with exactly the tokens the request expects
// (`filled_after`: the blocks this request appends to, and their tokens
// after it). Open blocks are few (the tail); the rest is checked against the
// runs of full blocks, O(log n) a range. Adds the ranges to `ss`.
absl::Status PlanReads(const SequenceState& st, const AttendSequenceSpec& spec,
                       const absl::flat_hash_map<uint64_t, uint32_t>& filled_after, uint32_t layer, uint32_t bt,
                       StepSequence* ss) {
  const uint64_t last_block = (spec.tokens + bt - 1) / bt;
  const bool last_partial = spec.tokens % bt != 0;
  for (const BlockRange& rg : spec.ranges) {
    if (rg.end > last_block) {
      return absl::InvalidArgumentError(absl::StrCat("block range ends at ", rg.end, " but ", spec.tokens,
                                                     " tokens fill only ", last_block, " blocks"));
    }
    std::vector<uint64_t> opens_here;
    for (auto it = st.open.lower_bound(rg.begin); it != st.open.end() && it->first < rg.end; ++it) {
      opens_here.push_back(it->first);
    }
    for (const auto& [idx, n] : filled_after) {
      if (idx >= rg.begin && idx < rg.end && !st.open.count(idx)) opens_here.push_back(idx);
    }
    std::sort(opens_here.begin(), opens_here.end());
    uint64_t from = rg.begin;
    for (uint64_t idx : opens_here) {
      const uint32_t expect = ss->BlockTokens(idx, bt);
      auto fa = filled_after.find(idx);
      const uint32_t have = fa != filled_after.end() ? fa->second : st.open.at(idx).filled[layer];
      if (have != expect) {
        return absl::NotFoundError(
            absl::StrCat("block ", idx, " holds ", have, " of ", expect, " tokens of layer ", layer, " on this node"));
      }
      if (!st.runs.Covers(from, idx)) {
        return absl::NotFoundError(absl::StrCat("block ", st.runs.FirstMissing(from, idx), " is not on this node"));
      }
      from = idx + 1;
    }
    if (!st.runs.Covers(from, rg.end)) {
      return absl::NotFoundError(absl::StrCat("block ", st.runs.FirstMissing(from, rg.end), " is not on this node"));
    }
    if (last_partial && last_block - 1 >= from && last_block - 1 < rg.end) {
      return absl::FailedPreconditionError(
          absl::StrCat("block ", last_block - 1, " is complete here, but ", spec.tokens, " tokens end inside it"));
    }
    ss->ranges.push_back(rg);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status NodeCore::PlanSequence(NamespaceId ns, TenantId tenant, const AttendBatch& b, size_t i, uint32_t row,
                                    uint32_t arow, const BlockLayout& L, SequenceTable::Handle& h, StepSequence* ss,
                                    std::vector<uint64_t>* opens) {
  SequenceState& st = h.state();
  st.last_use = Now();
  const AttendSequenceSpec& spec = b.sequences[i];
  const uint32_t bt = L.block_tokens, layer = b.shape.options.layer;
  ss->seq = SequenceRef{ns, spec.sequence_id, tenant};
  ss->row_begin = row;
  ss->rows = spec.rows;
  absl::flat_hash_map<uint64_t, uint32_t> filled_after;  // blocks this request appends to: tokens after it
  for (uint64_t p = spec.append_position, left = spec.append_tokens, src = arow; left > 0;) {
    const uint64_t idx = p / bt;
    const uint32_t off = static_cast<uint32_t>(p % bt);
    const uint32_t cnt = static_cast<uint32_t>(std::min<uint64_t>(left, bt - off));
    // Tokens this node already holds at these positions (a retried step):
    // they must be the same bytes, and are not written again.
    uint32_t have = 0;
    auto full = st.blocks.find(idx);
    auto o = st.open.find(idx);
    if (full != st.blocks.end()) {
      have = bt;
    } else if (o != st.open.end()) {
      have = o->second.filled[layer];
    }
    if (have < off) {
      // The tokens before the append are not here (lost with a node, or
      // never appended): what the engine can act on is where they start.
      const uint64_t first_missing = idx * bt + have;
      return absl::DataLossError(absl::StrCat(
          "sequence '", spec.sequence_id, "' layer ", layer, ": append at position ", p,
          " but this node holds the sequence only up to position ", first_missing, " (first missing position ",
          first_missing, "): truncate the sequence to ", first_missing, " and append again from there"));
    }
    const uint32_t dup = std::min(cnt, have - off);
    if (dup > 0) KVRING_RETURN_IF_ERROR(SameTokens(ns, h, idx, layer, off, dup, b, static_cast<uint32_t>(src), L));
    if (dup < cnt) {
      if (full == st.blocks.end() && o == st.open.end()) opens->push_back(idx);
      ss->appends.push_back(StepAppend{idx, off + dup, cnt - dup, static_cast<uint32_t>(src + dup)});
      filled_after[idx] = off + cnt;
    }
    p += cnt;
    left -= cnt;
    src += cnt;
  }
  ss->tokens = spec.tokens;
  KVRING_RETURN_IF_ERROR(PlanReads(st, spec, filled_after, layer, bt, ss));
  ss->full = &st.blocks;
  return absl::OkStatus();
}

absl::Status NodeCore::SameTokens(NamespaceId ns, SequenceTable::Handle& h, uint64_t idx, uint32_t layer, uint32_t off,
                                  uint32_t count, const AttendBatch& b, uint32_t src_row, const BlockLayout& L) {
  std::vector<uint8_t> block;
  const uint8_t* base = nullptr;
  PinnedBlock pb;
  auto full = h.state().blocks.find(idx);
  if (full != h.state().blocks.end()) {
    absl::StatusOr<PinnedBlock> got = store_->Acquire(ns, full->second);
    if (!got.ok()) return got.status();
    if (got->meta().encoding.quantized()) {
      return absl::FailedPreconditionError(absl::StrCat("block ", idx, " is complete (quantized) on this node"));
    }
    pb = std::move(*got);
    base = pb.payload().data();
  } else {
    block.resize(L.bytes());
    KVRING_RETURN_IF_ERROR(backend_->ReadOpenBlock(SequenceRef{ns, h.id(), 0}, idx, absl::MakeSpan(block)));
    base = block.data();
  }
  const size_t esz = DTypeSize(L.dtype), row = size_t{L.head_dim} * esz;
  const size_t n = size_t{count} * L.kv_heads * row, at = size_t{src_row} * L.kv_heads * row;
  // Rows [src_row, src_row + count) of the appended K and V.
  const uint8_t* new_k = nullptr;
  const uint8_t* new_v = nullptr;
  std::vector<uint8_t> staged;  // a device batch's rows, read to the host
  if (b.device == nullptr) {
    new_k = b.new_k.data() + at;
    new_v = b.new_v.data() + at;
  } else {
    staged.resize(2 * n);
    KVRING_RETURN_IF_ERROR(b.device->read(b.device->new_k + at, absl::MakeSpan(staged.data(), n)));
    KVRING_RETURN_IF_ERROR(b.device->read(b.device->new_v + at, absl::MakeSpan(staged.data() + n, n)));
    new_k = staged.data();
    new_v = staged.data() + n;
  }
  for (uint32_t t = 0; t < count; ++t) {
    for (uint32_t hd = 0; hd < L.kv_heads; ++hd) {
      const size_t src = (size_t{t} * L.kv_heads + hd) * row;
      if (std::memcmp(base + L.index(layer, 0, hd, off + t, 0) * esz, new_k + src, row) != 0 ||
          std::memcmp(base + L.index(layer, 1, hd, off + t, 0) * esz, new_v + src, row) != 0) {
        const uint64_t pos = idx * L.block_tokens + off + t;
        return absl::FailedPreconditionError(absl::StrCat(
            "sequence '", h.id(), "' layer ", layer, ": append at position ", pos,
            " differs from the token this node already holds there (a retry with other K/V): truncate the sequence "
            "to ",
            pos, " first to replace it"));
      }
    }
  }
  return absl::OkStatus();
}

uint32_t NodeCore::SealCompleteBlocks(TenantId tenant, SequenceTable::Handle& h, const KvEncoding& seal) {
  SequenceState& st = h.state();
  const BlockLayout& L = *st.layout;
  uint32_t sealed = 0;
  std::vector<uint8_t> buf, encoded;
  for (auto it = st.open.begin(); it != st.open.end();) {
    if (!it->second.Complete(L.block_tokens)) {
      ++it;
      continue;
    }
    const uint64_t idx = it->first;
    const SequenceRef ref{h.ns(), h.id(), tenant};
    PutArgs a;
    a.tenant = tenant;
    a.ns = h.ns();
    a.key = SealKey(h, idx, L);
    a.meta.layout = L;
    // One encoding a sequence: its full blocks', or `seal` for its first.
    a.meta.encoding = st.blocks.empty() ? seal : st.encoding;
    buf.resize(L.bytes());
    absl::Status s = backend_->ReadOpenBlock(ref, idx, absl::MakeSpan(buf));
    absl::Span<const uint8_t> payload = buf;
    if (s.ok() && a.meta.encoding.quantized()) {
      s = QuantizeBlock(L, buf, a.meta.encoding, &encoded);
      payload = encoded;
    }
    a.meta.payload_bytes = static_cast<uint32_t>(payload.size());
    if (s.ok()) s = store_->Put(a, payload).status();
    if (s.ok()) s = h.Record(idx, a.key, /*owned=*/true);
    if (!s.ok()) {
      // Left open (its bytes stay in the backend); the next append retries.
      KVRING_LOG(WARNING) << "sequence '" << h.id() << "' block " << idx << " is complete but not stored yet: " << s;
      ++it;
      continue;
    }
    st.encoding = a.meta.encoding;
    if (a.meta.encoding.quantized()) quantized_->Add(1);
    backend_->SealBlock(ref, idx, a.key, a.meta.encoding);
    it = st.open.erase(it);
    ++sealed;
  }
  sealed_blocks_->Add(sealed);
  return sealed;
}

absl::Status NodeCore::LearnLayout(NamespaceId ns, SequenceState& st) {
  if (st.layout.has_value() || st.blocks.empty()) return absl::OkStatus();
  const auto& [index, key] = *st.blocks.begin();
  absl::StatusOr<PinnedBlock> pb = store_->Acquire(ns, key);
  if (!pb.ok()) return absl::Status(pb.status().code(), absl::StrCat("block ", index, ": ", pb.status().message()));
  st.layout = pb->meta().layout;
  st.encoding = pb->meta().encoding;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NodeCore::KeptBlock>> NodeCore::KeptBlocks(SequenceTable::Handle& h, TenantId tenant,
                                                                      const BlockLayout& L, uint64_t tokens,
                                                                      absl::string_view cut) {
  const SequenceState& st = h.state();
  const uint64_t keep = tokens / L.block_tokens;
  const uint32_t rem = static_cast<uint32_t>(tokens % L.block_tokens);
  const uint64_t ends = keep + (rem > 0 ? 1 : 0);  // blocks [0, ends) hold tokens below the cut
  const SequenceRef ref{h.ns(), h.id(), tenant};
  std::vector<KeptBlock> kept;
  for (auto it = st.open.begin(); it != st.open.end() && it->first < ends; ++it) {
    KeptBlock k{it->first, it->second.filled, std::vector<uint8_t>(L.bytes())};
    const uint32_t below = it->first < keep ? L.block_tokens : rem;
    for (uint32_t& f : k.filled) f = std::min(f, below);
    KVRING_RETURN_IF_ERROR(backend_->ReadOpenBlock(ref, it->first, absl::MakeSpan(k.bytes)));
    kept.push_back(std::move(k));
  }
  if (rem > 0 && st.blocks.contains(keep) && !st.open.contains(keep)) {
    KVRING_ASSIGN_OR_RETURN(PinnedBlock pb, store_->Acquire(h.ns(), st.blocks.at(keep)));
    if (pb.meta().encoding.quantized() || !(pb.meta().layout == L)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence '", h.id(), "': ", cut, " ", tokens, " tokens cuts into block ", keep,
          ", which is stored quantized or in another layout; cut at a block boundary (", keep * L.block_tokens, ")"));
    }
    kept.push_back(KeptBlock{keep, std::vector<uint32_t>(L.layers, rem),
                             std::vector<uint8_t>(pb.payload().begin(), pb.payload().end())});
  }
  return kept;
}

BlockKey NodeCore::SealKey(SequenceTable::Handle& h, uint64_t index, const BlockLayout& L) {
  // The block's own key, unless another sequence still holds a block under
  // it (a fork of this one, made before this one was truncated below the
  // fork point): then the key of a later generation, so that the fork keeps
  // its bytes and this sequence gets its new ones.
  BlockKey key = SequenceBlockKey(h.ns(), h.id(), index, L);
  for (uint64_t generation = 1;
       sequences_->References(key).records > 0 || store_->Contains(h.ns(), absl::MakeConstSpan(&key, 1)).front();
       ++generation) {
    key = SequenceBlockKey(h.ns(), absl::StrCat(h.id(), "\x1f", generation), index, L);
  }
  return key;
}

absl::Status NodeCore::DropFullBlocksFrom(SequenceTable::Handle& h, uint64_t first, SequenceChange* c) {
  KVRING_ASSIGN_OR_RETURN(std::vector<ReleasedBlock> released, h.UnrecordFrom(first));
  EraseReleased(h, h.state().layout, released, c);
  return absl::OkStatus();
}

void NodeCore::EraseReleased(const SequenceTable::Handle& h, const std::optional<BlockLayout>& L,
                             const std::vector<ReleasedBlock>& released, SequenceChange* c) {
  for (const ReleasedBlock& r : released) {
    // Blocks no sequence here holds any more, that the node made (sealed
    // from appends; a record from before forks were built: the sequence's
    // own key), go. A block PutSequence named by another key (a prefix-cache
    // chain) is the prefix cache's too and stays, evictable.
    const bool own = r.owned || (L.has_value() && r.key == SequenceBlockKey(h.ns(), h.id(), r.index, *L));
    if (!own) continue;
    absl::Status e = store_->Erase(h.ns(), r.key);
    if (e.ok()) {
      ++c->blocks_erased;
    } else if (!absl::IsNotFound(e)) {
      KVRING_LOG(WARNING) << "sequence '" << h.id() << "' block " << r.index << " stays in the store: " << e;
    }
  }
}

absl::StatusOr<SequenceChange> NodeCore::DeleteSequence(const v1::Tenant& t, const std::string& requested,
                                                        const std::string& id) {
  OpScope op(sequence_ops_);
  auto ns = Namespace(t, requested);
  if (!ns.ok()) return op.Done(ns.status());
  if (absl::Status s = ValidateSequenceId(id, options_.limits.max_sequence_id_bytes); !s.ok()) return op.Done(s);
  SequenceTable::Handle h = sequences_->Lock(*ns, id);
  absl::StatusOr<SequenceChange> c = ForgetLocked(h, static_cast<TenantId>(t.id()));
  op.Record(c.status());
  return c;
}

absl::StatusOr<SequenceChange> NodeCore::ForgetLocked(SequenceTable::Handle& h, TenantId tenant) {
  SequenceState& st = h.state();
  SequenceChange c;
  c.held = st.layout.has_value() || !st.blocks.empty() || !st.open.empty();
  const std::optional<BlockLayout> layout = st.layout;
  c.open_blocks_dropped = st.open.size();
  backend_->ForgetSequence(SequenceRef{h.ns(), h.id(), tenant});
  KVRING_ASSIGN_OR_RETURN(std::vector<ReleasedBlock> released, h.Forget());
  EraseReleased(h, layout, released, &c);
  return c;
}

absl::StatusOr<uint64_t> NodeCore::ExpireIdleSequences() {
  absl::flat_hash_map<NamespaceId, std::pair<TenantId, absl::Duration>> ttl;
  absl::flat_hash_set<NamespaceId> namespaces;
  for (const v1::Tenant& t : tenants_->tenants()) {
    if (t.sequence_ttl_s() == 0) continue;
    const NamespaceId ns = NamespaceIdOf(t.namespace_());
    ttl[ns] = {static_cast<TenantId>(t.id()),
               absl::Seconds(static_cast<int64_t>(std::min<uint64_t>(t.sequence_ttl_s(), uint64_t{1} << 40)))};
    namespaces.insert(ns);
  }
  if (namespaces.empty()) return uint64_t{0};
  const absl::Time now = Now();
  uint64_t expired = 0;
  for (const auto& [ns, id] : sequences_->SequencesIn(namespaces)) {
    const auto& [tenant, limit] = ttl[ns];
    SequenceTable::Handle h = sequences_->Lock(ns, id);
    absl::Time& last = h.state().last_use;
    if (last == absl::InfinitePast()) {
      last = now;  // recovered at start, or never named since: its clock starts now
      continue;
    }
    if (now - last < limit) continue;
    absl::StatusOr<SequenceChange> c = ForgetLocked(h, tenant);
    if (!c.ok()) return c.status();
    if (c->held) ++expired;
  }
  expired_sequences_->Add(expired);
  return expired;
}

absl::Status NodeCore::Reopen(const SequenceRef& ref, uint64_t index, const std::vector<uint32_t>& filled,
                              absl::Span<const uint8_t> bytes, const BlockLayout& L) {
  KVRING_RETURN_IF_ERROR(backend_->OpenBlock(ref, index, L));
  const size_t row_bytes = size_t{L.kv_heads} * L.head_dim * DTypeSize(L.dtype);
  const std::map<uint64_t, BlockKey> none;
  for (uint32_t l = 0; l < L.layers && l < filled.size(); ++l) {
    const uint32_t n = filled[l];
    if (n == 0) continue;
    std::vector<uint8_t> k(n * row_bytes), v(k.size());
    CopyTokenRows(L, bytes.data(), l, n, k.data(), v.data());
    StepPlan plan;
    plan.layout = L;
    plan.shape.options.layer = l;
    plan.shape.q_heads = L.kv_heads;
    plan.shape.head_dim = L.head_dim;
    plan.shape.q_dtype = L.dtype;
    plan.new_k = k;
    plan.new_v = v;
    StepSequence ss;
    ss.seq = ref;
    ss.tokens = index * L.block_tokens + n;
    ss.full = &none;
    ss.appends.push_back(StepAppend{index, 0, n, 0});
    plan.sequences.push_back(std::move(ss));
    KVRING_RETURN_IF_ERROR(backend_->Step(plan, PartialOutput{nullptr, nullptr}, nullptr));
  }
  return absl::OkStatus();
}

absl::StatusOr<SequenceChange> NodeCore::TruncateSequence(const v1::Tenant& t, const std::string& requested,
                                                          const std::string& id, uint64_t tokens) {
  OpScope op(sequence_ops_);
  auto ns = Namespace(t, requested);
  if (!ns.ok()) return op.Done(ns.status());
  if (absl::Status s = ValidateSequenceId(id, options_.limits.max_sequence_id_bytes); !s.ok()) return op.Done(s);
  if (tokens > kMaxSequenceTokens) {
    return op.Done(absl::InvalidArgumentError(absl::StrCat("truncate to ", tokens, " tokens: over the limit")));
  }
  SequenceTable::Handle h = sequences_->Lock(*ns, id);
  SequenceState& st = h.state();
  st.last_use = Now();
  SequenceChange c;
  c.held = st.layout.has_value() || !st.blocks.empty() || !st.open.empty();
  if (absl::Status s = LearnLayout(*ns, st); !s.ok()) return op.Done(s);  // after a restart: only keys
  if (!st.layout.has_value()) {
    op.Record(absl::OkStatus());
    return c;
  }
  const BlockLayout L = *st.layout;
  const uint64_t keep = tokens / L.block_tokens;
  const uint32_t rem = static_cast<uint32_t>(tokens % L.block_tokens);
  const uint64_t ends = keep + (rem > 0 ? 1 : 0);  // blocks [0, ends) hold kept tokens
  const TenantId tenant = static_cast<TenantId>(t.id());
  const SequenceRef ref{*ns, id, tenant};
  // The blocks that stay partly (with their bytes: the backend is reset
  // below, so that no copy of a cut block, in HBM say, survives).
  absl::StatusOr<std::vector<KeptBlock>> survivors = KeptBlocks(h, tenant, L, tokens, "truncating to");
  if (!survivors.ok()) return op.Done(survivors.status());
  for (const auto& [index, o] : st.open) c.open_blocks_dropped += index >= ends;
  // Full blocks from the cut on go (the reopened one too: it is open now).
  if (absl::Status s = DropFullBlocksFrom(h, keep, &c); !s.ok()) return op.Done(s);
  backend_->ForgetSequence(ref);
  st.open.clear();
  for (const KeptBlock& sv : *survivors) {
    if (absl::Status s = Reopen(ref, sv.index, sv.filled, sv.bytes, L); !s.ok()) {
      backend_->DiscardOpenBlock(ref, sv.index);
      return op.Done(absl::Status(
          s.code(), absl::StrCat("sequence '", id, "': reopening block ", sv.index, " after the cut: ", s.message())));
    }
    st.open[sv.index] = OpenBlockState{sv.filled};
  }
  op.Record(absl::OkStatus());
  return c;
}

namespace {
// The highest token position + 1 a node holds of a sequence, on layer 0.
uint64_t HeldTokens(const SequenceState& st) {
  if (!st.layout.has_value()) return 0;
  const uint32_t bt = st.layout->block_tokens;
  uint64_t tokens = 0;
  if (!st.blocks.empty()) tokens = (st.blocks.rbegin()->first + 1) * bt;
  if (!st.open.empty()) {
    const auto& [idx, o] = *st.open.rbegin();
    if (!o.filled.empty()) tokens = std::max<uint64_t>(tokens, idx * bt + o.filled[0]);
  }
  return tokens;
}
}  // namespace

std::vector<v1::SequenceInfo> NodeCore::DescribeSequences(NamespaceId ns, absl::Span<const std::string> ids) {
  std::vector<v1::SequenceInfo> out;
  std::vector<std::pair<NamespaceId, std::string>> which;
  if (ids.empty()) {
    which = sequences_->SequencesIn({ns});
  } else {
    for (const std::string& id : ids) which.emplace_back(ns, id);
  }
  for (const auto& [sns, id] : which) {
    SequenceTable::Handle h = sequences_->Lock(sns, id);
    SequenceState& st = h.state();
    if (!st.layout.has_value() && st.blocks.empty() && st.open.empty() && st.placement.empty()) continue;
    (void)LearnLayout(sns, st);  // listed without a layout if its first block cannot be read
    v1::SequenceInfo info;
    info.set_sequence_id(id);
    info.set_full_blocks(st.blocks.size());
    info.set_open_blocks(st.open.size());
    if (st.layout.has_value()) {
      info.set_bytes(st.blocks.size() * EncodedBytes(*st.layout, st.encoding));
      info.set_block_tokens(st.layout->block_tokens);
    }
    info.set_tokens(HeldTokens(st));
    std::vector<BlockKey> keys;
    keys.reserve(st.blocks.size());
    for (const auto& [i, key] : st.blocks) keys.push_back(key);
    info.set_shared_blocks(sequences_->CountShared(keys));
    const BlockStore::TierCounts tiers = store_->CountTiers(sns, keys);
    info.set_host_blocks(tiers.host);
    info.set_cold_blocks(tiers.cold);
    st.placement.ToProto(info.mutable_placement());
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<std::vector<v1::SequenceInfo>> NodeCore::ListSequences(const v1::Tenant& t, const std::string& requested,
                                                                      absl::Span<const std::string> ids) {
  OpScope op(sequence_ops_);
  auto ns = Namespace(t, requested);
  if (!ns.ok()) return op.Done(ns.status());
  if (ids.size() > options_.limits.max_attend_sequences) {
    return op.Done(absl::InvalidArgumentError(absl::StrCat("ListSequences names ", ids.size(), " sequences; at most ",
                                                           options_.limits.max_attend_sequences)));
  }
  for (const std::string& id : ids) {
    if (absl::Status s = ValidateSequenceId(id, options_.limits.max_sequence_id_bytes); !s.ok()) return op.Done(s);
  }
  std::vector<v1::SequenceInfo> out = DescribeSequences(*ns, ids);
  op.Record(absl::OkStatus());
  return out;
}

absl::StatusOr<std::vector<SequenceBlockOut>> NodeCore::ReadSequence(const v1::Tenant& t, const std::string& requested,
                                                                     const std::string& id, uint64_t begin,
                                                                     uint64_t end) {
  OpScope op(sequence_ops_);
  auto ns = Namespace(t, requested);
  if (!ns.ok()) return op.Done(ns.status());
  if (absl::Status s = ValidateSequenceId(id, options_.limits.max_sequence_id_bytes); !s.ok()) return op.Done(s);
  if (end < begin || end - begin > 64) {
    return op.Done(absl::InvalidArgumentError(
        absl::StrCat("ReadSequence of blocks [", begin, ", ", end, "): at most 64 blocks a call")));
  }
  SequenceTable::Handle h = sequences_->Lock(*ns, id);
  SequenceState& st = h.state();
  std::vector<SequenceBlockOut> out;
  if (absl::Status s = LearnLayout(*ns, st); !s.ok()) return op.Done(s);
  if (!st.layout.has_value()) {
    op.Record(absl::OkStatus());
    return out;
  }
  const BlockLayout L = *st.layout;
  const SequenceRef ref{*ns, id, static_cast<TenantId>(t.id())};
  for (auto it = st.blocks.lower_bound(begin); it != st.blocks.end() && it->first < end; ++it) {
    absl::StatusOr<PinnedBlock> pb = store_->Acquire(*ns, it->second);
    if (!pb.ok()) {
      return op.Done(absl::Status(pb.status().code(),
                                  absl::StrCat("sequence '", id, "' block ", it->first, ": ", pb.status().message())));
    }
    SequenceBlockOut b;
    b.index = it->first;
    b.key = it->second;
    b.meta = pb->meta();
    b.bytes.assign(pb->payload().begin(), pb->payload().end());
    out.push_back(std::move(b));
  }
  for (auto it = st.open.lower_bound(begin); it != st.open.end() && it->first < end; ++it) {
    SequenceBlockOut b;
    b.index = it->first;
    b.meta.layout = L;
    b.meta.payload_bytes = static_cast<uint32_t>(L.bytes());
    b.filled = it->second.filled;
    b.bytes.resize(L.bytes());
    if (absl::Status s = backend_->ReadOpenBlock(ref, it->first, absl::MakeSpan(b.bytes)); !s.ok()) return op.Done(s);
    out.push_back(std::move(b));
  }
  std::sort(out.begin(), out.end(),
            [](const SequenceBlockOut& a, const SequenceBlockOut& b) { return a.index < b.index; });
  op.Record(absl::OkStatus());
  return out;
}

absl::StatusOr<ForkChange> NodeCore::ForkSequence(const v1::Tenant& t, const std::string& requested,
                                                  const std::string& source, const std::string& id, uint64_t tokens,
                                                  const SequencePlacement& placement) {
  OpScope op(sequence_ops_);
  auto ns = Namespace(t, requested);
  if (!ns.ok()) return op.Done(ns.status());
  for (const std::string* s : {&source, &id}) {
    if (absl::Status v = ValidateSequenceId(*s, options_.limits.max_sequence_id_bytes); !v.ok()) return op.Done(v);
  }
  if (source == id) return op.Done(absl::InvalidArgumentError(absl::StrCat("sequence '", id, "' forked onto itself")));
  if (tokens == 0 || tokens > kMaxSequenceTokens) {
    return op.Done(absl::InvalidArgumentError(
        absl::StrCat("a fork of ", tokens, " tokens (1 to ", kMaxSequenceTokens, "; a new sequence needs no fork)")));
  }
  if (placement.empty()) {
    return op.Done(absl::InvalidArgumentError("a fork needs its placement (the source's chunks it shares)"));
  }
  const std::string ids[2] = {source, id};
  std::vector<SequenceTable::Handle> hs = sequences_->LockMany(*ns, ids);
  SequenceState& dst = hs[1].state();
  const bool exists = dst.layout.has_value() || !dst.blocks.empty() || !dst.open.empty() || !dst.placement.empty();
  if (exists) {
    if (dst.placement == placement) {  // the same fork again
      ForkChange c;
      c.held = dst.layout.has_value();
      c.source_tokens = HeldTokens(hs[0].state());
      op.Record(absl::OkStatus());
      return c;
    }
    return op.Done(absl::AlreadyExistsError(
        absl::StrCat("sequence '", id,
                     "' exists on this node (as another sequence or another fork); delete it or fork under "
                     "another id")));
  }
  const TenantId tenant = static_cast<TenantId>(t.id());
  absl::StatusOr<ForkChange> c = ForkLocked(hs[0], hs[1], tenant, tokens);
  absl::Status s = c.status();
  if (s.ok()) s = hs[1].SetPlacement(placement);
  if (!s.ok()) {
    (void)ForgetLocked(hs[1], tenant);  // nothing of the fork stays
    return op.Done(s);
  }
  op.Record(absl::OkStatus());
  return c;
}

absl::StatusOr<ForkChange> NodeCore::ForkLocked(SequenceTable::Handle& src, SequenceTable::Handle& dst, TenantId tenant,
                                                uint64_t tokens) {
  SequenceState& s = src.state();
  SequenceState& d = dst.state();
  s.last_use = d.last_use = Now();
  ForkChange c;
  KVRING_RETURN_IF_ERROR(LearnLayout(src.ns(), s));
  c.source_tokens = HeldTokens(s);
  if (!s.layout.has_value()) return c;  // nothing of the source here
  const BlockLayout L = *s.layout;
  const uint64_t keep = tokens / L.block_tokens;
  const uint32_t rem = static_cast<uint32_t>(tokens % L.block_tokens);
  const uint64_t ends = keep + (rem > 0 ? 1 : 0);  // blocks [0, ends) hold the fork's tokens
  const SequenceRef dref{dst.ns(), dst.id(), tenant};
  // The open blocks below the fork point must hold every token up to it.
  for (auto it = s.open.begin(); it != s.open.end() && it->first < ends; ++it) {
    const uint32_t need = it->first < keep ? L.block_tokens : rem;
    for (uint32_t l = 0; l < it->second.filled.size(); ++l) {
      if (it->second.filled[l] < need) {
        return absl::FailedPreconditionError(
            absl::StrCat("sequence '", src.id(), "' holds only ", it->first * L.block_tokens + it->second.filled[l],
                         " tokens of layer ", l, " on this node; a fork at ", tokens, " needs them all"));
      }
    }
  }
  d.layout = L;
  d.encoding = s.encoding;
  for (auto it = s.blocks.begin(); it != s.blocks.end() && it->first < keep; ++it) {
    KVRING_RETURN_IF_ERROR(dst.Record(it->first, it->second, sequences_->References(it->second).owned));
    ++c.blocks_shared;
  }
  // Copied: open blocks below the fork point, and the block holding token
  // `tokens` (from the store when the source sealed it).
  KVRING_ASSIGN_OR_RETURN(std::vector<KeptBlock> kept, KeptBlocks(src, tenant, L, tokens, "a fork at"));
  for (const KeptBlock& k : kept) {
    KVRING_RETURN_IF_ERROR(Reopen(dref, k.index, k.filled, k.bytes, L));
    d.open[k.index] = OpenBlockState{k.filled};
    ++c.blocks_copied;
  }
  c.held = c.blocks_shared + c.blocks_copied > 0;
  return c;
}

NodeReport NodeCore::Stats(const v1::Tenant& t) {
  OpScope op(stats_);
  NodeReport r;
  r.node_id = options_.node_id;
  r.ucx_address = options_.ucx_address;
  r.store = store_->stats();
  r.sequences = sequences_->num_sequences();
  r.open_blocks = sequences_->open_blocks();
  r.tenant = store_->GetTenantUsage(t.id());
  for (const v1::SequenceInfo& s : DescribeSequences(NamespaceIdOf(t.namespace_()), {})) {
    ++r.tenant_sequences;
    r.tenant_sequence_blocks += s.full_blocks();
    r.tenant_sequence_bytes += s.bytes();
    r.tenant_sequence_open_blocks += s.open_blocks();
    r.tenant_sequence_host_blocks += s.host_blocks();
    r.tenant_sequence_cold_blocks += s.cold_blocks();
  }
  if (store_->cold_tier() != nullptr) {
    r.has_cold_tier = true;
    r.cold = store_->cold_tier()->stats();
  }
  r.backend = backend_->stats();
  r.tenant_sequence_hbm_bytes = backend_->TenantBytes(static_cast<TenantId>(t.id()));
  r.device_delivered_bytes = device_bytes_->value();
  op.Record(absl::OkStatus());
  return r;
}

}  // namespace kvring
