#include "kvring/protocol/shard_ring.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "xxhash.h"

namespace kvring {

ShardRing::ShardRing(const v1::ShardMap& map) : map_(map) {
  const uint32_t vn = std::max<uint32_t>(1, map_.virtual_nodes());
  for (int i = 0; i < map_.nodes_size(); ++i) {
    for (uint32_t v = 0; v < vn; ++v) {
      const std::string p = absl::StrCat(map_.nodes(i).node_id(), "#", v);
      points_.emplace_back(XXH3_64bits(p.data(), p.size()), i);
    }
  }
  std::sort(points_.begin(), points_.end());
}

int ShardRing::write_quorum() const {
  const int r = replication();
  const int w = static_cast<int>(map_.write_quorum());
  return w <= 0 || w > r ? r : w;
}

bool ShardRing::RoutesLike(const v1::ShardMap& m) const {
  if (m.replication() != map_.replication() || m.write_quorum() != map_.write_quorum() ||
      m.virtual_nodes() != map_.virtual_nodes() || m.sequence_chunk_blocks() != map_.sequence_chunk_blocks() ||
      m.nodes_size() != map_.nodes_size()) {
    return false;
  }
  for (int i = 0; i < m.nodes_size(); ++i) {
    const v1::NodeInfo &a = m.nodes(i), &b = map_.nodes(i);
    if (a.node_id() != b.node_id() || a.grpc_address() != b.grpc_address() || a.ucx_address() != b.ucx_address() ||
        a.incarnation() != b.incarnation() || a.state() != b.state()) {
      return false;
    }
  }
  return true;
}

uint64_t ShardRing::ChunkPosition(std::string_view ns, std::string_view sequence_id, uint64_t chunk) {
  const std::string s = absl::StrCat(std::string(ns), "/", std::string(sequence_id), "/", chunk);
  return XXH3_64bits(s.data(), s.size());
}

std::vector<int> ShardRing::PreferenceList(uint64_t position) const {
  std::vector<int> out;
  if (points_.empty()) return out;
  const int n = num_nodes();
  std::vector<bool> seen(n, false);
  auto it = std::lower_bound(points_.begin(), points_.end(), std::make_pair(position, -1));
  for (size_t step = 0; step < points_.size() && static_cast<int>(out.size()) < n; ++step, ++it) {
    if (it == points_.end()) it = points_.begin();
    if (!seen[it->second]) {
      seen[it->second] = true;
      out.push_back(it->second);
    }
  }
  return out;
}

std::vector<int> ShardRing::WriteTargets(uint64_t position) const {
  std::vector<int> out;
  for (int i : PreferenceList(position)) {
    if (up(i)) out.push_back(i);
    if (static_cast<int>(out.size()) == replication()) break;
  }
  return out;
}

std::vector<int> ShardRing::ReadCandidates(uint64_t position) const {
  std::vector<int> pref = PreferenceList(position), out;
  for (int i : pref)
    if (up(i)) out.push_back(i);
  for (int i : pref)
    if (!up(i)) out.push_back(i);
  return out;
}

}  // namespace kvring
