// Wire formats of the ring's messages (internal to attention/). Every
// section is 8-byte aligned so decoded views point into the buffer.
//   query chunk:  header, positions i64[rows], seq_ids u32[rows], data
//   partial:      header, out f32[rows*heads*dim], lse f32[rows*heads]
//   kv chunk:     header, seq_begin u32[nseq+1], block meta[nblocks], payloads
// Decoding checks magic, sizes and bounds: a malformed message is an
// INVALID_ARGUMENT / DATA_LOSS, never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvring/attention/tensors.h"

namespace kvring::ring_internal {

size_t QueryChunkBytes(const QueryTensor& q);
void EncodeQueryChunk(const QueryTensor& q, std::vector<uint8_t>* out);
// The view points into `buf`.
absl::StatusOr<QueryTensor> DecodeQueryChunk(absl::Span<const uint8_t> buf);

size_t PartialBytes(uint32_t rows, uint32_t heads, uint32_t dim);
void EncodePartial(const PartialResult& p, std::vector<uint8_t>* out);
absl::StatusOr<ConstPartial> DecodePartial(absl::Span<const uint8_t> buf, uint32_t rows, uint32_t heads, uint32_t dim);

struct DecodedKv {
  std::vector<KvBlockRef> blocks;
  std::vector<uint32_t> seq_begin;
  PagedKv view;
};
size_t KvChunkBytes(const PagedKv& kv);
void EncodeKvChunk(const PagedKv& kv, std::vector<uint8_t>* out);
absl::Status DecodeKvChunk(absl::Span<const uint8_t> buf, DecodedKv* out);

}  // namespace kvring::ring_internal
