// KvShard: the KV one rank holds for a batch of sequences, for attention.
//
// Each sequence has a list of full blocks (referenced: typically pages of the
// block store; or owned: blocks this shard completed by decoding) and, on the
// rank that owns the sequence's tail, a tail block being filled one token at
// a time. Appends go layer by layer (an engine computes layer l's KV of the
// new token just before layer l's attention): Append(seq, layer, ...) writes
// token t of the tail for that layer; when every layer of the tail is full,
// the tail becomes an owned full block and a new tail starts.
//
// Not thread-safe: one rank's thread uses it. View() pointers stay valid
// until the next Append or AddBlock.
#pragma once

#include <deque>
#include <vector>

#include "absl/status/status.h"
#include "kvring/attention/tensors.h"

namespace kvring {

class KvShard {
 public:
  KvShard(BlockLayout layout, KvEncoding encoding, uint32_t num_sequences);

  const BlockLayout& layout() const { return layout_; }
  uint32_t num_sequences() const { return static_cast<uint32_t>(seqs_.size()); }

  // References a full (or, for the last block, partial) block held elsewhere.
  absl::Status AddBlock(uint32_t seq, const KvBlockRef& block);
  // Makes this shard the owner of `seq`'s tail, whose first token sits at
  // absolute position `tail_start`.
  absl::Status OwnTail(uint32_t seq, int64_t tail_start);
  bool owns_tail(uint32_t seq) const { return seq < seqs_.size() && seqs_[seq].owns_tail; }
  int64_t next_position(uint32_t seq, uint32_t layer) const;

  // Appends the K and V of one token ([kv_heads, head_dim] each, in the
  // layout's dtype) at `position` for `layer`. FAILED_PRECONDITION when this
  // shard does not own the tail or the position is not the next one.
  absl::Status Append(uint32_t seq, uint32_t layer, int64_t position, const void* k, const void* v);

  // The KV of every sequence as PagedKv (rebuilt on each call). Layer-`layer`
  // token counts are used for the tail.
  PagedKv View(uint32_t layer);

  // Total tokens held for `seq` (for `layer`).
  int64_t tokens(uint32_t seq, uint32_t layer) const;

 private:
  struct Seq {
    std::vector<KvBlockRef> blocks;  // referenced and completed blocks
    bool owns_tail = false;
    int64_t tail_start = 0;
    std::vector<uint8_t> tail;          // one block, layout order
    std::vector<uint32_t> tail_tokens;  // per layer
  };
  BlockLayout layout_;
  KvEncoding encoding_;
  std::vector<Seq> seqs_;
  std::deque<std::vector<uint8_t>> completed_;  // owned full blocks (stable addresses)
  std::vector<KvBlockRef> view_blocks_;
  std::vector<uint32_t> view_begin_;
};

}  // namespace kvring
