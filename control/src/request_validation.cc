#include "kvring/control/request_validation.h"

#include <cstring>

#include <cmath>

#include "absl/container/flat_hash_set.h"

#include "absl/strings/str_cat.h"
#include "kvring/cache/quantize.h"
#include "kvring/common/status_macros.h"
#include "kvring/layout/kv_encoding.h"

namespace kvring {

absl::Status ValidateHeader(const v1::RequestHeader& h, const RequestLimits& limits) {
  if (h.version() != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("protocol version ", h.version(), " not supported; this daemon speaks version 1"));
  }
  if (h.namespace_().size() > limits.max_namespace_bytes) return absl::InvalidArgumentError("namespace name too long");
  return absl::OkStatus();
}

absl::Status ValidateKeys(const google::protobuf::RepeatedPtrField<v1::Key>& keys, const RequestLimits& limits) {
  if (static_cast<uint64_t>(keys.size()) > limits.max_keys) {
    return absl::InvalidArgumentError(
        absl::StrCat(keys.size(), " keys in one request; the limit is ", limits.max_keys));
  }
  for (int i = 0; i < keys.size(); ++i) {
    if (keys[i].lo() == 0 && keys[i].hi() == 0) return absl::InvalidArgumentError(absl::StrCat("key ", i, " is zero"));
  }
  return absl::OkStatus();
}

absl::Status ValidateKeys(absl::Span<const BlockKey> keys, const RequestLimits& limits) {
  if (keys.size() > limits.max_keys) {
    return absl::InvalidArgumentError(
        absl::StrCat(keys.size(), " keys in one request; the limit is ", limits.max_keys));
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].is_zero()) return absl::InvalidArgumentError(absl::StrCat("key ", i, " is zero"));
  }
  return absl::OkStatus();
}

absl::Status ValidateDevicePlaces(const v1::GetRequest& r) {
  if (r.device_places_size() == 0 && r.device_allocations_size() == 0) return absl::OkStatus();
  if (r.device_places_size() != r.keys_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(r.device_places_size(), " device places for ", r.keys_size(), " keys; give one per key"));
  }
  if (r.device_allocations_size() == 0 || r.device_allocations_size() > kMaxGetDeviceAllocations) {
    return absl::InvalidArgumentError(absl::StrCat(
        r.device_allocations_size(), " device allocations; give between 1 and ", kMaxGetDeviceAllocations));
  }
  for (int i = 0; i < r.device_allocations_size(); ++i) {
    if (r.device_allocations(i).ipc_handle().size() != kIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("device allocation ", i, " has a handle of ",
                                                     r.device_allocations(i).ipc_handle().size(), " bytes, not ",
                                                     kIpcHandleBytes));
    }
  }
  for (int i = 0; i < r.device_places_size(); ++i) {
    if (r.device_places(i).allocation() >= static_cast<uint32_t>(r.device_allocations_size())) {
      return absl::InvalidArgumentError(absl::StrCat("device place ", i, " names allocation ",
                                                     r.device_places(i).allocation(), " of ",
                                                     r.device_allocations_size()));
    }
  }
  if (r.host_id().size() > 64) return absl::InvalidArgumentError("host_id is longer than 64 bytes");
  return absl::OkStatus();
}

absl::Status ValidatePutBlock(const v1::PutBlock& b, const RequestLimits& limits, bool payload_external,
                              BlockMeta* meta) {
  const v1::BlockHeader& h = b.block();
  if (!h.has_key() || (h.key().lo() == 0 && h.key().hi() == 0))
    return absl::InvalidArgumentError("block key missing or zero");
  KVRING_ASSIGN_OR_RETURN(BlockLayout layout, LayoutFromProto(h.layout()));
  if (b.by_reference()) {
    if (!b.has_sequence()) return absl::InvalidArgumentError("a block by reference belongs to a sequence");
    if (h.encoding() != 0 || h.payload_bytes() != 0 || h.checksum() != 0 || !b.payload().empty()) {
      return absl::InvalidArgumentError(
          "a block by reference carries no bytes: encoding, payload_bytes and checksum 0, no payload");
    }
    if (b.pin()) return absl::InvalidArgumentError("a block by reference cannot be pinned by the Put");
    KVRING_RETURN_IF_ERROR(ValidateSequenceId(b.sequence().sequence_id(), limits.max_sequence_id_bytes));
    meta->layout = layout;
    meta->encoding = KvEncoding();
    meta->payload_bytes = 0;
    meta->checksum = 0;
    return absl::OkStatus();
  }
  KvEncoding enc;
  if (h.encoding() > 0xff || !KvEncoding::Unpack(static_cast<uint8_t>(h.encoding()), &enc)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown KV encoding ", h.encoding()));
  }
  const uint64_t expected = EncodedBytes(layout, enc);
  if (h.payload_bytes() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload_bytes ", h.payload_bytes(), " but the layout and encoding need ", expected));
  }
  if (expected > limits.max_payload_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("block of ", expected, " bytes exceeds this node's limit of ", limits.max_payload_bytes));
  }
  if (!payload_external && b.payload().size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload has ", b.payload().size(), " bytes; the header says ", expected));
  }
  if (b.has_sequence())
    KVRING_RETURN_IF_ERROR(ValidateSequenceId(b.sequence().sequence_id(), limits.max_sequence_id_bytes));
  meta->layout = layout;
  meta->encoding = enc;
  meta->payload_bytes = static_cast<uint32_t>(expected);
  meta->checksum = h.checksum();
  return absl::OkStatus();
}

absl::Status ValidatePutRequest(const v1::PutRequest& r, const RequestLimits& limits, bool payload_external) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(r.header(), limits));
  if (static_cast<uint64_t>(r.blocks_size()) > limits.max_blocks_per_put) {
    return absl::InvalidArgumentError(
        absl::StrCat(r.blocks_size(), " blocks in one Put; the limit is ", limits.max_blocks_per_put));
  }
  uint64_t total = 0;
  for (int i = 0; i < r.blocks_size(); ++i) {
    BlockMeta m;
    absl::Status s = ValidatePutBlock(r.blocks(i), limits, payload_external, &m);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("block ", i, ": ", s.message()));
    total += m.payload_bytes;
  }
  if (total > limits.max_request_bytes) return absl::InvalidArgumentError("Put request larger than the request limit");
  return absl::OkStatus();
}

AttendPayloadSizes AttendPayloadSizesOf(const v1::AttendRequest& r) {
  AttendPayloadSizes z;
  if (r.q_dtype() <= static_cast<uint32_t>(DType::kBF16)) {
    z.queries = uint64_t{r.num_rows()} * r.q_heads() * r.head_dim() * DTypeSize(static_cast<DType>(r.q_dtype()));
  }
  uint64_t rows = 0;
  for (const auto& s : r.sequences()) rows += s.append_tokens();
  if (r.has_layout() && r.layout().dtype() <= static_cast<uint32_t>(DType::kBF16)) {
    z.new_k = z.new_v =
        rows * r.layout().kv_heads() * r.layout().head_dim() * DTypeSize(static_cast<DType>(r.layout().dtype()));
  }
  return z;
}

namespace {

// The step's shape, layout and encoding (the parts of an Attend before its
// sequences).
absl::Status ParseAttendShape(const v1::AttendRequest& r, const RequestLimits& limits, AttendBatch* b) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(r.header(), limits));
  // (Before the narrowing into DType, which CheckStepShape's own dtype rule
  // would see wrapped: 258 would read as bf16.)
  if (r.q_dtype() > static_cast<uint32_t>(DType::kBF16)) {
    return absl::InvalidArgumentError("queries must be f32, f16 or bf16");
  }
  if (r.num_rows() > limits.max_attend_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_rows ", r.num_rows(), " is over the limit of ", limits.max_attend_rows));
  }
  StepShape& shape = b->shape;
  shape.options.layer = r.layer();
  shape.options.causal = r.causal();
  shape.options.window = r.window();
  shape.options.softmax_scale = r.softmax_scale();
  shape.num_rows = r.num_rows();
  shape.q_heads = r.q_heads();
  shape.head_dim = r.head_dim();
  shape.q_dtype = static_cast<DType>(r.q_dtype());
  if (r.has_layout()) {
    KVRING_ASSIGN_OR_RETURN(BlockLayout l, LayoutFromProto(r.layout()));
    b->layout = l;
  }
  KVRING_RETURN_IF_ERROR(CheckStepShape(shape, b->layout.has_value() ? &*b->layout : nullptr));
  if (!r.quantize().empty()) {
    if (r.quantize().size() > 64) return absl::InvalidArgumentError("quantize is longer than 64 bytes");
    KvEncoding e;
    if (absl::Status s = ParseKvEncoding(r.quantize(), &e); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("quantize: ", s.message()));
    }
    b->quantize = e;
  }
  return absl::OkStatus();
}

// Sequence `i` of an Attend: its id (not in `seen`, then added), block
// ranges (sorted, disjoint, within its tokens), rows and appends. `blocks`
// counts the ranges' blocks over the whole request.
absl::StatusOr<AttendSequenceSpec> ParseAttendSequence(const v1::AttendSequence& s, int i,
                                                       const std::optional<BlockLayout>& layout,
                                                       const RequestLimits& limits,
                                                       absl::flat_hash_set<std::string>* seen, uint64_t* blocks) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", i, " ('", s.sequence_id().substr(0, 64), "'): ", why));
  };
  if (absl::Status st = ValidateSequenceId(s.sequence_id(), limits.max_sequence_id_bytes); !st.ok()) {
    return bad(st.message());
  }
  if (!seen->insert(s.sequence_id()).second) return bad("named twice in one Attend");
  AttendSequenceSpec spec;
  spec.sequence_id = s.sequence_id();
  spec.tokens = s.tokens();
  spec.rows = s.rows();
  spec.append_tokens = s.append_tokens();
  spec.append_position = s.append_position();
  spec.placement_digest = s.placement_digest();
  if (spec.tokens > kMaxSequenceTokens) return bad(absl::StrCat("tokens over the limit of ", kMaxSequenceTokens));
  const uint64_t filled = layout.has_value() ? (spec.tokens + layout->block_tokens - 1) / layout->block_tokens : 0;
  uint64_t prev_end = 0;
  for (int k = 0; k < s.ranges_size(); ++k) {
    const BlockRange rg{s.ranges(k).begin(), s.ranges(k).end()};
    if (rg.begin >= rg.end) return bad(absl::StrCat("block range ", k, " [", rg.begin, ", ", rg.end, ") is empty"));
    if (k > 0 && rg.begin < prev_end) {
      return bad(absl::StrCat("block range ", k,
                              " overlaps or precedes the one before it: ranges must be sorted and disjoint"));
    }
    if (layout.has_value() && rg.end > filled) {
      return bad(absl::StrCat("block range ", k, " ends at ", rg.end, " but ", spec.tokens, " tokens fill only ",
                              filled, " blocks"));
    }
    if (rg.end > kMaxSequenceTokens) return bad("block range beyond the longest sequence");
    *blocks += rg.size();
    if (*blocks > limits.max_attend_blocks) {
      return absl::InvalidArgumentError(absl::StrCat("over ", limits.max_attend_blocks, " blocks in one Attend"));
    }
    prev_end = rg.end;
    spec.ranges.push_back(rg);
  }
  if (spec.rows > 0 && spec.ranges.empty()) return bad("query rows but no blocks to attend over");
  if (spec.rows == 0 && !spec.ranges.empty()) return bad("blocks to attend over but no query rows");
  if (spec.rows == 0 && spec.append_tokens == 0) return bad("neither query rows nor appended tokens");
  if (spec.append_tokens > 0) {
    if (!layout.has_value()) return bad("appending needs the request's layout");
    if (spec.append_position + spec.append_tokens > spec.tokens) {
      return bad(absl::StrCat("appends tokens [", spec.append_position, ", ", spec.append_position + spec.append_tokens,
                              ") beyond the sequence's ", spec.tokens, " tokens"));
    }
  }
  return spec;
}

// The sequences (each named once), their row and append totals, and the
// rows' positions.
absl::Status ParseAttendSequences(const v1::AttendRequest& r, const RequestLimits& limits, AttendBatch* b) {
  if (r.sequences_size() == 0) return absl::InvalidArgumentError("an Attend names at least one sequence");
  if (static_cast<uint64_t>(r.sequences_size()) > limits.max_attend_sequences) {
    return absl::InvalidArgumentError(
        absl::StrCat(r.sequences_size(), " sequences in one Attend; the limit is ", limits.max_attend_sequences));
  }
  uint64_t rows = 0, blocks = 0, append = 0;
  absl::flat_hash_set<std::string> seen;
  b->sequences.reserve(r.sequences_size());
  for (int i = 0; i < r.sequences_size(); ++i) {
    KVRING_ASSIGN_OR_RETURN(AttendSequenceSpec spec,
                            ParseAttendSequence(r.sequences(i), i, b->layout, limits, &seen, &blocks));
    rows += spec.rows;
    append += spec.append_tokens;
    b->sequences.push_back(std::move(spec));
  }
  if (rows != r.num_rows()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the sequences have ", rows, " query rows in all; num_rows says ", r.num_rows()));
  }
  if (append > limits.max_attend_rows) {
    return absl::InvalidArgumentError(absl::StrCat(append, " appended tokens; the limit is ", limits.max_attend_rows));
  }
  if (static_cast<uint64_t>(r.positions_size()) != rows) {
    return absl::InvalidArgumentError(absl::StrCat(r.positions_size(), " positions for ", rows, " query rows"));
  }
  b->positions.assign(r.positions().begin(), r.positions().end());
  for (int64_t p : b->positions) {
    if (p < 0 || p >= static_cast<int64_t>(kMaxSequenceTokens)) {
      return absl::InvalidArgumentError(absl::StrCat("query position ", p, " out of [0, ", kMaxSequenceTokens, ")"));
    }
  }
  return absl::OkStatus();
}

// A device exchange: the bytes stay in the caller's GPU memory (the wire
// layer maps and range-checks the regions: AttendDeviceIo), so nothing may
// travel beside the message; handles and offsets well formed.
absl::Status CheckDeviceExchange(const v1::AttendRequest& r, std::optional<absl::Span<const uint8_t>> external) {
  const v1::DeviceExchange& d = r.device();
  if (!r.queries().empty() || !r.new_k().empty() || !r.new_v().empty() ||
      (external.has_value() && !external->empty())) {
    return absl::InvalidArgumentError("an Attend with a device exchange carries no query or K/V bytes");
  }
  if (d.ipc_handle().size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("device exchange: the IPC handle has ", d.ipc_handle().size(), " bytes, not ", kIpcHandleBytes));
  }
  if (!d.inputs_ready_event().empty() && d.inputs_ready_event().size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("device exchange: the inputs-ready event handle has ",
                                                   d.inputs_ready_event().size(), " bytes, not ", kIpcHandleBytes));
  }
  if (d.done_flag_value() != 0 && d.done_flag_offset() % sizeof(uint32_t) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device exchange: the done flag's offset ", d.done_flag_offset(), " is not a multiple of 4"));
  }
  for (uint64_t off : {d.queries_offset(), d.new_k_offset(), d.new_v_offset(), d.out_offset(), d.lse_offset()}) {
    if (off % kDeviceExchangeAlign != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("device exchange: offset ", off, " is not a multiple of ", kDeviceExchangeAlign));
    }
  }
  return absl::OkStatus();
}

// The queries, new K and new V, cut from `external` (queries || new_k ||
// new_v) or viewed in the message's own fields, each of the declared size.
absl::Status CutAttendPayload(const v1::AttendRequest& r, std::optional<absl::Span<const uint8_t>> external,
                              AttendBatch* b) {
  const AttendPayloadSizes z = AttendPayloadSizesOf(r);
  if (external.has_value()) {
    if (!r.queries().empty() || !r.new_k().empty() || !r.new_v().empty()) {
      return absl::InvalidArgumentError("bulk bytes both in the message and beside it");
    }
    const absl::Span<const uint8_t> p = *external;
    if (p.size() != z.queries + z.new_k + z.new_v) {
      return absl::InvalidArgumentError(absl::StrCat("payload has ", p.size(), " bytes; queries, new_k and new_v need ",
                                                     z.queries + z.new_k + z.new_v));
    }
    b->queries = p.subspan(0, z.queries);
    b->new_k = p.subspan(z.queries, z.new_k);
    b->new_v = p.subspan(z.queries + z.new_k, z.new_v);
    return absl::OkStatus();
  }
  auto span = [](const std::string& s) {
    return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  };
  if (r.queries().size() != z.queries) {
    return absl::InvalidArgumentError(absl::StrCat("queries have ", r.queries().size(),
                                                   " bytes; num_rows x q_heads x head_dim x dtype = ", z.queries));
  }
  if (r.new_k().size() != z.new_k || r.new_v().size() != z.new_v) {
    return absl::InvalidArgumentError(
        absl::StrCat("new_k / new_v have ", r.new_k().size(), " / ", r.new_v().size(),
                     " bytes; appended tokens x kv_heads x head_dim x dtype = ", z.new_k));
  }
  b->queries = span(r.queries());
  b->new_k = span(r.new_k());
  b->new_v = span(r.new_v());
  return absl::OkStatus();
}

// Appended K and V hold no NaN or infinity (RequestLimits::finite_appends);
// the error names the sequence and token.
absl::Status CheckAppendsFinite(const AttendBatch& b) {
  const size_t per_token = size_t{b.layout->kv_heads} * b.layout->head_dim;
  for (auto [name, bytes] : {std::pair<const char*, absl::Span<const uint8_t>>{"K", b.new_k}, {"V", b.new_v}}) {
    const int64_t bad = FirstNonFinite(bytes, b.layout->dtype);
    if (bad < 0) continue;
    // Which sequence and token: appended rows are grouped by sequence.
    uint64_t row = static_cast<uint64_t>(bad) / per_token;
    std::string who;
    for (const AttendSequenceSpec& sp : b.sequences) {
      if (row < sp.append_tokens) {
        who = absl::StrCat("sequence '", sp.sequence_id.substr(0, 64), "' token ", sp.append_position + row);
        break;
      }
      row -= sp.append_tokens;
    }
    return absl::InvalidArgumentError(
        absl::StrCat("appended ", name, " of ", who, " holds NaN or Inf: refused, nothing was appended"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttendBatch> ParseAttendRequest(const v1::AttendRequest& r, const RequestLimits& limits,
                                               std::optional<absl::Span<const uint8_t>> external) {
  AttendBatch b;
  KVRING_RETURN_IF_ERROR(ParseAttendShape(r, limits, &b));
  KVRING_RETURN_IF_ERROR(ParseAttendSequences(r, limits, &b));
  if (r.has_device()) {
    KVRING_RETURN_IF_ERROR(CheckDeviceExchange(r, external));
    return b;
  }
  KVRING_RETURN_IF_ERROR(CutAttendPayload(r, external, &b));
  if (limits.finite_appends && b.layout.has_value() && !b.new_k.empty()) KVRING_RETURN_IF_ERROR(CheckAppendsFinite(b));
  return b;
}

namespace {
// Non-zero when some lane of `x` (16 or 32 bits each) has every exponent bit
// (`mask` in each lane) set: an infinity or a NaN. SWAR: z = (x & mask) ^
// mask is zero exactly in such lanes, and the has-zero-lane test finds one
// (each lane's top bit, the sign, is outside the mask).
inline uint64_t AllOnesLanes(uint64_t x, uint64_t mask, uint64_t ones, uint64_t highs) {
  const uint64_t z = (x & mask) ^ mask;
  return (z - ones) & ~z & highs;
}
}  // namespace

int64_t FirstNonFinite(absl::Span<const uint8_t> bytes, DType dtype) {
  const bool f32 = dtype == DType::kF32;
  const size_t esz = f32 ? 4 : 2;
  const uint64_t lane = dtype == DType::kF32 ? 0x7f800000ull : dtype == DType::kF16 ? 0x7c00ull : 0x7f80ull;
  const uint64_t mask = f32 ? lane * 0x0000000100000001ull : lane * 0x0001000100010001ull;
  const uint64_t ones = f32 ? 0x0000000100000001ull : 0x0001000100010001ull;
  const uint64_t highs = f32 ? 0x8000000080000000ull : 0x8000800080008000ull;
  const size_t n = bytes.size() / esz;
  auto at = [&](size_t i) {
    uint64_t v = 0;
    std::memcpy(&v, bytes.data() + i * esz, esz);
    return (v & lane) == lane;
  };
  // Eight bytes at a time; the element is looked for in the word that trips.
  const size_t words = bytes.size() / 8, per_word = 8 / esz;
  for (size_t w = 0; w < words; ++w) {
    uint64_t x;
    std::memcpy(&x, bytes.data() + 8 * w, 8);
    if (AllOnesLanes(x, mask, ones, highs) == 0) continue;
    for (size_t i = w * per_word; i < (w + 1) * per_word; ++i) {
      if (at(i)) return static_cast<int64_t>(i);
    }
  }
  for (size_t i = words * per_word; i < n; ++i) {
    if (at(i)) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace kvring
