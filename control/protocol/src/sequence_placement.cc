#include "kvring/protocol/sequence_placement.h"

#include <xxhash.h>

#include "absl/strings/str_cat.h"
#include "kvring/common/status_macros.h"
#include "kvring/protocol/wire.h"

namespace kvring {

absl::StatusOr<SequencePlacement> SequencePlacement::FromProto(const v1::SequencePlacement& p) {
  if (static_cast<size_t>(p.segments_size()) > kMaxSegments) {
    return absl::InvalidArgumentError(
        absl::StrCat("a sequence placement has ", p.segments_size(), " segments; at most ", kMaxSegments));
  }
  SequencePlacement out;
  uint64_t prev = 0;
  for (const v1::PlacementSegment& s : p.segments()) {
    if (s.end_chunk() <= prev) {
      return absl::InvalidArgumentError("a sequence placement's segments must end at increasing chunks, past 0");
    }
    KVRING_RETURN_IF_ERROR(ValidateSequenceId(s.placed_as()));
    prev = s.end_chunk();
    out.segments_.push_back(Segment{s.end_chunk(), s.placed_as()});
  }
  return out;
}

void SequencePlacement::ToProto(v1::SequencePlacement* p) const {
  p->clear_segments();
  for (const Segment& s : segments_) {
    v1::PlacementSegment* o = p->add_segments();
    o->set_end_chunk(s.end_chunk);
    o->set_placed_as(s.placed_as);
  }
}

const std::string& SequencePlacement::PlacedAs(const std::string& own, uint64_t chunk) const {
  for (const Segment& s : segments_) {
    if (chunk < s.end_chunk) return s.placed_as;
  }
  return own;
}

absl::StatusOr<SequencePlacement> SequencePlacement::Fork(const std::string& own, uint64_t shared_chunks) const {
  SequencePlacement out;
  uint64_t begin = 0;
  auto add = [&](uint64_t end, const std::string& as) {
    if (end <= begin) return;
    if (!out.segments_.empty() && out.segments_.back().placed_as == as) {
      out.segments_.back().end_chunk = end;
    } else {
      out.segments_.push_back(Segment{end, as});
    }
    begin = end;
  };
  for (const Segment& s : segments_) {
    if (begin >= shared_chunks) break;
    add(std::min(s.end_chunk, shared_chunks), s.placed_as);
  }
  add(shared_chunks, own);
  if (out.segments_.size() > kMaxSegments) {
    return absl::InvalidArgumentError(absl::StrCat("a fork of '", own, "' would have ", out.segments_.size(),
                                                   " placement segments (forks of forks); at most ", kMaxSegments));
  }
  return out;
}

uint64_t SequencePlacement::Digest() const {
  if (segments_.empty()) return 0;
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  for (const Segment& s : segments_) {
    XXH3_64bits_update(st, &s.end_chunk, sizeof(s.end_chunk));
    const uint64_t n = s.placed_as.size();
    XXH3_64bits_update(st, &n, sizeof(n));
    XXH3_64bits_update(st, s.placed_as.data(), s.placed_as.size());
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h == 0 ? 1 : h;
}

}  // namespace kvring
