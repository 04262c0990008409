// ClientImpl's sequence lifecycle: delete and truncate on every node,
// listing, placements of forks, fork, and a sequence started from a cached
// prefix.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "client_impl.h"
#include "kvring/common/status_macros.h"
#include "kvring/layout/token_rows.h"

namespace kvring {

std::vector<int> ClientImpl::UpNodes(const ShardRing& ring) {
  std::vector<int> nodes;
  for (int i = 0; i < ring.num_nodes(); ++i) {
    if (ring.node(i).state() == v1::NodeInfo::UP) nodes.push_back(i);
  }
  return nodes;
}

absl::StatusOr<SequenceChangeReport> ClientImpl::ChangeSequence(const std::string& id, bool truncate, uint64_t tokens) {
  KVRING_RETURN_IF_ERROR(ValidateSequenceId(id));
  KVRING_RETURN_IF_ERROR(SettleDetached());
  if (tokens > kMaxSequenceTokens) {
    return absl::InvalidArgumentError(absl::StrCat("truncate to ", tokens, " tokens: over the limit"));
  }
  auto ring = Ring();
  const std::vector<int> nodes = UpNodes(*ring);
  if (nodes.empty()) return absl::UnavailableError("the shard map has no node up");
  v1::SequenceRequest req;
  *req.mutable_header() = Header();
  req.set_sequence_id(id);
  req.set_tokens(tokens);
  std::vector<absl::StatusOr<v1::SequenceResponse>> res =
      FanOut<v1::SequenceResponse>(*ring, nodes, [&](size_t, Node& n) { return n.Grpc().Sequence(req, truncate); });
  SequenceChangeReport rep;
  for (size_t j = 0; j < res.size(); ++j) {
    if (!res[j].ok()) {
      return absl::Status(res[j].status().code(),
                          absl::StrCat(truncate ? "TruncateSequence" : "DeleteSequence", " '", id, "' on ",
                                       ring->node(nodes[j]).node_id(), ": ", res[j].status().message(),
                                       " (idempotent: call it again)"));
    }
    rep.nodes_holding += res[j]->held();
    rep.blocks_erased += res[j]->blocks_erased();
    rep.open_blocks_dropped += res[j]->open_blocks_dropped();
  }
  if (!truncate) {
    placements_.Set(id, SequencePlacement());
    routes_.Forget(id);
  }
  return rep;
}

absl::StatusOr<std::vector<SequenceListing>> ClientImpl::ListSequences(absl::Span<const std::string> ids,
                                                                       bool tolerant) {
  for (const std::string& id : ids) KVRING_RETURN_IF_ERROR(ValidateSequenceId(id));
  auto ring = Ring();
  const std::vector<int> nodes = UpNodes(*ring);
  if (nodes.empty()) return absl::UnavailableError("the shard map has no node up");
  v1::ListSequencesRequest req;
  *req.mutable_header() = Header();
  for (const std::string& id : ids) req.add_sequence_ids(id);
  std::vector<absl::StatusOr<v1::ListSequencesResponse>> res =
      FanOut<v1::ListSequencesResponse>(*ring, nodes, [&](size_t, Node& n) { return n.Grpc().ListSequences(req); });
  std::map<std::string, SequenceListing> by_id;
  absl::Status first_error;
  size_t answered = 0;
  for (size_t j = 0; j < res.size(); ++j) {
    if (!res[j].ok()) {
      absl::Status e(res[j].status().code(), absl::StrCat("ListSequences on ", ring->node(nodes[j]).node_id(), ": ",
                                                          res[j].status().message()));
      if (!tolerant) return e;
      if (first_error.ok()) first_error = e;
      continue;
    }
    ++answered;
    for (const v1::SequenceInfo& s : res[j]->sequences()) {
      SequenceListing& l = by_id[s.sequence_id()];
      l.sequence_id = s.sequence_id();
      ++l.nodes;
      l.full_blocks += s.full_blocks();
      l.open_blocks += s.open_blocks();
      l.bytes += s.bytes();
      l.shared_blocks += s.shared_blocks();
      l.host_blocks += s.host_blocks();
      l.cold_blocks += s.cold_blocks();
      l.tokens = std::max<uint64_t>(l.tokens, s.tokens());
      if (l.block_tokens == 0) l.block_tokens = s.block_tokens();
      if (l.placement.empty()) {
        for (const v1::PlacementSegment& g : s.placement().segments()) {
          l.placement.push_back(PlacementSegment{g.end_chunk(), g.placed_as()});
        }
      }
    }
  }
  if (answered == 0) return first_error;
  std::vector<SequenceListing> out;
  for (auto& [id, l] : by_id) out.push_back(std::move(l));
  return out;
}

absl::Status ClientImpl::ResolvePlacements(absl::Span<const std::string> ids) {
  KVRING_ASSIGN_OR_RETURN(std::vector<SequenceListing> listed, ListSequences(ids, /*tolerant=*/true));
  absl::flat_hash_map<std::string, const SequenceListing*> found;
  for (const SequenceListing& l : listed) found[l.sequence_id] = &l;
  for (const std::string& id : ids) {
    auto it = found.find(id);
    SequencePlacement p;
    if (it != found.end()) {
      KVRING_ASSIGN_OR_RETURN(p, PlacementOf(*it->second));
    }
    placements_.Set(id, p);
  }
  return absl::OkStatus();
}

absl::StatusOr<SequencePlacement> ClientImpl::PlacementOf(const SequenceListing& l) {
  v1::SequencePlacement p;
  for (const PlacementSegment& g : l.placement) {
    v1::PlacementSegment* o = p.add_segments();
    o->set_end_chunk(g.end_chunk);
    o->set_placed_as(g.placed_as);
  }
  absl::StatusOr<SequencePlacement> out = SequencePlacement::FromProto(p);
  if (!out.ok()) {
    return absl::DataLossError(
        absl::StrCat("a node listed a malformed placement of '", l.sequence_id, "': ", out.status().message()));
  }
  return out;
}

absl::StatusOr<PrefixStartReport> ClientImpl::StartFromPrefix(const std::string& id, const BlockLayout& L,
                                                              absl::Span<const BlockKey> chain) {
  KVRING_RETURN_IF_ERROR(ValidateSequenceId(id));
  KVRING_RETURN_IF_ERROR(SettleDetached());
  const char* why = nullptr;
  if (!L.IsValid(&why)) return absl::InvalidArgumentError(absl::StrCat("layout: ", why));
  if (chain.empty()) return absl::InvalidArgumentError("a start from the prefix cache names a chain's blocks");
  if (chain.size() * L.block_tokens > kMaxSequenceTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("a chain of ", chain.size(), " blocks exceeds ", kMaxSequenceTokens, " tokens"));
  }
  KVRING_ASSIGN_OR_RETURN(std::vector<SequenceListing> listed, ListSequences({id}));
  if (!listed.empty() && listed[0].tokens > 0) {
    return absl::AlreadyExistsError(absl::StrCat("sequence '", id, "' holds ", listed[0].tokens,
                                                 " tokens: a start from the prefix cache makes a new one"));
  }
  KVRING_ASSIGN_OR_RETURN(size_t hit, Lookup(chain));
  PrefixStartReport rep;
  rep.blocks = hit;
  rep.tokens = uint64_t{hit} * L.block_tokens;
  if (hit == 0) return rep;
  auto undo = [&](const absl::Status& s) {
    (void)ChangeSequence(id, /*truncate=*/false, 0);
    return s;
  };
  // By reference first: each replica of each chunk records the blocks it holds.
  const auto ring = Ring();
  std::vector<BlockData> refs(hit);
  for (size_t i = 0; i < hit; ++i) {
    refs[i].key = chain[i];
    if (i > 0) refs[i].parent = chain[i - 1];
    refs[i].layout = L;
  }
  std::vector<std::vector<int>> missing;
  absl::StatusOr<PutReport> shared = PutBlocks(refs, &id, 0, &missing);
  if (!shared.ok()) return undo(shared.status());
  rep.blocks_shared = shared->replicas_written;
  // Then the bytes, from the prefix cache's copy, to the replicas that lack a block.
  std::vector<size_t> need;
  for (size_t i = 0; i < hit; ++i) {
    if (!missing[i].empty()) need.push_back(i);
  }
  if (need.empty()) return rep;
  if (Ring()->version() != ring->version()) {
    return undo(absl::UnavailableError("the shard map changed while the sequence started: start it again"));
  }
  std::vector<BlockKey> keys;
  for (size_t i : need) keys.push_back(chain[i]);
  std::vector<GetResult> got = GetBlocks(keys, {});
  std::map<int, std::vector<size_t>> per_node;  // node -> indices into need
  for (size_t k = 0; k < need.size(); ++k) {
    if (!got[k].status.ok()) {
      return undo(
          absl::Status(got[k].status.code(),
                       absl::StrCat("block ", need[k], " of the chain (", chain[need[k]].ToHex(),
                                    ") left the prefix cache while the sequence started: ", got[k].status.message())));
    }
    for (int n : missing[need[k]]) per_node[n].push_back(k);
  }
  for (const auto& [n, ks] : per_node) {
    std::shared_ptr<Node> node = NodeFor(ring->node(n).node_id());
    if (!node) return undo(absl::UnavailableError(absl::StrCat("node ", ring->node(n).node_id(), " is gone")));
    v1::PutRequest req;
    *req.mutable_header() = Header();
    std::vector<absl::Span<const uint8_t>> payloads;
    for (size_t k : ks) {
      const GetResult& g = got[k];
      v1::PutBlock* pb = req.add_blocks();
      PutBlockToProto(chain[need[k]], need[k] > 0 ? chain[need[k] - 1] : BlockKey{}, g.meta.layout, g.meta.encoding,
                      g.payload, /*by_reference=*/false, pb);
      pb->mutable_sequence()->set_sequence_id(id);
      pb->mutable_sequence()->set_block_index(need[k]);
      payloads.push_back(g.payload);
    }
    absl::StatusOr<v1::PutResponse> resp = PutOn(*node, std::move(req), payloads);
    absl::Status s = resp.status();
    if (s.ok() && resp->results_size() != static_cast<int>(ks.size())) {
      s = absl::DataLossError("Put reply has the wrong number of results");
    }
    for (int r = 0; s.ok() && r < resp->results_size(); ++r) s = StatusOf(resp->results(r).status());
    if (!s.ok()) {
      return undo(
          absl::Status(s.code(), absl::StrCat("copying the chain's blocks to ", node->id(), ": ", s.message())));
    }
    rep.blocks_copied += ks.size();
    for (size_t k : ks) rep.bytes_copied += got[k].payload.size();
  }
  return rep;
}

absl::StatusOr<ForkReport> ClientImpl::ForkSequence(const std::string& source, const std::string& id, uint64_t tokens) {
  KVRING_RETURN_IF_ERROR(ValidateSequenceId(source));
  KVRING_RETURN_IF_ERROR(ValidateSequenceId(id));
  KVRING_RETURN_IF_ERROR(SettleDetached());
  if (source == id) return absl::InvalidArgumentError(absl::StrCat("sequence '", id, "' forked onto itself"));
  if (tokens == 0 || tokens > kMaxSequenceTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("a fork of ", tokens, " tokens (1 to ", kMaxSequenceTokens, "; a new sequence needs no fork)"));
  }
  auto ring = Ring();
  const std::vector<int> nodes = UpNodes(*ring);
  if (nodes.empty()) return absl::UnavailableError("the shard map has no node up");
  // The source as the nodes hold it: its length, block size and placement.
  KVRING_ASSIGN_OR_RETURN(std::vector<SequenceListing> listed, ListSequences({source}));
  if (listed.empty() || listed[0].block_tokens == 0) {
    return absl::NotFoundError(absl::StrCat("no node holds sequence '", source, "'"));
  }
  const SequenceListing& src = listed[0];
  if (src.tokens < tokens) {
    return absl::FailedPreconditionError(absl::StrCat("sequence '", source, "' holds ", src.tokens,
                                                      " tokens; a fork of its first ", tokens, " needs them all"));
  }
  KVRING_ASSIGN_OR_RETURN(const SequencePlacement source_placement, PlacementOf(src));
  placements_.Set(source, source_placement);
  const uint64_t span = uint64_t{ring->chunk_blocks()} * src.block_tokens;
  ForkReport rep;
  rep.shared_chunks = (tokens + span - 1) / span;
  KVRING_ASSIGN_OR_RETURN(SequencePlacement placement, source_placement.Fork(source, rep.shared_chunks));
  v1::ForkSequenceRequest req;
  *req.mutable_header() = Header();
  req.set_source_id(source);
  req.set_sequence_id(id);
  req.set_tokens(tokens);
  placement.ToProto(req.mutable_placement());
  std::vector<absl::StatusOr<v1::ForkSequenceResponse>> res =
      FanOut<v1::ForkSequenceResponse>(*ring, nodes, [&](size_t, Node& n) { return n.Grpc().ForkSequence(req); });
  absl::Status error;
  bool exists = false;
  for (size_t j = 0; j < res.size(); ++j) {
    if (!res[j].ok()) {
      exists |= absl::IsAlreadyExists(res[j].status());
      if (error.ok()) {
        error = absl::Status(res[j].status().code(),
                             absl::StrCat("ForkSequence '", source, "' -> '", id, "' on ",
                                          ring->node(nodes[j]).node_id(), ": ", res[j].status().message()));
      }
      continue;
    }
    rep.nodes_holding += res[j]->held();
    rep.blocks_shared += res[j]->blocks_shared();
    rep.blocks_copied += res[j]->blocks_copied();
  }
  if (!error.ok()) {
    // Nothing of a failed fork stays; but an id that names another
    // sequence somewhere is the caller's, and stays as it was.
    if (!exists) (void)ChangeSequence(id, /*truncate=*/false, 0);
    return error;
  }
  placements_.Set(id, placement);
  return rep;
}

}  // namespace kvring
