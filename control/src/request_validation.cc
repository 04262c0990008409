#include "kvring/control/request_validation.h"

#include <cmath>

#include "absl/strings/str_cat.h"
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

absl::StatusOr<BlockLayout> LayoutFromProto(const v1::Layout& l) {
  if (l.dtype() > static_cast<uint32_t>(DType::kBF16)) {
    return absl::InvalidArgumentError(absl::StrCat("layout dtype ", l.dtype(), " is not f32 (0), f16 (1) or bf16 (2)"));
  }
  BlockLayout out{l.block_tokens(), l.layers(), l.kv_heads(), l.head_dim(), static_cast<DType>(l.dtype())};
  const char* why = nullptr;
  if (!out.IsValid(&why)) return absl::InvalidArgumentError(absl::StrCat("bad layout: ", why));
  return out;
}

void LayoutToProto(const BlockLayout& l, v1::Layout* out) {
  out->set_block_tokens(l.block_tokens);
  out->set_layers(l.layers);
  out->set_kv_heads(l.kv_heads);
  out->set_head_dim(l.head_dim);
  out->set_dtype(static_cast<uint32_t>(l.dtype));
}

BlockKey KeyFromProto(const v1::Key& k) { return BlockKey{k.lo(), k.hi()}; }
void KeyToProto(const BlockKey& k, v1::Key* out) {
  out->set_lo(k.lo);
  out->set_hi(k.hi);
}

absl::Status ValidateKeys(const google::protobuf::RepeatedPtrField<v1::Key>& keys, const RequestLimits& limits) {
  if (static_cast<uint64_t>(keys.size()) > limits.max_keys) {
    return absl::InvalidArgumentError(absl::StrCat(keys.size(), " keys in one request; the limit is ", limits.max_keys));
  }
  for (int i = 0; i < keys.size(); ++i) {
    if (keys[i].lo() == 0 && keys[i].hi() == 0) return absl::InvalidArgumentError(absl::StrCat("key ", i, " is zero"));
  }
  return absl::OkStatus();
}

absl::Status ValidateSequenceId(const std::string& id, const RequestLimits& limits) {
  if (id.empty()) return absl::InvalidArgumentError("sequence_id is empty");
  if (id.size() > limits.max_sequence_id_bytes) return absl::InvalidArgumentError("sequence_id too long");
  for (unsigned char c : id) {
    if (c < 0x21 || c > 0x7e || c == '/') return absl::InvalidArgumentError("sequence_id must be printable ASCII without '/' or spaces");
  }
  return absl::OkStatus();
}

absl::Status ValidatePutBlock(const v1::PutBlock& b, const RequestLimits& limits, bool payload_external,
                              BlockMeta* meta) {
  const v1::BlockHeader& h = b.block();
  if (!h.has_key() || (h.key().lo() == 0 && h.key().hi() == 0)) return absl::InvalidArgumentError("block key missing or zero");
  KVRING_ASSIGN_OR_RETURN(BlockLayout layout, LayoutFromProto(h.layout()));
  KvEncoding enc;
  if (h.encoding() > 0xff || !KvEncoding::Unpack(static_cast<uint8_t>(h.encoding()), &enc)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown KV encoding ", h.encoding()));
  }
  const uint64_t expected = EncodedBytes(layout, enc);
  if (h.payload_bytes() != expected) {
    return absl::InvalidArgumentError(absl::StrCat("payload_bytes ", h.payload_bytes(), " but the layout and encoding need ",
                                                   expected));
  }
  if (expected > limits.max_payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("block of ", expected, " bytes exceeds this node's limit of ",
                                                   limits.max_payload_bytes));
  }
  if (!payload_external && b.payload().size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat("payload has ", b.payload().size(), " bytes; the header says ", expected));
  }
  if (b.has_sequence()) KVRING_RETURN_IF_ERROR(ValidateSequenceId(b.sequence().sequence_id(), limits));
  meta->layout = layout;
  meta->encoding = enc;
  meta->payload_bytes = static_cast<uint32_t>(expected);
  meta->checksum = h.checksum();
  return absl::OkStatus();
}

absl::Status ValidatePutRequest(const v1::PutRequest& r, const RequestLimits& limits, bool payload_external) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(r.header(), limits));
  if (static_cast<uint64_t>(r.blocks_size()) > limits.max_blocks_per_put) {
    return absl::InvalidArgumentError(absl::StrCat(r.blocks_size(), " blocks in one Put; the limit is ", limits.max_blocks_per_put));
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

absl::Status ValidateAttendRequest(const v1::AttendRequest& r, const RequestLimits& limits) {
  KVRING_RETURN_IF_ERROR(ValidateHeader(r.header(), limits));
  KVRING_RETURN_IF_ERROR(ValidateSequenceId(r.sequence_id(), limits));
  if (r.num_rows() == 0 || r.num_rows() > limits.max_attend_rows) {
    return absl::InvalidArgumentError(absl::StrCat("num_rows must be in [1, ", limits.max_attend_rows, "]"));
  }
  if (r.q_heads() == 0 || r.q_heads() > 1024) return absl::InvalidArgumentError("q_heads must be in [1, 1024]");
  if (r.head_dim() == 0 || r.head_dim() > kMaxHeadDim || r.head_dim() % 8 != 0) {
    return absl::InvalidArgumentError("head_dim must be a multiple of 8 in [8, 512]");
  }
  if (r.q_dtype() > static_cast<uint32_t>(DType::kBF16)) return absl::InvalidArgumentError("q_dtype must be f32, f16 or bf16");
  const uint64_t bytes = uint64_t{r.num_rows()} * r.q_heads() * r.head_dim() * DTypeSize(static_cast<DType>(r.q_dtype()));
  if (r.queries().size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("queries have ", r.queries().size(), " bytes; num_rows x q_heads x head_dim x dtype = ", bytes));
  }
  if (static_cast<uint32_t>(r.positions_size()) != r.num_rows()) {
    return absl::InvalidArgumentError(absl::StrCat(r.positions_size(), " positions for ", r.num_rows(), " query rows"));
  }
  for (int64_t p : r.positions()) {
    if (p < 0) return absl::InvalidArgumentError("query positions must be >= 0");
  }
  if (static_cast<uint64_t>(r.block_indices_size()) > limits.max_attend_blocks) {
    return absl::InvalidArgumentError("too many block indices");
  }
  if (r.window() < 0) return absl::InvalidArgumentError("window must be >= 0");
  if (!std::isfinite(r.softmax_scale()) || r.softmax_scale() < 0) return absl::InvalidArgumentError("softmax_scale must be finite and >= 0");
  return absl::OkStatus();
}

}  // namespace kvring
