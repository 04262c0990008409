#include "kvring/cache/block_key.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "xxhash.h"

namespace kvring {
namespace {

void AppendU32(std::string* out, uint32_t v) {
  char b[4] = {static_cast<char>(v), static_cast<char>(v >> 8), static_cast<char>(v >> 16), static_cast<char>(v >> 24)};
  out->append(b, 4);
}
void AppendU64(std::string* out, uint64_t v) {
  AppendU32(out, static_cast<uint32_t>(v));
  AppendU32(out, static_cast<uint32_t>(v >> 32));
}
void AppendStr(std::string* out, std::string_view s) {
  AppendU32(out, static_cast<uint32_t>(s.size()));
  out->append(s.data(), s.size());
}
BlockKey Hash128(const void* data, size_t len) {
  const XXH128_hash_t h = XXH3_128bits(data, len);
  return BlockKey{h.low64, h.high64};
}
int HexVal(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string BlockKey::ToHex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[15 - i] = kDigits[(hi >> (4 * i)) & 0xf];
    out[31 - i] = kDigits[(lo >> (4 * i)) & 0xf];
  }
  return out;
}

absl::StatusOr<BlockKey> BlockKey::FromHex(std::string_view hex) {
  if (hex.size() != 32)
    return absl::InvalidArgumentError(absl::StrCat("a block key is 32 hex digits, got ", hex.size()));
  BlockKey k;
  for (int i = 0; i < 32; ++i) {
    const int v = HexVal(hex[i]);
    if (v < 0) return absl::InvalidArgumentError("a block key has only hex digits");
    uint64_t& half = i < 16 ? k.hi : k.lo;
    half = (half << 4) | static_cast<uint64_t>(v);
  }
  return k;
}

NamespaceId NamespaceIdOf(std::string_view namespace_name) {
  return XXH3_64bits(namespace_name.data(), namespace_name.size());
}

BlockKey SequenceBlockKey(NamespaceId ns, std::string_view sequence_id, uint64_t index, const BlockLayout& layout) {
  std::string buf("kvring/seq/v1\0", 14);
  AppendU64(&buf, ns);
  AppendStr(&buf, sequence_id);
  AppendU64(&buf, index);
  AppendU32(&buf, layout.block_tokens);
  AppendU32(&buf, layout.layers);
  AppendU32(&buf, layout.kv_heads);
  AppendU32(&buf, layout.head_dim);
  buf.push_back(static_cast<char>(layout.dtype));
  return Hash128(buf.data(), buf.size());
}

BlockKeyHasher::BlockKeyHasher(std::string model_id, std::string namespace_name, BlockLayout layout)
    : model_id_(std::move(model_id)),
      namespace_(std::move(namespace_name)),
      namespace_id_(NamespaceIdOf(namespace_)),
      layout_(layout) {
  AppendStr(&ctx_, model_id_);
  AppendStr(&ctx_, namespace_);
  AppendU32(&ctx_, layout_.block_tokens);
  AppendU32(&ctx_, layout_.layers);
  AppendU32(&ctx_, layout_.kv_heads);
  AppendU32(&ctx_, layout_.head_dim);
  ctx_.push_back(static_cast<char>(layout_.dtype));
  std::string root_bytes("kvring/v1\0", 10);
  root_bytes += ctx_;
  root_ = Hash128(root_bytes.data(), root_bytes.size());
}

BlockKey BlockKeyHasher::Next(const BlockKey& parent, absl::Span<const uint32_t> tokens) const {
  std::string buf;
  buf.reserve(16 + 4 + 4 * tokens.size() + ctx_.size());
  AppendU64(&buf, parent.lo);
  AppendU64(&buf, parent.hi);
  AppendU32(&buf, static_cast<uint32_t>(tokens.size()));
  for (uint32_t t : tokens) AppendU32(&buf, t);
  buf += ctx_;
  return Hash128(buf.data(), buf.size());
}

std::vector<BlockKey> BlockKeyHasher::ChainFrom(const BlockKey& parent, absl::Span<const uint32_t> tokens) const {
  const size_t bt = layout_.block_tokens;
  std::vector<BlockKey> keys;
  keys.reserve(tokens.size() / bt);
  BlockKey cur = parent;
  for (size_t off = 0; off + bt <= tokens.size(); off += bt) {
    cur = Next(cur, tokens.subspan(off, bt));
    keys.push_back(cur);
  }
  return keys;
}

}  // namespace kvring
