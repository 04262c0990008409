#include "kvring/control/node_wire.h"

#include "absl/strings/str_cat.h"
#include "kvring/common/status_macros.h"
#include "kvring/control/request_validation.h"
#include "kvring/protocol/wire.h"

namespace kvring {
namespace {

std::vector<BlockKey> KeysOf(const google::protobuf::RepeatedPtrField<v1::Key>& keys) {
  std::vector<BlockKey> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(KeyFromProto(k));
  return out;
}

void HeaderOf(const PinnedBlock& b, const v1::Key& key, v1::BlockHeader* h) {
  *h->mutable_key() = key;
  KeyToProto(b.parent(), h->mutable_parent());
  LayoutToProto(b.meta().layout, h->mutable_layout());
  h->set_encoding(b.meta().encoding.Pack());
  h->set_payload_bytes(b.meta().payload_bytes);
  h->set_checksum(b.meta().checksum);
}

}  // namespace

absl::Status WireLookup(NodeCore& core, const v1::Tenant& t, const v1::LookupRequest& req, v1::LookupResponse* resp) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(req.header(), core.limits()));
  KVRING_RETURN_IF_ERROR(ValidateKeys(req.keys(), core.limits()));
  KVRING_ASSIGN_OR_RETURN(LookupResult r, core.Lookup(t, req.header().namespace_(), KeysOf(req.keys()), req.each()));
  resp->set_prefix_length(r.prefix_length);
  for (bool h : r.held) resp->add_held(h);
  return absl::OkStatus();
}

absl::Status WirePut(NodeCore& core, const v1::Tenant& t, const v1::PutRequest& req,
                     absl::Span<const absl::Span<const uint8_t>> external, v1::PutResponse* resp) {
  const bool ext = !external.empty();
  if (ext && external.size() != static_cast<size_t>(req.blocks_size())) {
    return absl::InvalidArgumentError(absl::StrCat(external.size(), " payloads for ", req.blocks_size(), " blocks"));
  }
  KVRING_RETURN_IF_ERROR(ValidatePutRequest(req, core.limits(), ext));
  std::vector<PutBlockIn> blocks(req.blocks_size());
  for (int i = 0; i < req.blocks_size(); ++i) {
    const v1::PutBlock& b = req.blocks(i);
    PutBlockIn& in = blocks[i];
    (void)ValidatePutBlock(b, core.limits(), ext, &in.meta);  // validated above
    in.key = KeyFromProto(b.block().key());
    in.parent = KeyFromProto(b.block().parent());
    in.payload = ext ? external[i]
                     : absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(b.payload().data()), b.payload().size());
    in.pin = b.pin();
    in.by_reference = b.by_reference();
    if (b.has_sequence()) {
      in.sequence_id = &b.sequence().sequence_id();
      in.block_index = b.sequence().block_index();
    }
  }
  KVRING_ASSIGN_OR_RETURN(std::vector<PutOutcome> out, core.Put(t, req.header().namespace_(), req.quantize(), blocks));
  for (const PutOutcome& o : out) {
    v1::BlockResult* r = resp->add_results();
    StatusToProto(o.status, r->mutable_status());
    r->set_inserted(o.inserted);
  }
  return absl::OkStatus();
}

absl::Status WireGet(NodeCore& core, const v1::Tenant& t, const v1::GetRequest& req, v1::GetResponse* resp,
                     std::vector<PinnedBlock>* held) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(req.header(), core.limits()));
  KVRING_RETURN_IF_ERROR(ValidateKeys(req.keys(), core.limits()));
  KVRING_RETURN_IF_ERROR(ValidateDevicePlaces(req));
  DeviceTarget device;
  const bool to_device = req.device_places_size() > 0;
  if (to_device) {
    device.host_id = req.host_id();
    for (const auto& a : req.device_allocations()) device.handles.push_back(a.ipc_handle());
    for (const auto& p : req.device_places()) device.places.push_back({p.allocation(), p.offset(), p.capacity()});
  }
  KVRING_ASSIGN_OR_RETURN(GetOut out,
                          core.Get(t, req.header().namespace_(), KeysOf(req.keys()), to_device ? &device : nullptr));
  resp->set_delivered_to_device(out.delivered_to_device);
  resp->set_device_refusal(out.device_refusal);
  for (int i = 0; i < req.keys_size(); ++i) {
    GetBlockOut& o = out.blocks[i];
    v1::GetBlock* b = resp->add_blocks();
    StatusToProto(o.status, b->mutable_status());
    if (!o.status.ok()) continue;
    HeaderOf(o.block, req.keys(i), b->mutable_block());
    if (out.delivered_to_device) continue;  // the bytes are in the caller's memory
    if (held != nullptr) {
      held->push_back(std::move(o.block));
    } else {
      b->set_payload(reinterpret_cast<const char*>(o.block.payload().data()), o.block.payload().size());
    }
  }
  return absl::OkStatus();
}

bool WireGetStaysInMemory(NodeCore& core, const v1::Tenant& t, const v1::GetRequest& req) {
  if (!ValidateHeader(req.header(), core.limits()).ok() || !ValidateKeys(req.keys(), core.limits()).ok()) return true;
  return core.GetStaysInMemory(t, req.header().namespace_(), KeysOf(req.keys()));
}

absl::Status WireListSequences(NodeCore& core, const v1::Tenant& t, const v1::ListSequencesRequest& req,
                               v1::ListSequencesResponse* resp) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(req.header(), core.limits()));
  const std::vector<std::string> ids(req.sequence_ids().begin(), req.sequence_ids().end());
  KVRING_ASSIGN_OR_RETURN(std::vector<v1::SequenceInfo> list, core.ListSequences(t, req.header().namespace_(), ids));
  for (v1::SequenceInfo& s : list) *resp->add_sequences() = std::move(s);
  return absl::OkStatus();
}

absl::Status WireSequence(NodeCore& core, const v1::Tenant& t, const v1::SequenceRequest& req, bool truncate,
                          v1::SequenceResponse* resp) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(req.header(), core.limits()));
  absl::StatusOr<SequenceChange> c =
      truncate ? core.TruncateSequence(t, req.header().namespace_(), req.sequence_id(), req.tokens())
               : core.DeleteSequence(t, req.header().namespace_(), req.sequence_id());
  if (!c.ok()) return c.status();
  resp->set_held(c->held);
  resp->set_blocks_erased(c->blocks_erased);
  resp->set_open_blocks_dropped(c->open_blocks_dropped);
  return absl::OkStatus();
}

absl::Status WireForkSequence(NodeCore& core, const v1::Tenant& t, const v1::ForkSequenceRequest& req,
                              v1::ForkSequenceResponse* resp) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(req.header(), core.limits()));
  KVRING_ASSIGN_OR_RETURN(SequencePlacement placement, SequencePlacement::FromProto(req.placement()));
  KVRING_ASSIGN_OR_RETURN(ForkChange c, core.ForkSequence(t, req.header().namespace_(), req.source_id(),
                                                          req.sequence_id(), req.tokens(), placement));
  resp->set_held(c.held);
  resp->set_blocks_shared(c.blocks_shared);
  resp->set_blocks_copied(c.blocks_copied);
  resp->set_source_tokens(c.source_tokens);
  return absl::OkStatus();
}

absl::Status WireReadSequence(NodeCore& core, const v1::Tenant& t, const v1::ReadSequenceRequest& req,
                              v1::ReadSequenceResponse* resp) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(req.header(), core.limits()));
  KVRING_ASSIGN_OR_RETURN(
      std::vector<SequenceBlockOut> blocks,
      core.ReadSequence(t, req.header().namespace_(), req.sequence_id(), req.begin_block(), req.end_block()));
  for (const SequenceBlockOut& b : blocks) {
    v1::SequenceBlock* o = resp->add_blocks();
    o->set_index(b.index);
    KeyToProto(b.key, o->mutable_block()->mutable_key());
    LayoutToProto(b.meta.layout, o->mutable_block()->mutable_layout());
    o->mutable_block()->set_encoding(b.meta.encoding.Pack());
    o->mutable_block()->set_payload_bytes(static_cast<uint32_t>(b.bytes.size()));
    o->mutable_block()->set_checksum(PayloadChecksum(b.bytes.data(), b.bytes.size()));
    for (uint32_t f : b.filled) o->add_filled(f);
    o->set_payload(reinterpret_cast<const char*>(b.bytes.data()), b.bytes.size());
  }
  return absl::OkStatus();
}

absl::Status WirePin(NodeCore& core, const v1::Tenant& t, const v1::PinRequest& req, v1::PinResponse* resp) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(req.header(), core.limits()));
  KVRING_RETURN_IF_ERROR(ValidateKeys(req.keys(), core.limits()));
  KVRING_ASSIGN_OR_RETURN(std::vector<absl::Status> out,
                          core.Pin(t, req.header().namespace_(), KeysOf(req.keys()), req.unpin()));
  for (const absl::Status& s : out) StatusToProto(s, resp->add_results()->mutable_status());
  return absl::OkStatus();
}

absl::Status WireStats(NodeCore& core, const v1::Tenant& t, const v1::StatsRequest& req, v1::StatsResponse* resp) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(req.header(), core.limits()));
  const NodeReport r = core.Stats(t);
  resp->set_node_id(r.node_id);
  resp->set_blocks(r.store.blocks);
  resp->set_host_blocks(r.store.host_blocks);
  resp->set_cold_blocks(r.store.cold_only_blocks);
  resp->set_pinned_blocks(r.store.pinned_blocks);
  resp->set_free_pages(r.store.free_pages);
  resp->set_num_pages(r.store.num_pages);
  resp->set_page_bytes(r.store.page_bytes);
  resp->set_puts(r.store.puts);
  resp->set_hits(r.store.hits);
  resp->set_misses(r.store.misses);
  resp->set_evictions(r.store.evictions);
  resp->set_demotions(r.store.demotions);
  resp->set_promotions(r.store.promotions);
  resp->set_sequences(r.sequences);
  resp->set_tenant_pinned_bytes(r.tenant.pinned_bytes);
  resp->set_tenant_owned_bytes(r.tenant.owned_bytes);
  resp->set_tenant_sequences(r.tenant_sequences);
  resp->set_tenant_sequence_blocks(r.tenant_sequence_blocks);
  resp->set_tenant_sequence_bytes(r.tenant_sequence_bytes);
  resp->set_tenant_sequence_open_blocks(r.tenant_sequence_open_blocks);
  resp->set_tenant_open_bytes(r.tenant.open_bytes);
  resp->set_tenant_sequence_host_blocks(r.tenant_sequence_host_blocks);
  resp->set_tenant_sequence_cold_blocks(r.tenant_sequence_cold_blocks);
  resp->set_tenant_sequence_hbm_bytes(r.tenant_sequence_hbm_bytes);
  if (r.has_cold_tier) {
    resp->set_cold_stored_bytes(r.cold.stored_bytes);
    resp->set_cold_raw_bytes(r.cold.raw_bytes);
  }
  resp->set_ucx_address(r.ucx_address);
  resp->set_backend(r.backend.name);
  resp->set_hbm_pages(r.backend.pages);
  resp->set_hbm_free_pages(r.backend.free_pages);
  resp->set_hbm_page_bytes(r.backend.page_bytes);
  resp->set_hbm_blocks(r.backend.resident_blocks);
  resp->set_hbm_hits(r.backend.hits);
  resp->set_hbm_misses(r.backend.misses);
  resp->set_hbm_demotions(r.backend.demotions);
  resp->set_hbm_shared_pages(r.backend.shared_pages);
  resp->set_open_blocks(r.open_blocks);
  resp->set_device_delivered_bytes(r.device_delivered_bytes);
  return absl::OkStatus();
}

absl::Status WireAttend(NodeCore& core, const v1::Tenant& t, const v1::AttendRequest& req, const AttendBatch& batch,
                        v1::AttendResponse* resp, PartialOutput out) {
  AttendStats st;
  absl::Status s;
  if (req.has_device()) {
    const v1::DeviceExchange& d = req.device();
    s = core.AttendOnDevice(t, req.header().namespace_(), batch,
                            DeviceExchangeIn{d.host_id(), d.ipc_handle(), d.queries_offset(), d.new_k_offset(),
                                             d.new_v_offset(), d.out_offset(), d.lse_offset(), d.inputs_ready_event(),
                                             d.reply_when_queued(), d.done_flag_offset(), d.done_flag_value()},
                            &st);
  } else {
    s = core.Attend(t, req.header().namespace_(), batch, out, &st);
  }
  if (!s.ok()) return s;
  if (!st.device_refusal.empty()) {
    resp->set_device_refusal(st.device_refusal);
    resp->set_backend(st.backend);
    return absl::OkStatus();
  }
  resp->set_num_rows(batch.shape.num_rows);
  resp->set_q_heads(batch.shape.q_heads);
  resp->set_head_dim(batch.shape.head_dim);
  resp->set_blocks_used(st.blocks_used);
  resp->set_compute_seconds(st.compute_seconds);
  resp->set_kernel_seconds(st.kernel_seconds);
  resp->set_copy_seconds(st.copy_seconds);
  resp->set_appended_tokens(st.appended_tokens);
  resp->set_completed_blocks(st.completed_blocks);
  resp->set_backend(st.backend);
  if (!st.done_event.empty()) resp->set_done_event(st.done_event);
  if (st.done_flag) resp->set_done_flag(true);
  bool all_ok = true;
  for (const absl::Status& q : st.sequence_status) all_ok &= q.ok();
  if (!all_ok) {
    for (const absl::Status& q : st.sequence_status) StatusToProto(q, resp->add_sequence_status());
  }
  return absl::OkStatus();
}

}  // namespace kvring
