#include "kvring/kvring_c.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvring/attention/merge.h"
#include "kvring/cache/quantize.h"
#include "kvring/client/client.h"
#include "kvring/common/process.h"

struct kvring_client {
  std::unique_ptr<kvring::Client> c;
};

namespace {

using namespace kvring;

thread_local std::string g_last_error;  // per thread, as errno

int Code(const absl::Status& s) {
  g_last_error = s.ok() ? "" : std::string(s.message());
  return static_cast<int>(s.code());
}

std::string Str(const char* s) { return s == nullptr ? "" : s; }

void Copy(const std::string& s, char* buf, size_t cap) {
  if (cap == 0) return;
  const size_t n = std::min(s.size(), cap - 1);
  std::memcpy(buf, s.data(), n);
  buf[n] = 0;
}

absl::StatusOr<BlockLayout> LayoutOf(const kvring_layout* l) {
  if (l == nullptr) return absl::InvalidArgumentError("layout is NULL");
  if (l->dtype > static_cast<uint32_t>(DType::kBF16))
    return absl::InvalidArgumentError("layout dtype must be 0 f32, 1 f16 or 2 bf16");
  BlockLayout out{l->block_tokens, l->layers, l->kv_heads, l->head_dim, static_cast<DType>(l->dtype)};
  const char* why = nullptr;
  if (!out.IsValid(&why)) return absl::InvalidArgumentError(absl::StrCat("layout: ", why));
  return out;
}

std::vector<BlockKey> Keys(const uint64_t* k, uint64_t n) {
  std::vector<BlockKey> out(n);
  for (uint64_t i = 0; i < n; ++i) out[i] = BlockKey{k[2 * i], k[2 * i + 1]};
  return out;
}

}  // namespace

extern "C" {

int kvring_api_version(void) { return KVRING_C_API_VERSION; }
const char* kvring_last_error(void) { return g_last_error.c_str(); }

int kvring_connect(const kvring_options* o, kvring_client** out) {
  if (o == nullptr || out == nullptr) return Code(absl::InvalidArgumentError("options and out are required"));
  // (the engine's process: a step's locks without Debian abseil's deadlock graph; kvring/common/process.h)
  DisableMutexDeadlockDetection();
  ClientOptions co;
  co.coordinator = Str(o->coordinator);
  co.token = Str(o->token);
  co.ns = Str(o->ns);
  co.use_ucx = o->use_ucx != 0;
  absl::StatusOr<std::optional<KvEncoding>> quantize = ParseQuantizeOption(Str(o->quantize));
  if (!quantize.ok()) return Code(quantize.status());
  co.quantize = *quantize;
  // 0: the default; anything else must be a positive, finite number of seconds.
  if (!(o->rpc_timeout_s >= 0) || !std::isfinite(o->rpc_timeout_s)) {
    return Code(absl::InvalidArgumentError("rpc_timeout_s must be a positive, finite number of seconds (0: 10 s)"));
  }
  if (o->rpc_timeout_s > 0) co.rpc_timeout = absl::Seconds(o->rpc_timeout_s);
  co.tls = TlsConfig{Str(o->tls_cert), Str(o->tls_key), Str(o->tls_ca), false};
  co.threads = o->threads;
  co.ucx_loop.spin_us = o->ucx_spin_us;
  co.ucx_loop.wakeup = o->ucx_busy_poll == 0;
  co.ucx_loop.spin_max_us = o->ucx_spin_max_us;
  co.device_delivery = o->no_device_delivery == 0;
  if (o->node_reply_when_queued != 0) co.node_reply_when_queued = o->node_reply_when_queued > 0;
  co.detach_device_steps = o->detach_device_steps > 0;
  if (o->device_exchange_min_bytes >= 0)
    co.device_exchange_min_bytes = static_cast<uint64_t>(o->device_exchange_min_bytes);
  auto c = Client::Connect(co);
  if (!c.ok()) return Code(c.status());
  *out = new kvring_client{std::move(*c)};
  return Code(absl::OkStatus());
}

void kvring_close(kvring_client* c) { delete c; }

int kvring_tenant(kvring_client* c, char* buf, size_t cap) {
  Copy(c->c->tenant_name(), buf, cap);
  return 0;
}
int kvring_namespace(kvring_client* c, char* buf, size_t cap) {
  Copy(c->c->namespace_name(), buf, cap);
  return 0;
}
uint64_t kvring_map_version(kvring_client* c) { return c->c->map_version(); }

int kvring_chain(kvring_client* c, const char* model, const kvring_layout* layout, const uint32_t* tokens,
                 uint64_t n_tokens, const uint64_t* parent, uint64_t* keys_out) {
  auto l = LayoutOf(layout);
  if (!l.ok()) return Code(l.status());
  if (n_tokens > 0 && (tokens == nullptr || keys_out == nullptr))
    return Code(absl::InvalidArgumentError("tokens and keys_out are required"));
  BlockKeyHasher h = c->c->Hasher(Str(model), *l);
  const BlockKey p = parent == nullptr ? h.Root() : BlockKey{parent[0], parent[1]};
  const std::vector<BlockKey> keys = h.ChainFrom(p, absl::MakeConstSpan(tokens, n_tokens));
  for (size_t i = 0; i < keys.size(); ++i) {
    keys_out[2 * i] = keys[i].lo;
    keys_out[2 * i + 1] = keys[i].hi;
  }
  return Code(absl::OkStatus());
}

int kvring_lookup(kvring_client* c, const uint64_t* keys, uint64_t n, uint64_t* held) {
  auto r = c->c->LookupPrefix(Keys(keys, n));
  if (!r.ok()) return Code(r.status());
  *held = *r;
  return Code(absl::OkStatus());
}

int kvring_put(kvring_client* c, const uint64_t* keys, uint64_t n, const void* blocks, int on_device,
               const kvring_layout* layout, const uint64_t* parent, int pin, const char* sequence_id,
               uint64_t first_block, kvring_put_report* report) {
  auto l = LayoutOf(layout);
  if (!l.ok()) return Code(l.status());
  if (n > 0 && (keys == nullptr || blocks == nullptr))
    return Code(absl::InvalidArgumentError("keys and blocks are required"));
  const std::vector<BlockKey> k = Keys(keys, n);
  const BlockKey p = parent == nullptr ? BlockKey{} : BlockKey{parent[0], parent[1]};
  std::vector<BlockData> list;
  list.reserve(n);
  const auto* base = static_cast<const uint8_t*>(blocks);
  for (uint64_t i = 0; i < n; ++i) {
    BlockData b;
    b.key = k[i];
    b.parent = i ? k[i - 1] : p;
    b.layout = *l;
    b.payload = absl::MakeConstSpan(base + i * l->bytes(), l->bytes());
    b.pin = pin != 0;
    b.payload_on_device = on_device != 0;
    list.push_back(b);
  }
  absl::StatusOr<PutReport> r =
      sequence_id == nullptr ? c->c->Put(list) : c->c->PutSequence(sequence_id, first_block, list);
  if (!r.ok()) return Code(r.status());
  if (report != nullptr) *report = kvring_put_report{r->blocks, r->inserted, r->replicas_written, r->bytes};
  return Code(absl::OkStatus());
}

int kvring_get_into(kvring_client* c, const uint64_t* keys, uint64_t n, const kvring_layout* layout, void* out,
                    int on_device, uint8_t* found) {
  auto l = LayoutOf(layout);
  if (!l.ok()) return Code(l.status());
  if (n > 0 && (keys == nullptr || out == nullptr || found == nullptr)) {
    return Code(absl::InvalidArgumentError("keys, out and found are required"));
  }
  const std::vector<BlockKey> k = Keys(keys, n);
  auto* base = static_cast<uint8_t*>(out);
  std::vector<absl::Span<uint8_t>> dsts;
  for (uint64_t i = 0; i < n; ++i) dsts.push_back(absl::MakeSpan(base + i * l->bytes(), l->bytes()));
  std::vector<GetResult> res = c->c->GetInto(k, dsts, on_device != 0);
  std::vector<uint8_t> plain;
  for (uint64_t i = 0; i < n; ++i) {
    found[i] = res[i].status.ok();
    if (!res[i].status.ok()) {
      if (absl::IsNotFound(res[i].status)) continue;
      return Code(absl::Status(res[i].status.code(), absl::StrCat("block ", i, ": ", res[i].status.message())));
    }
    if (!(res[i].meta.layout == *l)) {
      return Code(absl::FailedPreconditionError(absl::StrCat("block ", i, " was stored with another layout")));
    }
    if (res[i].meta.encoding.quantized()) {
      if (on_device) {
        return Code(absl::UnimplementedError(
            absl::StrCat("block ", i, " is stored quantized; read quantized blocks into host memory")));
      }
      std::vector<uint8_t> codes(dsts[i].data(), dsts[i].data() + res[i].meta.payload_bytes);
      if (absl::Status s = DequantizeBlock(*l, res[i].meta.encoding, codes, &plain); !s.ok()) return Code(s);
      std::memcpy(dsts[i].data(), plain.data(), plain.size());
    }
  }
  return Code(absl::OkStatus());
}

int kvring_pin(kvring_client* c, const uint64_t* keys, uint64_t n, int unpin) {
  return Code(c->c->Pin(Keys(keys, n), unpin != 0));
}

namespace {
int SequenceCall(kvring_client* c, const char* id, size_t id_len, bool truncate, uint64_t tokens,
                 kvring_sequence_report* report) {
  if (c == nullptr || id == nullptr) return Code(absl::InvalidArgumentError("client and sequence_id are required"));
  const std::string sid(id, id_len);  // with its length: an embedded NUL is the server's to refuse, not a cut
  auto r = truncate ? c->c->TruncateSequence(sid, tokens) : c->c->DeleteSequence(sid);
  if (!r.ok()) return Code(r.status());
  if (report != nullptr) *report = kvring_sequence_report{r->nodes_holding, r->blocks_erased, r->open_blocks_dropped};
  return Code(absl::OkStatus());
}
}  // namespace

int kvring_delete_sequence(kvring_client* c, const char* sequence_id, size_t id_len, kvring_sequence_report* report) {
  return SequenceCall(c, sequence_id, id_len, false, 0, report);
}
int kvring_truncate_sequence(kvring_client* c, const char* sequence_id, size_t id_len, uint64_t tokens,
                             kvring_sequence_report* report) {
  return SequenceCall(c, sequence_id, id_len, true, tokens, report);
}

int kvring_fork_sequence(kvring_client* c, const char* source_id, size_t source_len, const char* sequence_id,
                         size_t id_len, uint64_t tokens, kvring_fork_report* report) {
  if (c == nullptr || source_id == nullptr || sequence_id == nullptr) {
    return Code(absl::InvalidArgumentError("client, source_id and sequence_id are required"));
  }
  auto r = c->c->ForkSequence(std::string(source_id, source_len), std::string(sequence_id, id_len), tokens);
  if (!r.ok()) return Code(r.status());
  if (report != nullptr) {
    *report = kvring_fork_report{r->nodes_holding, r->blocks_shared, r->blocks_copied, r->shared_chunks};
  }
  return Code(absl::OkStatus());
}

int kvring_start_sequence_from_prefix(kvring_client* c, const char* sequence_id, size_t id_len,
                                      const kvring_layout* layout, const uint64_t* keys, uint64_t n,
                                      kvring_prefix_start_report* report) {
  if (c == nullptr || sequence_id == nullptr || (n > 0 && keys == nullptr)) {
    return Code(absl::InvalidArgumentError("client, sequence_id and keys are required"));
  }
  auto l = LayoutOf(layout);
  if (!l.ok()) return Code(l.status());
  auto r = c->c->StartSequenceFromPrefix(std::string(sequence_id, id_len), *l, Keys(keys, n));
  if (!r.ok()) return Code(r.status());
  if (report != nullptr) {
    *report = kvring_prefix_start_report{r->blocks, r->tokens, r->blocks_shared, r->blocks_copied, r->bytes_copied};
  }
  return Code(absl::OkStatus());
}

int kvring_list_sequences(kvring_client* c, kvring_sequence_info* out, uint32_t cap, uint32_t* n) {
  if (c == nullptr || n == nullptr || (cap > 0 && out == nullptr)) {
    return Code(absl::InvalidArgumentError("client, n (and out when cap > 0) are required"));
  }
  auto r = c->c->ListSequences();
  if (!r.ok()) return Code(r.status());
  *n = static_cast<uint32_t>(r->size());
  for (size_t i = 0; i < r->size() && i < cap; ++i) {
    const SequenceListing& l = (*r)[i];
    kvring_sequence_info& o = out[i];
    std::memset(&o, 0, sizeof(o));
    std::memcpy(o.sequence_id, l.sequence_id.data(), std::min(l.sequence_id.size(), sizeof(o.sequence_id) - 1));
    o.nodes = l.nodes;
    o.full_blocks = l.full_blocks;
    o.open_blocks = l.open_blocks;
    o.bytes = l.bytes;
    o.shared_blocks = l.shared_blocks;
    o.tokens = l.tokens;
    o.block_tokens = l.block_tokens;
    o.forked = l.placement.empty() ? 0 : 1;
    o.host_blocks = l.host_blocks;
    o.cold_blocks = l.cold_blocks;
  }
  return Code(absl::OkStatus());
}

int kvring_step(kvring_client* c, const kvring_step_args* a, float* out, float* lse, kvring_attend_report* report) {
  if (a == nullptr || (a->num_rows > 0 && (out == nullptr || lse == nullptr))) {
    return Code(absl::InvalidArgumentError("args, out and lse are required"));
  }
  auto l = LayoutOf(&a->layout);
  if (!l.ok()) return Code(l.status());
  if (a->q_dtype > static_cast<uint32_t>(DType::kBF16))
    return Code(absl::InvalidArgumentError("q_dtype must be 0, 1 or 2"));
  if (a->num_seqs > 0 && a->seqs == nullptr) return Code(absl::InvalidArgumentError("seqs is NULL"));
  AttendStep st;
  st.layout = *l;
  for (uint32_t i = 0; i < a->num_seqs; ++i) {
    st.sequences.push_back(AttendSequence{Str(a->seqs[i].sequence_id), a->seqs[i].context_tokens, a->seqs[i].rows,
                                          a->seqs[i].append_tokens});
  }
  st.q = QueryTensor{a->q, static_cast<DType>(a->q_dtype), a->num_rows, a->q_heads, a->head_dim, a->positions, nullptr};
  st.new_k = a->new_k;
  st.new_v = a->new_v;
  st.options.layer = a->layer;
  st.options.causal = a->causal != 0;
  st.options.window = a->window;
  st.options.softmax_scale = a->softmax_scale;
  st.device_buffers = a->device_buffers != 0;
  st.stream_ordered = a->stream_ordered != 0;
  st.stream = a->stream;
  if (a->out_cast != nullptr) {
    if (a->out_cast_dtype != static_cast<uint32_t>(DType::kF16) &&
        a->out_cast_dtype != static_cast<uint32_t>(DType::kBF16)) {
      return Code(absl::InvalidArgumentError("out_cast_dtype must be 1 (f16) or 2 (bf16)"));
    }
    st.out_cast = a->out_cast;
    st.out_cast_dtype = static_cast<DType>(a->out_cast_dtype);
  }
  AttendReport rep;
  absl::Status s = c->c->StepInto(st, PartialOutput{out, lse}, &rep);
  if (!s.ok()) return Code(s);
  if (report != nullptr) {
    *report = kvring_attend_report{rep.shards,
                                   rep.retries,
                                   rep.blocks,
                                   rep.bytes_sent,
                                   rep.bytes_received,
                                   rep.appended_tokens,
                                   rep.seconds,
                                   rep.node_seconds,
                                   rep.kernel_seconds,
                                   rep.copy_seconds,
                                   rep.merge_seconds,
                                   rep.shards_in_place,
                                   rep.inputs_waited_on_device ? 1 : 0,
                                   rep.plan_seconds,
                                   rep.stage_seconds,
                                   rep.round_trip_seconds,
                                   rep.transport_seconds,
                                   static_cast<int32_t>(rep.shards_replied_queued),
                                   static_cast<int32_t>(rep.shards_detached)};
  }
  return Code(absl::OkStatus());
}

int kvring_stats(kvring_client* c, kvring_node_stats* out, uint32_t cap, uint32_t* n) {
  const std::vector<NodeStats> st = c->c->Stats();
  *n = static_cast<uint32_t>(st.size());
  for (size_t i = 0; i < st.size() && i < cap; ++i) {
    const NodeStats& s = st[i];
    kvring_node_stats& o = out[i];
    std::memset(&o, 0, sizeof(o));
    Copy(s.node_id, o.node_id, sizeof(o.node_id));
    Copy(s.address, o.address, sizeof(o.address));
    Copy(s.state, o.state, sizeof(o.state));
    Copy(s.backend, o.backend, sizeof(o.backend));
    o.ok = s.status.ok();
    Copy(std::string(s.status.message()), o.error, sizeof(o.error));
    o.blocks = s.blocks;
    o.host_blocks = s.host_blocks;
    o.cold_blocks = s.cold_blocks;
    o.pinned_blocks = s.pinned_blocks;
    o.free_pages = s.free_pages;
    o.num_pages = s.num_pages;
    o.puts = s.puts;
    o.hits = s.hits;
    o.misses = s.misses;
    o.evictions = s.evictions;
    o.demotions = s.demotions;
    o.promotions = s.promotions;
    o.sequences = s.sequences;
    o.cold_stored_bytes = s.cold_stored_bytes;
    o.cold_raw_bytes = s.cold_raw_bytes;
    o.hbm_pages = s.hbm_pages;
    o.hbm_free_pages = s.hbm_free_pages;
    o.hbm_page_bytes = s.hbm_page_bytes;
    o.hbm_blocks = s.hbm_blocks;
    o.hbm_hits = s.hbm_hits;
    o.hbm_misses = s.hbm_misses;
    o.hbm_demotions = s.hbm_demotions;
    o.open_blocks = s.open_blocks;
    o.device_delivered_bytes = s.device_delivered_bytes;
    o.tenant_sequences = s.tenant_sequences;
    o.tenant_sequence_blocks = s.tenant_sequence_blocks;
    o.tenant_sequence_bytes = s.tenant_sequence_bytes;
    o.tenant_sequence_open_blocks = s.tenant_sequence_open_blocks;
    o.tenant_open_bytes = s.tenant_open_bytes;
    o.hbm_shared_pages = s.hbm_shared_pages;
    o.tenant_sequence_host_blocks = s.tenant_sequence_host_blocks;
    o.tenant_sequence_cold_blocks = s.tenant_sequence_cold_blocks;
    o.tenant_sequence_hbm_bytes = s.tenant_sequence_hbm_bytes;
  }
  return Code(absl::OkStatus());
}

int kvring_merge(const float* const* outs, const float* const* lses, uint32_t parts, uint32_t rows, uint32_t heads,
                 uint32_t dim, float* out, float* lse) {
  if (parts == 0 || outs == nullptr || lses == nullptr)
    return Code(absl::InvalidArgumentError("merge needs at least one partial"));
  std::vector<ConstPartial> in;
  for (uint32_t i = 0; i < parts; ++i) in.push_back(ConstPartial{outs[i], lses[i]});
  return Code(MergePartials(in, rows, heads, dim, PartialOutput{out, lse}));
}

int kvring_create_tenant(const char* coordinator, const char* admin_token, const char* name,
                         const char* const* shared_namespaces, uint32_t n_shared, uint64_t max_pinned_bytes,
                         const char* kv_encoding, const char* tls_ca, uint64_t sequence_ttl_s, char* token_out,
                         size_t cap) {
  TenantSpec spec;
  spec.sequence_ttl_s = sequence_ttl_s;
  spec.name = Str(name);
  for (uint32_t i = 0; i < n_shared; ++i) spec.shared_namespaces.push_back(Str(shared_namespaces[i]));
  spec.max_pinned_bytes = max_pinned_bytes;
  spec.kv_encoding = Str(kv_encoding);
  auto t = CreateTenant(Str(coordinator), Str(admin_token), spec, TlsConfig{"", "", Str(tls_ca), false});
  if (!t.ok()) return Code(t.status());
  if (t->token.size() + 1 > cap) return Code(absl::InvalidArgumentError("token buffer too small"));
  Copy(t->token, token_out, cap);
  return Code(absl::OkStatus());
}

}  // extern "C"
