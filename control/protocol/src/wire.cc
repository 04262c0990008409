#include "kvring/protocol/wire.h"

#include "absl/strings/str_cat.h"
#include "kvring/common/quote.h"

namespace kvring {

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

absl::Status StatusFromProto(const v1::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.code()), s.message());
}
void StatusToProto(const absl::Status& s, v1::Status* out) {
  out->set_code(static_cast<int32_t>(s.code()));
  out->set_message(std::string(s.message()));
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::Status ValidateSequenceId(const std::string& id, uint32_t max_bytes) {
  if (id.empty()) return absl::InvalidArgumentError("sequence_id is empty");
  if (id.size() > max_bytes) return absl::InvalidArgumentError("sequence_id too long");
  for (unsigned char c : id) {
    if (c < 0x21 || c > 0x7e || c == '/') {
      return absl::InvalidArgumentError("sequence_id must be printable ASCII without '/' or spaces");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ResolveNamespace(const v1::Tenant& tenant, const std::string& requested) {
  if (requested.empty() || requested == tenant.namespace_()) return tenant.namespace_();
  for (const auto& s : tenant.shared_namespaces()) {
    if (s == requested) return s;
  }
  return absl::PermissionDeniedError(
      absl::StrCat("tenant '", tenant.name(), "' may not use namespace ", Quote(requested)));
}

std::string TenantNamespace(uint32_t tenant_id) { return absl::StrCat("tenant/", tenant_id); }

}  // namespace kvring
