// Attention sequences as the client sees them: what the lifecycle calls
// report, and where a sequence's chunks live.
//
// A sequence is placed by chunks (kvring.proto SequencePlacement): by its
// own id, or, for a fork, by its source's for the chunks it shares. The
// client learns a fork's placement when it makes the fork
// (Client::ForkSequence), or from the nodes the first time a node tells it
// that a sequence it routed is a fork it has not resolved (every node
// records each fork's placement).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvring {

// Chunks up to `end_chunk` (from the previous segment's end) are placed as
// `placed_as`'s chunks.
struct PlacementSegment {
  uint64_t end_chunk = 0;
  std::string placed_as;
};

// What DeleteSequence / TruncateSequence changed, over every node.
struct SequenceChangeReport {
  int nodes_holding = 0;  // nodes that held any of the sequence
  uint64_t blocks_erased = 0;
  uint64_t open_blocks_dropped = 0;
};

// What ForkSequence did, over every node.
struct ForkReport {
  int nodes_holding = 0;       // nodes that held some of the source below the fork point
  uint64_t blocks_shared = 0;  // full blocks shared with the source (replicas count), not copied
  uint64_t blocks_copied = 0;  // partly filled blocks copied (replicas count)
  uint64_t shared_chunks = 0;  // chunks of the fork placed with the source's
};

// What StartSequenceFromPrefix did, over every node.
struct PrefixStartReport {
  uint64_t blocks = 0;  // the chain's blocks the sequence starts with: the prefix cache's hit
  uint64_t tokens = 0;  // blocks * block_tokens: where the engine's prefill goes on
  // Replicas (of the sequence's chunks) that recorded a block they already
  // held, by its key: no bytes moved.
  uint64_t blocks_shared = 0;
  // Replicas sent a block's bytes (its prefix-cache copy is on other nodes),
  // and those bytes.
  uint64_t blocks_copied = 0, bytes_copied = 0;
};

// One of the caller's attention sequences, over every node that answered.
struct SequenceListing {
  std::string sequence_id;
  int nodes = 0;             // nodes holding any of it (replicas count)
  uint64_t full_blocks = 0;  // over those nodes (replicas count)
  uint64_t open_blocks = 0;
  uint64_t bytes = 0;          // of the full blocks
  uint64_t shared_blocks = 0;  // of full_blocks, those another sequence on the same node holds too (forks)
  uint64_t host_blocks = 0, cold_blocks = 0;  // of full_blocks: in the host tier, only in the cold tier
  uint64_t tokens = 0;                        // the sequence's length (layer 0), as far as the nodes can tell
  uint32_t block_tokens = 0;                  // of its blocks (0: no node knows yet)
  std::vector<PlacementSegment> placement;    // a fork's (empty: its own id's)
};

}  // namespace kvring
