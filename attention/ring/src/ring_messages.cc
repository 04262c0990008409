#include "ring_messages.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvring::ring_internal {
namespace {

constexpr uint32_t kQueryMagic = 0x3151564b;    // "KVQ1"
constexpr uint32_t kPartialMagic = 0x3150564b;  // "KVP1"
constexpr uint32_t kKvMagic = 0x314b564b;       // "KVK1"

constexpr size_t Align8(size_t n) { return (n + 7) & ~size_t{7}; }

struct QHeader {
  uint32_t magic, rows, q_heads, head_dim, dtype, pad;
};
struct PHeader {
  uint32_t magic, rows, heads, dim;
};
struct KvHeader {
  uint32_t magic, block_tokens, layers, kv_heads, head_dim;
  uint8_t dtype, encoding, pad0, pad1;
  uint32_t nseq, nblocks, block_bytes, pad2;
};
struct BlockMetaWire {
  int64_t start_pos;
  uint32_t num_tokens, pad;
};
static_assert(sizeof(QHeader) == 24 && sizeof(PHeader) == 16 && sizeof(KvHeader) == 40 && sizeof(BlockMetaWire) == 16);

size_t QDataBytes(uint32_t rows, uint32_t heads, uint32_t dim, DType dt) {
  return size_t{rows} * heads * dim * DTypeSize(dt);
}

}  // namespace

size_t QueryChunkBytes(const QueryTensor& q) {
  return sizeof(QHeader) + Align8(8 * size_t{q.num_rows}) + Align8(4 * size_t{q.num_rows}) +
         Align8(QDataBytes(q.num_rows, q.q_heads, q.head_dim, q.dtype));
}

void EncodeQueryChunk(const QueryTensor& q, std::vector<uint8_t>* out) {
  out->assign(QueryChunkBytes(q), 0);
  uint8_t* p = out->data();
  QHeader h{kQueryMagic, q.num_rows, q.q_heads, q.head_dim, static_cast<uint32_t>(q.dtype), 0};
  std::memcpy(p, &h, sizeof(h));
  p += sizeof(h);
  for (uint32_t r = 0; r < q.num_rows; ++r) {
    const int64_t pos = q.positions ? q.positions[r] : 0;
    std::memcpy(p + 8 * size_t{r}, &pos, 8);
  }
  p += Align8(8 * size_t{q.num_rows});
  for (uint32_t r = 0; r < q.num_rows; ++r) {
    const uint32_t s = q.seq_ids ? q.seq_ids[r] : 0;
    std::memcpy(p + 4 * size_t{r}, &s, 4);
  }
  p += Align8(4 * size_t{q.num_rows});
  const size_t n = QDataBytes(q.num_rows, q.q_heads, q.head_dim, q.dtype);
  if (n) std::memcpy(p, q.data, n);
}

absl::StatusOr<QueryTensor> DecodeQueryChunk(absl::Span<const uint8_t> buf) {
  if (buf.size() < sizeof(QHeader)) return absl::InvalidArgumentError("query chunk shorter than its header");
  QHeader h;
  std::memcpy(&h, buf.data(), sizeof(h));
  if (h.magic != kQueryMagic) return absl::InvalidArgumentError("not a query chunk (bad magic)");
  if (h.dtype > static_cast<uint32_t>(DType::kBF16)) return absl::InvalidArgumentError("query chunk: bad dtype");
  if (h.rows > (1u << 24) || h.q_heads > 1024 || h.head_dim > 1024)
    return absl::InvalidArgumentError("query chunk: absurd shape");
  QueryTensor q;
  q.num_rows = h.rows;
  q.q_heads = h.q_heads;
  q.head_dim = h.head_dim;
  q.dtype = static_cast<DType>(h.dtype);
  if (buf.size() != QueryChunkBytes(q)) {
    return absl::InvalidArgumentError(
        absl::StrCat("query chunk is ", buf.size(), " bytes; its header says ", QueryChunkBytes(q)));
  }
  const uint8_t* p = buf.data() + sizeof(QHeader);
  q.positions = reinterpret_cast<const int64_t*>(p);
  p += Align8(8 * size_t{q.num_rows});
  q.seq_ids = reinterpret_cast<const uint32_t*>(p);
  p += Align8(4 * size_t{q.num_rows});
  q.data = p;
  return q;
}

size_t PartialBytes(uint32_t rows, uint32_t heads, uint32_t dim) {
  return sizeof(PHeader) + Align8(4 * size_t{rows} * heads * dim) + Align8(4 * size_t{rows} * heads);
}

void EncodePartial(const PartialResult& r, std::vector<uint8_t>* out) {
  out->assign(PartialBytes(r.num_rows, r.q_heads, r.head_dim), 0);
  PHeader h{kPartialMagic, r.num_rows, r.q_heads, r.head_dim};
  std::memcpy(out->data(), &h, sizeof(h));
  uint8_t* p = out->data() + sizeof(h);
  if (!r.out.empty()) std::memcpy(p, r.out.data(), 4 * r.out.size());
  p += Align8(4 * r.out.size());
  if (!r.lse.empty()) std::memcpy(p, r.lse.data(), 4 * r.lse.size());
}

absl::StatusOr<ConstPartial> DecodePartial(absl::Span<const uint8_t> buf, uint32_t rows, uint32_t heads, uint32_t dim) {
  if (buf.size() != PartialBytes(rows, heads, dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("partial is ", buf.size(), " bytes, expected ", PartialBytes(rows, heads, dim)));
  }
  PHeader h;
  std::memcpy(&h, buf.data(), sizeof(h));
  if (h.magic != kPartialMagic || h.rows != rows || h.heads != heads || h.dim != dim) {
    return absl::InvalidArgumentError("partial's header does not match the expected shape");
  }
  const uint8_t* p = buf.data() + sizeof(PHeader);
  ConstPartial c;
  c.out = reinterpret_cast<const float*>(p);
  c.lse = reinterpret_cast<const float*>(p + Align8(4 * size_t{rows} * heads * dim));
  return c;
}

namespace {
size_t BlockStride(const PagedKv& kv) { return Align8(EncodedBytes(kv.layout, kv.encoding)); }
}  // namespace

size_t KvChunkBytes(const PagedKv& kv) {
  const size_t nseq = kv.num_sequences();
  return sizeof(KvHeader) + Align8(4 * (nseq + 1)) + sizeof(BlockMetaWire) * kv.blocks.size() +
         BlockStride(kv) * kv.blocks.size();
}

void EncodeKvChunk(const PagedKv& kv, std::vector<uint8_t>* out) {
  out->assign(KvChunkBytes(kv), 0);
  const uint32_t nseq = kv.num_sequences();
  KvHeader h{};
  h.magic = kKvMagic;
  h.block_tokens = kv.layout.block_tokens;
  h.layers = kv.layout.layers;
  h.kv_heads = kv.layout.kv_heads;
  h.head_dim = kv.layout.head_dim;
  h.dtype = static_cast<uint8_t>(kv.layout.dtype);
  h.encoding = kv.encoding.Pack();
  h.nseq = nseq;
  h.nblocks = static_cast<uint32_t>(kv.blocks.size());
  h.block_bytes = static_cast<uint32_t>(EncodedBytes(kv.layout, kv.encoding));
  uint8_t* p = out->data();
  std::memcpy(p, &h, sizeof(h));
  p += sizeof(h);
  if (nseq) std::memcpy(p, kv.seq_begin.data(), 4 * (size_t{nseq} + 1));
  p += Align8(4 * (size_t{nseq} + 1));
  for (const KvBlockRef& b : kv.blocks) {
    BlockMetaWire m{b.start_pos, b.num_tokens, 0};
    std::memcpy(p, &m, sizeof(m));
    p += sizeof(m);
  }
  const size_t stride = BlockStride(kv);
  for (const KvBlockRef& b : kv.blocks) {
    std::memcpy(p, b.data, h.block_bytes);
    p += stride;
  }
}

absl::Status DecodeKvChunk(absl::Span<const uint8_t> buf, DecodedKv* out) {
  if (buf.size() < sizeof(KvHeader)) return absl::InvalidArgumentError("KV chunk shorter than its header");
  KvHeader h;
  std::memcpy(&h, buf.data(), sizeof(h));
  if (h.magic != kKvMagic) return absl::InvalidArgumentError("not a KV chunk (bad magic)");
  PagedKv& kv = out->view;
  kv.layout = BlockLayout{h.block_tokens, h.layers, h.kv_heads, h.head_dim, static_cast<DType>(h.dtype)};
  const char* why = nullptr;
  if (!kv.layout.IsValid(&why)) return absl::InvalidArgumentError(absl::StrCat("KV chunk layout: ", why));
  if (!KvEncoding::Unpack(h.encoding, &kv.encoding)) return absl::InvalidArgumentError("KV chunk: bad encoding");
  if (h.nseq > (1u << 20) || h.nblocks > (1u << 24)) return absl::InvalidArgumentError("KV chunk: absurd counts");
  if (h.block_bytes != EncodedBytes(kv.layout, kv.encoding))
    return absl::InvalidArgumentError("KV chunk: block size mismatch");
  out->seq_begin.resize(size_t{h.nseq} + 1);
  out->blocks.resize(h.nblocks);
  kv.seq_begin = out->seq_begin;
  kv.blocks = out->blocks;
  if (buf.size() != KvChunkBytes(kv)) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV chunk is ", buf.size(), " bytes; its header says ", KvChunkBytes(kv)));
  }
  const uint8_t* p = buf.data() + sizeof(KvHeader);
  std::memcpy(out->seq_begin.data(), p, 4 * (size_t{h.nseq} + 1));
  p += Align8(4 * (size_t{h.nseq} + 1));
  if (out->seq_begin[0] != 0 || out->seq_begin[h.nseq] != h.nblocks)
    return absl::InvalidArgumentError("KV chunk: bad seq_begin");
  for (uint32_t s = 0; s < h.nseq; ++s) {
    if (out->seq_begin[s] > out->seq_begin[s + 1]) return absl::InvalidArgumentError("KV chunk: seq_begin decreases");
  }
  const uint8_t* payload = p + sizeof(BlockMetaWire) * h.nblocks;
  const size_t stride = BlockStride(kv);
  for (uint32_t i = 0; i < h.nblocks; ++i) {
    BlockMetaWire m;
    std::memcpy(&m, p + sizeof(m) * i, sizeof(m));
    out->blocks[i] = KvBlockRef{payload + stride * i, m.start_pos, m.num_tokens};
  }
  return absl::OkStatus();
}

}  // namespace kvring::ring_internal
