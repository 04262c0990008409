#include "kvring/control/node_core.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvring/attention/partial_attention.h"
#include "kvring/cache/quantize.h"
#include "kvring/common/logging.h"
#include "kvring/common/status_macros.h"

namespace kvring {

// Counts a request and its latency; an error status counts as an error.
class OpScope {
 public:
  explicit OpScope(const NodeCore::OpMetrics& m) : m_(m), start_(std::chrono::steady_clock::now()) { m_.requests->Add(); }
  absl::Status Done(absl::Status s) {
    m_.latency->Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
    if (!s.ok()) m_.errors->Add();
    return s;
  }

 private:
  const NodeCore::OpMetrics& m_;
  std::chrono::steady_clock::time_point start_;
};

namespace {
void SetStatus(const absl::Status& s, v1::Status* out) {
  out->set_code(static_cast<int32_t>(s.code()));
  out->set_message(std::string(s.message()));
}
}  // namespace

NodeCore::NodeCore(NodeCoreOptions options, BlockStore* store, SequenceTable* sequences, TenantDirectory* tenants,
                   ThreadPool* pool, MetricsRegistry* metrics)
    : options_(std::move(options)), store_(store), sequences_(sequences), tenants_(tenants), pool_(pool), metrics_(metrics) {
  lookup_ = Op("lookup");
  put_ = Op("put");
  get_ = Op("get");
  pin_ = Op("pin");
  attend_ = Op("attend");
  stats_ = Op("stats");
  put_bytes_ = metrics_->Counter("kvring_put_bytes_total", "Payload bytes accepted by Put");
  quantized_ = metrics_->Counter("kvring_quantized_blocks_total", "Plain blocks quantized by this node at Put");
  get_bytes_ = metrics_->Counter("kvring_get_bytes_total", "Payload bytes served by Get");
}

NodeCore::OpMetrics NodeCore::Op(const std::string& name) {
  const std::string l = absl::StrCat("op=\"", name, "\"");
  return OpMetrics{metrics_->Counter("kvring_requests_total", "Requests handled, by operation", l),
                   metrics_->Counter("kvring_request_errors_total", "Requests that returned an error", l),
                   metrics_->Histogram("kvring_request_seconds", "Request latency in seconds", l)};
}

absl::StatusOr<NamespaceId> NodeCore::Namespace(const v1::Tenant& t, const v1::RequestHeader& h) const {
  KVRING_RETURN_IF_ERROR(ValidateHeader(h, options_.limits));
  KVRING_ASSIGN_OR_RETURN(std::string ns, ResolveNamespace(t, h.namespace_()));
  return NamespaceIdOf(ns);
}

void NodeCore::ApplyQuotas() {
  for (const v1::Tenant& t : tenants_->tenants()) {
    TenantQuota q;
    if (t.max_pinned_bytes() > 0) q.max_pinned_bytes = t.max_pinned_bytes();
    store_->SetTenantQuota(t.id(), q);
  }
}

absl::Status NodeCore::Lookup(const v1::Tenant& t, const v1::LookupRequest& req, v1::LookupResponse* resp) {
  OpScope op(lookup_);
  auto ns = Namespace(t, req.header());
  if (!ns.ok()) return op.Done(ns.status());
  if (absl::Status s = ValidateKeys(req.keys(), options_.limits); !s.ok()) return op.Done(s);
  std::vector<BlockKey> keys;
  keys.reserve(req.keys_size());
  for (const auto& k : req.keys()) keys.push_back(KeyFromProto(k));
  resp->set_prefix_length(static_cast<uint32_t>(store_->LookupPrefix(*ns, keys)));
  if (req.each()) {
    for (bool h : store_->Contains(*ns, keys)) resp->add_held(h);
  }
  return op.Done(absl::OkStatus());
}

absl::Status NodeCore::Put(const v1::Tenant& t, const v1::PutRequest& req,
                           absl::Span<const absl::Span<const uint8_t>> external, v1::PutResponse* resp) {
  OpScope op(put_);
  auto ns = Namespace(t, req.header());
  if (!ns.ok()) return op.Done(ns.status());
  const bool ext = !external.empty();
  if (ext && external.size() != static_cast<size_t>(req.blocks_size())) {
    return op.Done(absl::InvalidArgumentError(absl::StrCat(external.size(), " payloads for ", req.blocks_size(), " blocks")));
  }
  if (absl::Status s = ValidatePutRequest(req, options_.limits, ext); !s.ok()) return op.Done(s);
  // What plain blocks become here: the request's choice, else the tenant's.
  KvEncoding target;
  const std::string& quantize = req.quantize().empty() ? t.kv_encoding() : req.quantize();
  if (absl::Status s = ParseKvEncoding(quantize, &target); !s.ok()) {
    return op.Done(absl::InvalidArgumentError(absl::StrCat("quantize: ", s.message())));
  }
  std::vector<uint8_t> quantized;
  for (int i = 0; i < req.blocks_size(); ++i) {
    const v1::PutBlock& b = req.blocks(i);
    BlockMeta meta;
    (void)ValidatePutBlock(b, options_.limits, ext, &meta);  // validated above
    absl::Span<const uint8_t> payload =
        ext ? external[i]
            : absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(b.payload().data()), b.payload().size());
    v1::BlockResult* r = resp->add_results();
    if (payload.size() != meta.payload_bytes) {
      SetStatus(absl::InvalidArgumentError(absl::StrCat("payload has ", payload.size(), " bytes; the header says ",
                                                        meta.payload_bytes)), r->mutable_status());
      continue;
    }
    if (target.quantized() && !meta.encoding.quantized()) {
      // The sender's checksum covers the plain bytes: check it before they
      // are replaced by codes (the store then checksums the codes).
      if (meta.checksum != 0 && PayloadChecksum(payload.data(), payload.size()) != meta.checksum) {
        SetStatus(absl::DataLossError("payload checksum mismatch (before quantization)"), r->mutable_status());
        continue;
      }
      if (absl::Status s = QuantizeBlock(meta.layout, payload, target, &quantized); !s.ok()) {
        SetStatus(s, r->mutable_status());
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
    a.key = KeyFromProto(b.block().key());
    a.parent = KeyFromProto(b.block().parent());
    a.meta = meta;
    a.pin = b.pin();
    absl::StatusOr<PutResult> pr = store_->Put(a, payload);
    if (pr.ok() && b.has_sequence()) {
      absl::Status s = sequences_->Record(*ns, b.sequence().sequence_id(), b.sequence().block_index(), a.key);
      if (!s.ok()) pr = s;
    }
    SetStatus(pr.status(), r->mutable_status());
    if (pr.ok()) {
      r->set_inserted(pr->inserted);
      put_bytes_->Add(payload.size());
    }
  }
  return op.Done(absl::OkStatus());
}

absl::Status NodeCore::Get(const v1::Tenant& t, const v1::GetRequest& req, v1::GetResponse* resp,
                           std::vector<PinnedBlock>* held) {
  OpScope op(get_);
  auto ns = Namespace(t, req.header());
  if (!ns.ok()) return op.Done(ns.status());
  if (absl::Status s = ValidateKeys(req.keys(), options_.limits); !s.ok()) return op.Done(s);
  uint64_t total = 0;
  for (const auto& k : req.keys()) {
    v1::GetBlock* out = resp->add_blocks();
    absl::StatusOr<PinnedBlock> b = store_->Acquire(*ns, KeyFromProto(k));
    SetStatus(b.status(), out->mutable_status());
    if (!b.ok()) continue;
    total += b->meta().payload_bytes;
    if (total > options_.limits.max_request_bytes) {
      SetStatus(absl::ResourceExhaustedError("response would exceed the request size limit; get fewer blocks at once"),
                out->mutable_status());
      continue;
    }
    v1::BlockHeader* h = out->mutable_block();
    *h->mutable_key() = k;
    KeyToProto(b->parent(), h->mutable_parent());
    LayoutToProto(b->meta().layout, h->mutable_layout());
    h->set_encoding(b->meta().encoding.Pack());
    h->set_payload_bytes(b->meta().payload_bytes);
    h->set_checksum(b->meta().checksum);
    get_bytes_->Add(b->meta().payload_bytes);
    if (held != nullptr) {
      held->push_back(std::move(*b));
    } else {
      out->set_payload(reinterpret_cast<const char*>(b->payload().data()), b->payload().size());
    }
  }
  return op.Done(absl::OkStatus());
}

bool NodeCore::GetStaysInMemory(const v1::Tenant& t, const v1::GetRequest& req) {
  auto ns = Namespace(t, req.header());
  if (!ns.ok() || !ValidateKeys(req.keys(), options_.limits).ok()) return true;
  std::vector<BlockKey> keys;
  keys.reserve(req.keys_size());
  for (const auto& k : req.keys()) keys.push_back(KeyFromProto(k));
  return store_->InMemoryOrAbsent(*ns, keys);
}

absl::Status NodeCore::Pin(const v1::Tenant& t, const v1::PinRequest& req, v1::PinResponse* resp) {
  OpScope op(pin_);
  auto ns = Namespace(t, req.header());
  if (!ns.ok()) return op.Done(ns.status());
  if (absl::Status s = ValidateKeys(req.keys(), options_.limits); !s.ok()) return op.Done(s);
  for (const auto& k : req.keys()) {
    absl::Status s = req.unpin() ? store_->Unpin(t.id(), *ns, KeyFromProto(k)) : store_->Pin(t.id(), *ns, KeyFromProto(k));
    SetStatus(s, resp->add_results()->mutable_status());
  }
  return op.Done(absl::OkStatus());
}

absl::Status NodeCore::Attend(const v1::Tenant& t, const v1::AttendRequest& req, v1::AttendResponse* resp) {
  OpScope op(attend_);
  auto ns = Namespace(t, req.header());
  if (!ns.ok()) return op.Done(ns.status());
  if (absl::Status s = ValidateAttendRequest(req, options_.limits); !s.ok()) return op.Done(s);
  std::vector<uint64_t> indices(req.block_indices().begin(), req.block_indices().end());
  absl::StatusOr<std::vector<BlockKey>> keys = sequences_->Resolve(*ns, req.sequence_id(), indices);
  if (!keys.ok()) return op.Done(keys.status());
  std::vector<PinnedBlock> held;
  std::vector<KvBlockRef> refs;
  held.reserve(keys->size());
  BlockLayout layout;
  KvEncoding enc;
  for (size_t i = 0; i < keys->size(); ++i) {
    absl::StatusOr<PinnedBlock> b = store_->Acquire(*ns, (*keys)[i]);
    if (!b.ok()) {
      return op.Done(absl::Status(b.status().code(), absl::StrCat("sequence '", req.sequence_id(), "' block ", indices[i],
                                                                  ": ", b.status().message())));
    }
    if (i == 0) {
      layout = b->meta().layout;
      enc = b->meta().encoding;
    } else if (!(b->meta().layout == layout) || !(b->meta().encoding == enc)) {
      return op.Done(absl::FailedPreconditionError("the blocks of one sequence have different layouts or encodings"));
    }
    refs.push_back(KvBlockRef{b->payload().data(), static_cast<int64_t>(indices[i] * b->meta().layout.block_tokens),
                              b->meta().layout.block_tokens});
    held.push_back(std::move(*b));
  }
  if (held.empty()) {
    layout.head_dim = req.head_dim();
    layout.kv_heads = 1;
  }
  if (layout.head_dim != req.head_dim()) {
    return op.Done(absl::InvalidArgumentError(absl::StrCat("query head_dim ", req.head_dim(), " but the sequence's blocks have ",
                                                           layout.head_dim)));
  }
  std::vector<uint32_t> begin{0, static_cast<uint32_t>(refs.size())};
  PagedKv kv{layout, enc, refs, begin};
  std::vector<int64_t> positions(req.positions().begin(), req.positions().end());
  QueryTensor q{req.queries().data(), static_cast<DType>(req.q_dtype()), req.num_rows(), req.q_heads(), req.head_dim(),
                positions.data(), nullptr};
  AttentionOptions o;
  o.layer = req.layer();
  o.causal = req.causal();
  o.window = req.window();
  o.softmax_scale = req.softmax_scale();
  PartialResult out(req.num_rows(), req.q_heads(), req.head_dim());
  const auto t0 = std::chrono::steady_clock::now();
  if (held.empty()) {
    std::fill(out.lse.begin(), out.lse.end(), -std::numeric_limits<float>::infinity());
  } else if (absl::Status s = PartialAttention(o, q, kv, out.view(), pool_); !s.ok()) {
    return op.Done(s);
  }
  resp->set_compute_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  resp->set_num_rows(req.num_rows());
  resp->set_q_heads(req.q_heads());
  resp->set_head_dim(req.head_dim());
  resp->set_out(reinterpret_cast<const char*>(out.out.data()), out.out.size() * 4);
  resp->set_lse(reinterpret_cast<const char*>(out.lse.data()), out.lse.size() * 4);
  resp->set_blocks_used(static_cast<uint32_t>(held.size()));
  return op.Done(absl::OkStatus());
}

absl::Status NodeCore::Stats(const v1::Tenant& t, const v1::StatsRequest& req, v1::StatsResponse* resp) {
  OpScope op(stats_);
  if (absl::Status s = ValidateHeader(req.header(), options_.limits); !s.ok()) return op.Done(s);
  const BlockStoreStats s = store_->stats();
  resp->set_node_id(options_.node_id);
  resp->set_blocks(s.blocks);
  resp->set_host_blocks(s.host_blocks);
  resp->set_cold_blocks(s.cold_only_blocks);
  resp->set_pinned_blocks(s.pinned_blocks);
  resp->set_free_pages(s.free_pages);
  resp->set_num_pages(s.num_pages);
  resp->set_page_bytes(s.page_bytes);
  resp->set_puts(s.puts);
  resp->set_hits(s.hits);
  resp->set_misses(s.misses);
  resp->set_evictions(s.evictions);
  resp->set_demotions(s.demotions);
  resp->set_promotions(s.promotions);
  resp->set_sequences(sequences_->num_sequences());
  const TenantUsage u = store_->GetTenantUsage(t.id());
  resp->set_tenant_pinned_bytes(u.pinned_bytes);
  resp->set_tenant_owned_bytes(u.owned_bytes);
  if (store_->cold_tier() != nullptr) {
    const ColdTierStats c = store_->cold_tier()->stats();
    resp->set_cold_stored_bytes(c.stored_bytes);
    resp->set_cold_raw_bytes(c.raw_bytes);
  }
  resp->set_ucx_address(options_.ucx_address);
  return op.Done(absl::OkStatus());
}

}  // namespace kvring
