#include "kvring/attention/ring/kv_shard.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvring {

KvShard::KvShard(BlockLayout layout, KvEncoding encoding, uint32_t num_sequences)
    : layout_(layout), encoding_(encoding), seqs_(num_sequences) {}

absl::Status KvShard::AddBlock(uint32_t seq, const KvBlockRef& block) {
  if (seq >= seqs_.size()) return absl::InvalidArgumentError(absl::StrCat("sequence ", seq, " out of range"));
  if (block.data == nullptr || block.num_tokens == 0 || block.num_tokens > layout_.block_tokens) {
    return absl::InvalidArgumentError("bad block reference");
  }
  seqs_[seq].blocks.push_back(block);
  return absl::OkStatus();
}

absl::Status KvShard::OwnTail(uint32_t seq, int64_t tail_start) {
  if (seq >= seqs_.size()) return absl::InvalidArgumentError(absl::StrCat("sequence ", seq, " out of range"));
  if (encoding_.quantized()) return absl::UnimplementedError("tails of quantized shards are not supported");
  Seq& s = seqs_[seq];
  s.owns_tail = true;
  s.tail_start = tail_start;
  s.tail.assign(layout_.bytes(), 0);
  s.tail_tokens.assign(layout_.layers, 0);
  return absl::OkStatus();
}

int64_t KvShard::next_position(uint32_t seq, uint32_t layer) const {
  const Seq& s = seqs_[seq];
  return s.tail_start + (s.owns_tail ? s.tail_tokens[layer] : 0);
}

absl::Status KvShard::Append(uint32_t seq, uint32_t layer, int64_t position, const void* k, const void* v) {
  if (seq >= seqs_.size()) return absl::InvalidArgumentError(absl::StrCat("sequence ", seq, " out of range"));
  if (layer >= layout_.layers) return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  Seq& s = seqs_[seq];
  if (!s.owns_tail)
    return absl::FailedPreconditionError(absl::StrCat("this shard does not own the tail of sequence ", seq));
  uint32_t& n = s.tail_tokens[layer];
  if (n >= layout_.block_tokens) {
    return absl::FailedPreconditionError(
        "tail block full for this layer: append every layer of a token before the next token");
  }
  if (position != s.tail_start + n) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", seq, " layer ", layer, ": expected position ", s.tail_start + n, ", got ", position));
  }
  const size_t esize = DTypeSize(layout_.dtype);
  const size_t row = size_t{layout_.head_dim} * esize;
  for (uint32_t h = 0; h < layout_.kv_heads; ++h) {
    std::memcpy(s.tail.data() + layout_.index(layer, 0, h, n, 0) * esize, static_cast<const uint8_t*>(k) + h * row,
                row);
    std::memcpy(s.tail.data() + layout_.index(layer, 1, h, n, 0) * esize, static_cast<const uint8_t*>(v) + h * row,
                row);
  }
  ++n;
  for (uint32_t t : s.tail_tokens) {
    if (t < layout_.block_tokens) return absl::OkStatus();
  }
  // Every layer full: the tail becomes a block of this shard.
  completed_.push_back(std::move(s.tail));
  s.blocks.push_back(KvBlockRef{completed_.back().data(), s.tail_start, layout_.block_tokens});
  s.tail_start += layout_.block_tokens;
  s.tail.assign(layout_.bytes(), 0);
  s.tail_tokens.assign(layout_.layers, 0);
  return absl::OkStatus();
}

PagedKv KvShard::View(uint32_t layer) {
  view_blocks_.clear();
  view_begin_.assign(1, 0);
  for (const Seq& s : seqs_) {
    view_blocks_.insert(view_blocks_.end(), s.blocks.begin(), s.blocks.end());
    if (s.owns_tail && layer < s.tail_tokens.size() && s.tail_tokens[layer] > 0) {
      view_blocks_.push_back(KvBlockRef{s.tail.data(), s.tail_start, s.tail_tokens[layer]});
    }
    view_begin_.push_back(static_cast<uint32_t>(view_blocks_.size()));
  }
  PagedKv kv;
  kv.layout = layout_;
  kv.encoding = encoding_;
  kv.blocks = view_blocks_;
  kv.seq_begin = view_begin_;
  return kv;
}

int64_t KvShard::tokens(uint32_t seq, uint32_t layer) const {
  const Seq& s = seqs_[seq];
  int64_t n = 0;
  for (const KvBlockRef& b : s.blocks) n += b.num_tokens;
  if (s.owns_tail && layer < s.tail_tokens.size()) n += s.tail_tokens[layer];
  return n;
}

}  // namespace kvring
