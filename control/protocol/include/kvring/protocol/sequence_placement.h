// SequencePlacement: where each chunk of an attention sequence lives.
//
// A sequence is placed by chunks of the shard map's sequence_chunk_blocks
// blocks: chunk c of sequence s on the ring at ShardRing::ChunkPosition(ns,
// s, c). A fork (ForkSequence) shares its source's first chunks where they
// already are, so its placement is a list of segments: chunks [0,
// segments[0].end_chunk) placed as segments[0].placed_as's, the next
// segment's chunks as its placed_as's, and chunks past the last segment by
// the sequence's own id. An empty placement is the sequence's own
// everywhere (every sequence that was not forked), with digest 0.
//
// The client computes a fork's placement from its source's and sends it
// with the fork; every node records it, and each Attend names the digest of
// the placement it was routed by (kvring.proto AttendSequence), so that a
// client that has not resolved a fork is told so instead of being served
// from the wrong nodes.
//
// A value type; thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvring.pb.h"

namespace kvring {

class SequencePlacement {
 public:
  struct Segment {
    uint64_t end_chunk = 0;  // exclusive
    std::string placed_as;
    bool operator==(const Segment&) const = default;
  };
  // The most segments a placement may have (each fork of a fork adds at most
  // one).
  static constexpr size_t kMaxSegments = 64;

  SequencePlacement() = default;

  // Checked: end_chunk strictly increasing, valid sequence ids, at most
  // kMaxSegments.
  static absl::StatusOr<SequencePlacement> FromProto(const v1::SequencePlacement& p);
  void ToProto(v1::SequencePlacement* p) const;

  bool empty() const { return segments_.empty(); }
  const std::vector<Segment>& segments() const { return segments_; }
  // The id whose chunk placement chunk `chunk` of sequence `own` follows.
  const std::string& PlacedAs(const std::string& own, uint64_t chunk) const;
  // The placement of a fork of this sequence (`own`) that shares its chunks
  // [0, shared_chunks): those placed as they are here, the rest by the
  // fork's own id. INVALID_ARGUMENT past kMaxSegments.
  absl::StatusOr<SequencePlacement> Fork(const std::string& own, uint64_t shared_chunks) const;
  // 0 for the empty placement; a 64-bit hash of the segments otherwise
  // (never 0).
  uint64_t Digest() const;
  bool operator==(const SequencePlacement&) const = default;

 private:
  std::vector<Segment> segments_;
};

}  // namespace kvring
