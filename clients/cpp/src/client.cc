// ClientImpl: connecting, the shard map and the nodes, blocks (Put, Get,
// Lookup, Pin, Stats); and kvring::Client, which forwards to it.
#include "kvring/client/client.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client_impl.h"
#include "grpcpp/create_channel.h"
#include "kvring/cache/quantize.h"
#include "kvring/common/logging.h"
#include "kvring/common/status_macros.h"
#include "kvring/layout/token_rows.h"
#include "kvring/protocol/tls.h"
#include "kvring/transport/ucx_rpc.h"

namespace kvring {

void ClientImpl::PutBlockToProto(const BlockKey& key, const BlockKey& parent, const BlockLayout& layout,
                                 const KvEncoding& encoding, absl::Span<const uint8_t> payload, bool by_reference,
                                 v1::PutBlock* pb) {
  v1::BlockHeader* h = pb->mutable_block();
  KeyToProto(key, h->mutable_key());
  if (!parent.is_zero()) KeyToProto(parent, h->mutable_parent());
  LayoutToProto(layout, h->mutable_layout());
  pb->set_by_reference(by_reference);
  if (by_reference) return;
  h->set_encoding(encoding.Pack());
  h->set_payload_bytes(static_cast<uint32_t>(payload.size()));
  h->set_checksum(PayloadChecksum(payload.data(), payload.size()));
}

absl::Status ClientImpl::Init() {
  KVRING_ASSIGN_OR_RETURN(creds_, MakeChannelCredentials(o_.tls));
  if (o_.tls.enabled()) o_.use_ucx = false;  // UCX is not encrypted
  KVRING_ASSIGN_OR_RETURN(coord_, CoordinatorChannel::Create(o_.coordinator, creds_));
  v1::WhoAmIRequest req;
  req.set_version(1);
  absl::Status s = coord_->Call([&] { return Context(absl::Seconds(5)); },
                                [&](v1::Coordinator::Stub& stub, grpc::ClientContext* ctx) {
                                  tenant_.Clear();
                                  return stub.WhoAmI(ctx, req, &tenant_);
                                });
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("coordinator ", o_.coordinator, ": ", s.message()));
  KVRING_ASSIGN_OR_RETURN(ns_, ResolveNamespace(tenant_, o_.ns));
  ns_id_ = NamespaceIdOf(ns_);
  return RefreshMap();
}

std::unique_ptr<grpc::ClientContext> ClientImpl::Context(absl::Duration timeout) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata("authorization", "Bearer " + o_.token);
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  return ctx;
}

v1::RequestHeader ClientImpl::Header() const {
  v1::RequestHeader h;
  h.set_version(1);
  h.set_namespace_(o_.ns);
  return h;
}

absl::Status ClientImpl::RefreshMap() {
  v1::GetShardMapRequest req;
  req.set_version(1);
  v1::ShardMap map;
  KVRING_RETURN_IF_ERROR(coord_->Call([&] { return Context(absl::Seconds(5)); },
                                      [&](v1::Coordinator::Stub& stub, grpc::ClientContext* ctx) {
                                        map.Clear();
                                        return stub.GetShardMap(ctx, req, &map);
                                      }));
  {
    // The same ring object while the routing is the same (routes cached by
    // ring stay valid: ChunkRoutes).
    absl::MutexLock l(&mu_);
    if (ring_ != nullptr && ring_->RoutesLike(map)) {
      last_refresh_ = absl::Now();
      return absl::OkStatus();
    }
  }
  auto ring = std::make_shared<const ShardRing>(map);
  absl::MutexLock l(&mu_);
  last_refresh_ = absl::Now();
  for (const auto& n : map.nodes()) {
    auto& conn = nodes_[n.node_id()];
    if (conn == nullptr || conn->grpc_address() != n.grpc_address() || conn->ucx_address() != n.ucx_address()) {
      conn = std::make_shared<Node>(n.node_id(), n.grpc_address(), n.ucx_address(), creds_,
                                    ChannelCallOptions{o_.token, o_.rpc_timeout}, o_.use_ucx, o_.ucx_loop);
    }
  }
  ring_ = ring;
  return absl::OkStatus();
}

std::shared_ptr<const ShardRing> ClientImpl::Ring() {
  bool stale;
  {
    absl::MutexLock l(&mu_);
    stale = absl::Now() - last_refresh_ > o_.map_refresh;
  }
  if (stale) {
    absl::Status s = RefreshMap();  // the coordinator being away is no reason to stop serving
    if (!s.ok()) {
      absl::MutexLock l(&mu_);
      last_refresh_ = absl::Now();
    }
  }
  absl::MutexLock l(&mu_);
  return ring_;
}

std::shared_ptr<ClientImpl::Node> ClientImpl::NodeFor(const std::string& id) {
  absl::MutexLock l(&mu_);
  auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : it->second;
}

absl::StatusOr<DeviceMemory*> ClientImpl::Dev() {
  absl::MutexLock l(&dev_mu_);
  if (dev_ == nullptr) {
    KVRING_ASSIGN_OR_RETURN(dev_, DeviceMemory::Create());
    if (o_.detach_device_steps) detached_ = std::make_unique<DetachedRounds>(dev_.get(), kMaxDetachedSteps);
  }
  return dev_.get();
}

DetachedRounds* ClientImpl::Detached() {
  absl::MutexLock l(&dev_mu_);
  return detached_.get();
}

absl::Status ClientImpl::SettleDetached() {
  DetachedRounds* d = Detached();
  return d != nullptr ? d->Drain() : absl::OkStatus();
}

void ClientImpl::Suspect(const std::string& id) {
  {
    absl::MutexLock l(&mu_);
    suspect_until_[id] = absl::Now() + absl::Seconds(2);
  }
  (void)RefreshMap();
}

bool ClientImpl::Suspected(const std::string& id) {
  absl::MutexLock l(&mu_);
  auto it = suspect_until_.find(id);
  return it != suspect_until_.end() && it->second > absl::Now();
}

std::vector<int> ClientImpl::Demoted(const ShardRing& ring, absl::Span<const int> nodes) {
  std::vector<int> good, bad;
  for (int i : nodes) (ring.up(i) && !Suspected(ring.node(i).node_id()) ? good : bad).push_back(i);
  good.insert(good.end(), bad.begin(), bad.end());
  return good;
}

ClientImpl::StepRoutes ClientImpl::RoutesOf(const std::shared_ptr<const ShardRing>& ring, const AttendStep& st,
                                            const std::vector<uint64_t>& nchunks) {
  StepRoutes r;
  r.routes.reserve(st.sequences.size());
  for (size_t b = 0; b < st.sequences.size(); ++b) {
    const std::string& id = st.sequences[b].sequence_id;
    r.routes.push_back(routes_.Get(ring, ns_, id, placements_.Get(id), nchunks[b]));
  }
  bool suspecting;
  {
    absl::MutexLock l(&mu_);
    const absl::Time now = absl::Now();
    absl::erase_if(suspect_until_, [&](const auto& kv) { return kv.second <= now; });
    suspecting = !suspect_until_.empty();
  }
  if (!suspecting) return r;
  r.reordered.resize(st.sequences.size());
  for (size_t b = 0; b < st.sequences.size(); ++b) {
    for (uint64_t c = 0; c < nchunks[b]; ++c) r.reordered[b].push_back(Demoted(*ring, r.routes[b]->candidates(c)));
  }
  return r;
}

std::vector<std::pair<int, std::vector<size_t>>> ClientImpl::CutIntoMessages(
    const std::map<int, std::vector<size_t>>& plan, absl::FunctionRef<uint64_t(size_t)> bytes_of) const {
  std::vector<std::pair<int, std::vector<size_t>>> jobs;
  for (const auto& [node_idx, idx] : plan) {
    uint64_t bytes = 0;
    jobs.emplace_back(node_idx, std::vector<size_t>{});
    for (size_t i : idx) {
      const uint64_t b = bytes_of(i);
      if (!jobs.back().second.empty() && bytes + b > o_.max_batch_bytes) {
        jobs.emplace_back(node_idx, std::vector<size_t>{});
        bytes = 0;
      }
      jobs.back().second.push_back(i);
      bytes += b;
    }
  }
  return jobs;
}

absl::StatusOr<v1::PutResponse> ClientImpl::PutOn(Node& n, v1::PutRequest req,
                                                  const std::vector<absl::Span<const uint8_t>>& payloads) {
  return n.Channel()->Put(std::move(req), payloads);
}

bool ClientImpl::AddDevicePlaces(DeviceMemory& dev, const std::vector<absl::Span<uint8_t>>& dsts, v1::GetRequest* req) {
  std::vector<DeviceMemory::ExportedAllocation> allocs;
  for (const auto& d : dsts) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(d.data());
    size_t a = 0;
    while (a < allocs.size() && !(p >= allocs[a].base && p - allocs[a].base < allocs[a].bytes)) ++a;
    if (a == allocs.size()) {
      absl::StatusOr<DeviceMemory::ExportedAllocation> e = dev.Export(d.data());
      if (!e.ok() || allocs.size() == static_cast<size_t>(kMaxGetDeviceAllocations)) {
        req->clear_device_allocations();
        req->clear_device_places();
        return false;
      }
      allocs.push_back(std::move(*e));
      req->add_device_allocations()->set_ipc_handle(allocs.back().ipc_handle);
    }
    v1::DevicePlace* pl = req->add_device_places();
    pl->set_allocation(static_cast<uint32_t>(a));
    pl->set_offset(p - allocs[a].base);
    pl->set_capacity(std::min<uint64_t>(d.size(), allocs[a].bytes - (p - allocs[a].base)));
  }
  req->set_host_id(host_id_);
  return true;
}

absl::Status ClientImpl::HeaderInto(const v1::BlockHeader& h, GetResult* r) {
  last_block_bytes_.store(h.payload_bytes(), std::memory_order_relaxed);
  KVRING_ASSIGN_OR_RETURN(r->meta.layout, LayoutFromProto(h.layout()));
  KvEncoding::Unpack(static_cast<uint8_t>(h.encoding()), &r->meta.encoding);
  r->meta.payload_bytes = h.payload_bytes();
  r->meta.checksum = h.checksum();
  r->parent = KeyFromProto(h.parent());
  return absl::OkStatus();
}

absl::Span<uint8_t> ClientImpl::LandingFor(const NodeChannel& ch, bool device_places, DeviceMemory::Staging* staging,
                                           size_t nkeys, const std::vector<absl::Span<uint8_t>>& dsts,
                                           std::vector<GetResult>* out, bool* in_dsts) {
  // Several blocks into host destinations that follow one another in
  // memory (a tensor or array of blocks): the reply lands in them directly,
  // and a block that landed early (a block before it missing or shorter)
  // is moved to its place afterwards. Scattered destinations: the reply
  // lands in this thread's landing buffer (kept, so its pages are not
  // faulted in again for every call; not zeroed), then each block is
  // copied to its destination.
  struct Landing {
    std::unique_ptr<uint8_t[]> p;
    size_t n = 0;
  };
  thread_local Landing landing;
  *in_dsts = false;
  // inline in the reply (gRPC), or nothing to land (a refusing node's
  // payloads come as their own buffer)
  if (!ch.payloads_beside() || device_places) return {};
  if (staging != nullptr) return absl::MakeSpan(staging->data(), staging->size());
  if (nkeys > 1 && !dsts.empty()) {
    size_t total = 0;
    bool follow = true;
    for (size_t i = 0; i < dsts.size(); ++i) {
      follow &= i == 0 || dsts[i].data() == dsts[i - 1].data() + dsts[i - 1].size();
      total += dsts[i].size();
    }
    *in_dsts = follow;
    if (follow) return absl::MakeSpan(dsts[0].data(), total);
    if (landing.n < total) {
      landing.p.reset(new uint8_t[total]);
      landing.n = total;
    }
    return absl::MakeSpan(landing.p.get(), total);
  }
  if (nkeys == 1) {
    if (!dsts.empty()) return dsts[0];
    (*out)[0].payload.resize(last_block_bytes_.load(std::memory_order_relaxed));
    return absl::MakeSpan((*out)[0].payload);
  }
  return {};
}

void ClientImpl::PlaceBlocks(const Node& n, const std::vector<BlockKey>& keys,
                             const std::vector<absl::Span<uint8_t>>& dsts, DeviceMemory* dev,
                             const v1::GetResponse& resp, const ReplyPayloads& from, std::vector<GetResult>* out) {
  // (a block that landed in the destinations, to be moved to its place)
  struct Move {
    size_t i;
    const uint8_t* src;
    size_t size;
  };
  std::vector<Move> moves;
  size_t off = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const v1::GetBlock& b = resp.blocks(static_cast<int>(i));
    GetResult& r = (*out)[i];
    r.node_id = n.id();
    r.status = StatusOf(b.status());
    if (!r.status.ok()) {
      r.payload.clear();
      continue;
    }
    const size_t size = b.block().payload_bytes();
    if (absl::Status h = HeaderInto(b.block(), &r); !h.ok()) {
      r.status = h;
      continue;
    }
    const uint8_t* src = nullptr;
    if (from.landed) {
      // already in place
    } else if (from.via_ucx) {
      if (off + size > from.bulk.size()) {
        r.status = absl::DataLossError("UCX Get reply shorter than its headers");
        continue;
      }
      src = from.bulk.data() + off;
      off += size;
    } else {
      if (b.payload().size() != size) {
        r.status = absl::DataLossError("Get reply payload has the wrong size");
        continue;
      }
      src = reinterpret_cast<const uint8_t*>(b.payload().data());
    }
    uint8_t* dst;
    if (!dsts.empty()) {
      if (dsts[i].size() < size) {
        r.status =
            absl::InvalidArgumentError(absl::StrCat("destination of ", dsts[i].size(), " bytes for a block of ", size));
        continue;
      }
      dst = dsts[i].data();
      if (dev != nullptr) {
        // Checked in host memory, then one copy to the device.
        if (PayloadChecksum(src, size) != r.meta.checksum) {
          r.status =
              absl::DataLossError(absl::StrCat("block ", keys[i].ToHex(), " from ", n.id(), " fails its checksum"));
        } else {
          r.status = dev->ToDevice(dst, src, size);
        }
        continue;
      }
    } else {
      if (!from.landed) r.payload.resize(size);
      dst = r.payload.data();
    }
    if (from.in_dsts && src != nullptr) {
      moves.push_back({i, src, size});  // in place, or moved up to its place below
      continue;
    }
    if (src != nullptr) std::memcpy(dst, src, size);
    if (PayloadChecksum(dst, size) != r.meta.checksum) {
      r.status = absl::DataLossError(absl::StrCat("block ", keys[i].ToHex(), " from ", n.id(), " fails its checksum"));
      r.payload.clear();
    }
  }
  // Blocks that landed in the destinations: each lies at or before its
  // place (the reply packs the found blocks back to back), so moving the
  // last first never overwrites one not yet moved.
  for (auto it = moves.rbegin(); it != moves.rend(); ++it) {
    uint8_t* dst = dsts[it->i].data();
    if (it->src != dst) std::memmove(dst, it->src, it->size);
    if (PayloadChecksum(dst, it->size) != (*out)[it->i].meta.checksum) {
      (*out)[it->i].status =
          absl::DataLossError(absl::StrCat("block ", keys[it->i].ToHex(), " from ", n.id(), " fails its checksum"));
    }
  }
}

absl::StatusOr<std::vector<GetResult>> ClientImpl::GetOn(Node& n, const std::vector<BlockKey>& keys,
                                                         const std::vector<absl::Span<uint8_t>>& dsts, bool on_device) {
  // Device destinations: the payloads land in pinned staging (over UCX,
  // straight from the reply), are checked there, then copied to the GPU.
  DeviceMemory* dev = nullptr;
  DeviceMemory::Staging staging;
  v1::GetRequest req;
  *req.mutable_header() = Header();
  for (const auto& k : keys) KeyToProto(k, req.add_keys());
  // A GPU node on this host copies the blocks into the destinations itself.
  bool device_places = false;
  if (on_device) {
    KVRING_ASSIGN_OR_RETURN(dev, Dev());
    device_places =
        o_.device_delivery && !host_id_.empty() && !n.device_refused.load() && AddDevicePlaces(*dev, dsts, &req);
    if (!device_places) {
      size_t total = 0;
      for (const auto& d : dsts) total += d.size();
      KVRING_ASSIGN_OR_RETURN(staging, dev->Pinned(total));
    }
  }
  std::vector<GetResult> out(keys.size());
  std::shared_ptr<NodeChannel> ch = n.Channel();
  ReplyPayloads from;
  const absl::Span<uint8_t> into =
      LandingFor(*ch, device_places, on_device ? &staging : nullptr, keys.size(), dsts, &out, &from.in_dsts);
  KVRING_ASSIGN_OR_RETURN(GetReply g, ch->Get(req, into));
  std::vector<uint8_t> bulk;  // the UCX payload when it came as its own buffer
  if (g.bulk_reply) {
    if (g.in_into && (on_device || (keys.size() > 1 && !dsts.empty()))) {
      from.bulk = absl::MakeConstSpan(into.data(), g.bulk_size);
    } else if (g.in_into) {
      if (dsts.empty()) out[0].payload.resize(g.bulk_size);
      from.landed = true;  // a single block, straight in its destination
    } else {
      bulk = std::move(g.bulk);
      from.bulk = bulk;
    }
    from.via_ucx = true;
  }
  const v1::GetResponse& resp = g.resp;
  if (resp.blocks_size() != static_cast<int>(keys.size()))
    return absl::DataLossError("Get reply has the wrong number of blocks");
  if (device_places && !resp.delivered_to_device()) {
    // The node answered with payloads instead; it will again (no GPU,
    // another host, memory it cannot map): ask it the ordinary way.
    if (!n.device_refused.exchange(true)) {
      KVRING_LOG(INFO) << "node " << n.id() << " does not deliver into this process's GPU memory ("
                       << resp.device_refusal() << "); its blocks come through pinned staging";
    }
  }
  if (device_places && resp.delivered_to_device()) {
    for (size_t i = 0; i < keys.size(); ++i) {
      const v1::GetBlock& b = resp.blocks(static_cast<int>(i));
      GetResult& r = out[i];
      r.node_id = n.id();
      r.status = StatusOf(b.status());
      if (r.status.ok()) r.status = HeaderInto(b.block(), &r);
      r.delivered_in_place = r.status.ok();
    }
    return out;
  }
  PlaceBlocks(n, keys, dsts, on_device ? dev : nullptr, resp, from, &out);
  return out;
}

absl::StatusOr<uint32_t> ClientImpl::LookupOn(Node& n, const std::vector<BlockKey>& keys) {
  v1::LookupRequest req;
  *req.mutable_header() = Header();
  for (const auto& k : keys) KeyToProto(k, req.add_keys());
  KVRING_ASSIGN_OR_RETURN(v1::LookupResponse resp, n.Grpc().Lookup(req));
  return resp.prefix_length();
}

absl::StatusOr<v1::PinResponse> ClientImpl::PinOn(Node& n, const std::vector<BlockKey>& keys, bool unpin) {
  v1::PinRequest req;
  *req.mutable_header() = Header();
  req.set_unpin(unpin);
  for (const auto& k : keys) KeyToProto(k, req.add_keys());
  return n.Grpc().Pin(req);
}

absl::StatusOr<v1::AttendResponse> ClientImpl::AttendOn(Node& n, v1::AttendRequest req,
                                                        const std::vector<absl::Span<const uint8_t>>& parts,
                                                        const std::vector<absl::Span<const uint8_t>>& k_parts,
                                                        const std::vector<absl::Span<const uint8_t>>& v_parts,
                                                        absl::Span<uint8_t> reply) {
  return n.Channel()->Attend(std::move(req), parts, k_parts, v_parts, reply);
}

absl::StatusOr<PutReport> ClientImpl::PutBlocks(absl::Span<const BlockData> blocks, const std::string* seq,
                                                uint64_t first_block, std::vector<std::vector<int>>* missing_on) {
  if (missing_on != nullptr) missing_on->assign(blocks.size(), {});
  if (seq != nullptr) KVRING_RETURN_IF_ERROR(SettleDetached());
  bool any_device = false;
  for (const BlockData& b : blocks) any_device |= b.payload_on_device;
  if (!any_device) return PutPlaced(blocks, seq, first_block, missing_on);
  // Payloads in GPU memory: one copy each into pinned staging, sent from there.
  KVRING_ASSIGN_OR_RETURN(DeviceMemory * dev, Dev());
  size_t total = 0;
  for (const BlockData& b : blocks) total += b.payload_on_device ? b.payload.size() : 0;
  if (total > 4 * o_.max_batch_bytes && blocks.size() > 1) {
    // Bounded staging: put the blocks in parts of up to four messages,
    // each staged on its own (its messages go in parallel).
    PutReport rep;
    for (size_t i = 0; i < blocks.size();) {
      size_t j = i, part = 0;
      while (j < blocks.size() && (j == i || part + blocks[j].payload.size() <= 4 * o_.max_batch_bytes)) {
        part += blocks[j++].payload.size();
      }
      KVRING_ASSIGN_OR_RETURN(PutReport r, PutBlocks(blocks.subspan(i, j - i), seq, first_block + i));
      rep.blocks += r.blocks;
      rep.inserted += r.inserted;
      rep.replicas_written += r.replicas_written;
      rep.bytes += r.bytes;
      i = j;
    }
    return rep;
  }
  KVRING_ASSIGN_OR_RETURN(DeviceMemory::Staging staging, dev->Pinned(total));
  std::vector<BlockData> staged(blocks.begin(), blocks.end());
  size_t off = 0;
  for (BlockData& b : staged) {
    if (!b.payload_on_device) continue;
    KVRING_RETURN_IF_ERROR(dev->ToHost(staging.data() + off, b.payload.data(), b.payload.size()));
    b.payload = absl::MakeConstSpan(staging.data() + off, b.payload.size());
    b.payload_on_device = false;
    off += b.payload.size();
  }
  return PutPlaced(staged, seq, first_block, missing_on);
}

std::vector<ClientImpl::PutOutcome> ClientImpl::PutJob(Node& node, absl::Span<const BlockData> blocks,
                                                       const std::vector<size_t>& idx, const std::string* seq,
                                                       uint64_t first_block, bool by_reference) {
  std::vector<PutOutcome> res(idx.size());
  v1::PutRequest req;
  *req.mutable_header() = Header();
  req.set_quantize(quantize_wire_);
  std::vector<absl::Span<const uint8_t>> payloads;
  for (size_t i : idx) {
    const BlockData& b = blocks[i];
    v1::PutBlock* pb = req.add_blocks();
    if (by_reference) {
      PutBlockToProto(b.key, b.parent, b.layout, b.encoding, {}, /*by_reference=*/true, pb);
    } else {
      PutBlockToProto(b.key, b.parent, b.layout, b.encoding, b.payload, /*by_reference=*/false, pb);
      pb->set_pin(b.pin);
    }
    if (seq) {
      pb->mutable_sequence()->set_sequence_id(*seq);
      pb->mutable_sequence()->set_block_index(first_block + i);
    }
    payloads.push_back(b.payload);
  }
  absl::StatusOr<v1::PutResponse> resp = PutOn(node, std::move(req), payloads);
  for (size_t k = 0; k < idx.size(); ++k) {
    if (!resp.ok()) {
      res[k].status = resp.status();
    } else if (resp->results_size() != static_cast<int>(idx.size())) {
      res[k].status = absl::DataLossError("Put reply has the wrong number of results");
    } else {
      const auto& r = resp->results(static_cast<int>(k));
      res[k].status = StatusOf(r.status());
      res[k].inserted = r.inserted();
    }
  }
  return res;
}

absl::StatusOr<PutReport> ClientImpl::PutPlaced(absl::Span<const BlockData> blocks, const std::string* seq,
                                                uint64_t first_block, std::vector<std::vector<int>>* missing_on) {
  auto ring = Ring();
  if (ring->num_nodes() == 0) return absl::UnavailableError("the shard map has no nodes");
  const int R = ring->replication(), W = ring->write_quorum();
  const size_t n = blocks.size();
  // Each block's nodes: a sequence's by chunk from its cached route (as
  // its steps are routed), a hash-placed block's by its key.
  std::shared_ptr<const ChunkRoutes::Route> route;
  if (seq && n > 0) {
    route = routes_.Get(ring, ns_, *seq, placements_.Get(*seq), (first_block + n - 1) / ring->chunk_blocks() + 1);
  }
  std::vector<std::vector<int>> cands(n);
  std::vector<size_t> next(n, 0);  // next candidate to try
  std::vector<int> acks(n, 0);
  std::vector<absl::Status> last_err(n);
  std::vector<int> inserted(n, 0);
  std::vector<std::vector<int>> pinned_on(n);  // nodes that stored (and pinned) a pinned block
  for (size_t i = 0; i < n; ++i) {
    cands[i] = route != nullptr ? Demoted(*ring, route->candidates((first_block + i) / ring->chunk_blocks()))
                                : Candidates(*ring, ShardRing::KeyPosition(blocks[i].key));
  }
  std::vector<int> want(n, R);
  PutReport rep;
  rep.blocks = n;
  for (int round = 0; round < 2 * ring->num_nodes() + 1; ++round) {
    // node -> blocks to write there this round
    std::map<int, std::vector<size_t>> plan;
    for (size_t i = 0; i < n; ++i) {
      while (want[i] > 0 && next[i] < cands[i].size()) {
        plan[cands[i][next[i]++]].push_back(i);
        --want[i];
      }
    }
    if (plan.empty()) break;
    // One job per message: a node's messages run in parallel, so its
    // receive, store and reply of one overlap the client's staging of the
    // next (one message at a time left every stage waiting on the others:
    // 1.2 GB/s to a daemon on the H200 host with no thread busy).
    const std::vector<std::pair<int, std::vector<size_t>>> jobs =
        CutIntoMessages(plan, [&](size_t i) { return uint64_t{blocks[i].payload.size()}; });
    using Outcomes = std::vector<PutOutcome>;
    std::vector<Outcomes> results = FanOut<Outcomes>(
        *ring, NodesOf(jobs),
        [&](size_t j, Node& node) {
          return PutJob(node, blocks, jobs[j].second, seq, first_block, /*by_reference=*/missing_on != nullptr);
        },
        [&](size_t j) { return Outcomes(jobs[j].second.size(), PutOutcome{absl::UnavailableError("unknown node")}); },
        [](const Outcomes& os) {
          return std::any_of(os.begin(), os.end(), [](const PutOutcome& o) { return IsNodeFailure(o.status); });
        });
    for (size_t j = 0; j < jobs.size(); ++j) {
      for (size_t k = 0; k < jobs[j].second.size(); ++k) {
        const size_t i = jobs[j].second[k];
        const absl::Status& s = results[j][k].status;
        if (s.ok()) {
          ++acks[i];
          ++rep.replicas_written;
          if (blocks[i].pin) pinned_on[i].push_back(jobs[j].first);
          if (results[j][k].inserted) inserted[i] = 1;
        } else if (IsNodeFailure(s)) {
          last_err[i] = s;
          ++want[i];  // try the next candidate
        } else if (missing_on != nullptr && absl::IsNotFound(s)) {
          (*missing_on)[i].push_back(jobs[j].first);
        } else {
          last_err[i] = s;  // the node refused the block (bad input, quota...): no retry elsewhere
        }
      }
    }
  }
  absl::Status first_error = absl::OkStatus();
  for (size_t i = 0; i < n; ++i) {
    rep.inserted += inserted[i];
    rep.bytes += blocks[i].payload.size();
    const size_t missing = missing_on != nullptr ? (*missing_on)[i].size() : 0;
    if (acks[i] + static_cast<int>(missing) < W && first_error.ok()) {
      first_error = absl::Status(
          last_err[i].ok() ? absl::StatusCode::kUnavailable : last_err[i].code(),
          absl::StrCat("block ", i, " (", blocks[i].key.ToHex(), ") stored on ", acks[i], " of ", W,
                       " required replicas", last_err[i].ok() ? "" : ": ", std::string(last_err[i].message())));
    }
  }
  if (first_error.ok()) return rep;
  // A failed Put leaves no pins: every pin it placed is taken back. The
  // replicas that stored a block keep it as an ordinary cache block
  // (content-addressed and checksummed, so never wrong; evictable), and a
  // retry completes the put.
  if (absl::Status u = UnpinPlaced(*ring, blocks, pinned_on); !u.ok()) {
    first_error = absl::Status(first_error.code(),
                               absl::StrCat(first_error.message(), "; and taking its pins back failed: ", u.message()));
  }
  return first_error;
}

absl::Status ClientImpl::UnpinPlaced(const ShardRing& ring, absl::Span<const BlockData> blocks,
                                     const std::vector<std::vector<int>>& pinned_on) {
  std::map<int, std::vector<size_t>> plan;
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (int node : pinned_on[i]) plan[node].push_back(i);
  }
  absl::Status first = absl::OkStatus();
  for (const auto& [node_idx, idx] : plan) {
    auto node = NodeFor(ring.node(node_idx).node_id());
    if (!node) continue;
    std::vector<BlockKey> keys;
    for (size_t i : idx) keys.push_back(blocks[i].key);
    absl::StatusOr<v1::PinResponse> resp = PinOn(*node, keys, /*unpin=*/true);
    absl::Status s = resp.status();
    for (int k = 0; s.ok() && k < resp->results_size(); ++k) s = StatusOf(resp->results(k).status());
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

std::vector<GetResult> ClientImpl::GetBlocks(absl::Span<const BlockKey> keys,
                                             absl::Span<const absl::Span<uint8_t>> dsts, bool on_device) {
  auto ring = Ring();
  const size_t n = keys.size();
  std::vector<GetResult> out(n);
  std::vector<std::vector<int>> cands(n);
  std::vector<size_t> next(n, 0);
  std::vector<bool> done(n, false);
  for (size_t i = 0; i < n; ++i) {
    cands[i] = Candidates(*ring, ShardRing::KeyPosition(keys[i]));
    out[i].status = absl::NotFoundError(absl::StrCat("block ", keys[i].ToHex(), " not held by any replica"));
  }
  const size_t max_tries = static_cast<size_t>(std::max(1, ring->num_nodes()));
  for (size_t round = 0; round < max_tries; ++round) {
    std::map<int, std::vector<size_t>> plan;
    for (size_t i = 0; i < n; ++i) {
      if (!done[i] && next[i] < cands[i].size()) plan[cands[i][next[i]++]].push_back(i);
    }
    if (plan.empty()) break;
    // Requests of at most max_batch_bytes (the destinations' sizes, else
    // the last block size seen).
    const uint64_t est = std::max<uint64_t>(1, last_block_bytes_.load(std::memory_order_relaxed));
    const std::vector<std::pair<int, std::vector<size_t>>> jobs =
        CutIntoMessages(plan, [&](size_t i) { return dsts.empty() ? est : uint64_t{dsts[i].size()}; });
    std::vector<absl::StatusOr<std::vector<GetResult>>> res =
        FanOut<std::vector<GetResult>>(*ring, NodesOf(jobs), [&](size_t j, Node& node) {
          std::vector<BlockKey> ks;
          std::vector<absl::Span<uint8_t>> ds;
          for (size_t i : jobs[j].second) {
            ks.push_back(keys[i]);
            if (!dsts.empty()) ds.push_back(dsts[i]);
          }
          return GetOn(node, ks, ds, on_device);
        });
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (!res[j].ok()) {
        for (size_t i : jobs[j].second) out[i].status = res[j].status();
        continue;
      }
      for (size_t k = 0; k < jobs[j].second.size(); ++k) {
        const size_t i = jobs[j].second[k];
        GetResult& r = (*res[j])[k];
        if (r.status.ok()) {
          out[i] = std::move(r);
          done[i] = true;
        } else if (!absl::IsNotFound(r.status) || absl::IsNotFound(out[i].status)) {
          out[i].status = r.status;
        }
      }
    }
  }
  return out;
}

absl::StatusOr<size_t> ClientImpl::Lookup(absl::Span<const BlockKey> chain) {
  auto ring = Ring();
  if (chain.empty()) return size_t{0};
  // Each key asks its first live replica; each node answers for its ordered
  // subsequence; the global prefix ends at the earliest first miss.
  std::map<int, std::vector<size_t>> plan;
  for (size_t i = 0; i < chain.size(); ++i) {
    auto c = Candidates(*ring, ShardRing::KeyPosition(chain[i]));
    if (c.empty()) return absl::UnavailableError("no nodes");
    plan[c[0]].push_back(i);
  }
  std::vector<std::pair<int, std::vector<size_t>>> jobs(plan.begin(), plan.end());
  std::vector<absl::StatusOr<uint32_t>> res = FanOut<uint32_t>(*ring, NodesOf(jobs), [&](size_t j, Node& node) {
    std::vector<BlockKey> ks;
    for (size_t i : jobs[j].second) ks.push_back(chain[i]);
    return LookupOn(node, ks);
  });
  size_t prefix = chain.size();
  for (size_t j = 0; j < jobs.size(); ++j) {
    const auto& idx = jobs[j].second;
    if (!res[j].ok()) {
      // A node that cannot answer: its first block counts as a miss (the
      // engine recomputes). Any other answer (a revoked token, a bad
      // request) is the caller's to see, not a miss.
      if (!IsNodeFailure(res[j].status())) return res[j].status();
      prefix = std::min(prefix, idx[0]);
      continue;
    }
    if (*res[j] < idx.size()) prefix = std::min(prefix, idx[*res[j]]);
  }
  return prefix;
}

std::vector<NodeStats> ClientImpl::Stats() {
  auto ring = Ring();
  std::vector<NodeStats> out(ring->num_nodes());
  pool_.ParallelFor(out.size(), [&](size_t i) {
    const auto& info = ring->node(static_cast<int>(i));
    NodeStats& s = out[i];
    s.node_id = info.node_id();
    s.address = info.grpc_address();
    s.state = v1::NodeInfo::State_Name(info.state());
    auto node = NodeFor(info.node_id());
    if (!node) {
      s.status = absl::UnavailableError("unknown node");
      return;
    }
    v1::StatsRequest req;
    *req.mutable_header() = Header();
    absl::StatusOr<v1::StatsResponse> got = node->Grpc().Stats(req, absl::Seconds(2));
    s.status = got.status();
    if (!got.ok()) return;
    const v1::StatsResponse& r = *got;
    s.blocks = r.blocks();
    s.host_blocks = r.host_blocks();
    s.cold_blocks = r.cold_blocks();
    s.pinned_blocks = r.pinned_blocks();
    s.free_pages = r.free_pages();
    s.num_pages = r.num_pages();
    s.puts = r.puts();
    s.hits = r.hits();
    s.misses = r.misses();
    s.evictions = r.evictions();
    s.demotions = r.demotions();
    s.promotions = r.promotions();
    s.sequences = r.sequences();
    s.cold_stored_bytes = r.cold_stored_bytes();
    s.cold_raw_bytes = r.cold_raw_bytes();
    s.backend = r.backend();
    s.hbm_pages = r.hbm_pages();
    s.hbm_free_pages = r.hbm_free_pages();
    s.hbm_page_bytes = r.hbm_page_bytes();
    s.hbm_blocks = r.hbm_blocks();
    s.hbm_hits = r.hbm_hits();
    s.hbm_misses = r.hbm_misses();
    s.hbm_demotions = r.hbm_demotions();
    s.hbm_shared_pages = r.hbm_shared_pages();
    s.open_blocks = r.open_blocks();
    s.device_delivered_bytes = r.device_delivered_bytes();
    s.tenant_sequences = r.tenant_sequences();
    s.tenant_sequence_blocks = r.tenant_sequence_blocks();
    s.tenant_sequence_bytes = r.tenant_sequence_bytes();
    s.tenant_sequence_open_blocks = r.tenant_sequence_open_blocks();
    s.tenant_open_bytes = r.tenant_open_bytes();
    s.tenant_sequence_host_blocks = r.tenant_sequence_host_blocks();
    s.tenant_sequence_cold_blocks = r.tenant_sequence_cold_blocks();
    s.tenant_sequence_hbm_bytes = r.tenant_sequence_hbm_bytes();
  });
  return out;
}

absl::Status ClientImpl::PinBlocks(absl::Span<const BlockKey> keys, bool unpin) {
  auto ring = Ring();
  std::map<int, std::vector<size_t>> plan;
  for (size_t i = 0; i < keys.size(); ++i) {
    for (int n : Candidates(*ring, ShardRing::KeyPosition(keys[i]))) {
      if (ring->up(n)) plan[n].push_back(i);
    }
  }
  absl::Status first = absl::OkStatus();
  std::vector<int> ok_count(keys.size(), 0);
  std::vector<std::pair<int, std::vector<size_t>>> jobs(plan.begin(), plan.end());
  std::vector<absl::StatusOr<v1::PinResponse>> res =
      FanOut<v1::PinResponse>(*ring, NodesOf(jobs), [&](size_t j, Node& node) {
        std::vector<BlockKey> ks;
        for (size_t i : jobs[j].second) ks.push_back(keys[i]);
        return PinOn(node, ks, unpin);
      });
  for (size_t j = 0; j < jobs.size(); ++j) {
    const std::vector<size_t>& idx = jobs[j].second;
    if (!res[j].ok()) {
      // A node that cannot answer is survivable (another replica pins);
      // any other refusal (auth, bad request) is the caller's to see.
      if (!IsNodeFailure(res[j].status()) && first.ok()) first = res[j].status();
      continue;
    }
    for (int k = 0; k < res[j]->results_size() && k < static_cast<int>(idx.size()); ++k) {
      absl::Status r = StatusOf(res[j]->results(k).status());
      if (r.ok())
        ++ok_count[idx[k]];
      else if (!absl::IsNotFound(r) && first.ok())
        first = r;
    }
  }
  if (!first.ok()) return first;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (ok_count[i] == 0) return absl::NotFoundError(absl::StrCat("block ", keys[i].ToHex(), " is on no live node"));
  }
  return absl::OkStatus();
}

Client::Client(std::unique_ptr<ClientImpl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.token.empty()) return absl::InvalidArgumentError("a tenant token is required");
  if (options.rpc_timeout <= absl::ZeroDuration() || options.rpc_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("rpc_timeout must be a positive, finite duration, not ",
                                                   absl::FormatDuration(options.rpc_timeout)));
  }
  if (options.threads > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("threads must be at most 4096, not ", options.threads));
  }
  KVRING_RETURN_IF_ERROR(ValidateUcxLoopOptions(options.ucx_loop));
  auto impl = std::make_unique<ClientImpl>(options);
  KVRING_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

const std::string& Client::tenant_name() const { return impl_->tenant_.name(); }
const std::string& Client::namespace_name() const { return impl_->ns_; }
BlockKeyHasher Client::Hasher(const std::string& model_id, const BlockLayout& layout) const {
  return BlockKeyHasher(model_id, impl_->ns_, layout);
}
absl::StatusOr<std::optional<KvEncoding>> ParseQuantizeOption(std::string_view text) {
  if (text.empty()) return std::optional<KvEncoding>();
  KvEncoding e;
  KVRING_RETURN_IF_ERROR(ParseKvEncoding(text, &e));
  return std::optional<KvEncoding>(e);
}

absl::StatusOr<size_t> Client::LookupPrefix(absl::Span<const BlockKey> chain) { return impl_->Lookup(chain); }
absl::StatusOr<PutReport> Client::Put(absl::Span<const BlockData> blocks) {
  return impl_->PutBlocks(blocks, nullptr, 0);
}
std::vector<GetResult> Client::Get(absl::Span<const BlockKey> keys) { return impl_->GetBlocks(keys, {}); }
std::vector<GetResult> Client::GetInto(absl::Span<const BlockKey> keys, absl::Span<const absl::Span<uint8_t>> dsts,
                                       bool on_device) {
  if (dsts.size() != keys.size()) {
    std::vector<GetResult> out(keys.size());
    for (auto& r : out) r.status = absl::InvalidArgumentError("GetInto needs one destination per key");
    return out;
  }
  return impl_->GetBlocks(keys, dsts, on_device);
}
absl::Status Client::Pin(absl::Span<const BlockKey> keys, bool unpin) { return impl_->PinBlocks(keys, unpin); }
absl::StatusOr<PutReport> Client::PutSequence(const std::string& sequence_id, uint64_t first_block,
                                              absl::Span<const BlockData> blocks) {
  KVRING_RETURN_IF_ERROR(ValidateSequenceId(sequence_id));
  return impl_->PutBlocks(blocks, &sequence_id, first_block);
}
absl::Status Client::StepInto(const AttendStep& step, PartialOutput out, AttendReport* report) {
  return impl_->StepInto(step, out, report);
}
absl::StatusOr<PartialResult> Client::Step(const AttendStep& step, AttendReport* report) {
  PartialResult r(step.q.num_rows, step.q.q_heads, step.q.head_dim);
  KVRING_RETURN_IF_ERROR(impl_->StepInto(step, r.view(), report));
  return r;
}
absl::StatusOr<PartialResult> Client::Attend(const std::string& sequence_id, const BlockLayout& layout,
                                             uint64_t num_tokens, const QueryTensor& q, const AttentionOptions& options,
                                             AttendReport* report) {
  if (q.seq_ids != nullptr) return absl::InvalidArgumentError("Attend serves one sequence; seq_ids must be null");
  if (q.num_rows == 0) return absl::InvalidArgumentError("Attend needs at least one query row");
  AttendStep st;
  st.layout = layout;
  st.sequences.push_back(AttendSequence{sequence_id, num_tokens, q.num_rows, 0});
  st.q = q;
  st.options = options;
  return Step(st, report);
}
std::vector<NodeStats> Client::Stats() { return impl_->Stats(); }
absl::StatusOr<SequenceChangeReport> Client::DeleteSequence(const std::string& sequence_id) {
  return impl_->ChangeSequence(sequence_id, false, 0);
}
absl::StatusOr<SequenceChangeReport> Client::TruncateSequence(const std::string& sequence_id, uint64_t tokens) {
  return impl_->ChangeSequence(sequence_id, true, tokens);
}
absl::StatusOr<std::vector<SequenceListing>> Client::ListSequences(absl::Span<const std::string> ids) {
  KVRING_RETURN_IF_ERROR(impl_->SettleDetached());
  return impl_->ListSequences(ids);
}
absl::StatusOr<ForkReport> Client::ForkSequence(const std::string& source_id, const std::string& sequence_id,
                                                uint64_t tokens) {
  return impl_->ForkSequence(source_id, sequence_id, tokens);
}
absl::StatusOr<PrefixStartReport> Client::StartSequenceFromPrefix(const std::string& sequence_id,
                                                                  const BlockLayout& layout,
                                                                  absl::Span<const BlockKey> chain) {
  return impl_->StartFromPrefix(sequence_id, layout, chain);
}
uint64_t Client::map_version() const {
  absl::MutexLock l(&impl_->mu_);
  return impl_->ring_ ? impl_->ring_->version() : 0;
}
absl::Status Client::RefreshMap() { return impl_->RefreshMap(); }

absl::StatusOr<CreatedTenant> CreateTenant(const std::string& coordinator, const std::string& admin_token,
                                           const TenantSpec& spec, const TlsConfig& tls) {
  KVRING_ASSIGN_OR_RETURN(auto creds, MakeChannelCredentials(tls));
  KVRING_ASSIGN_OR_RETURN(auto channel, CoordinatorChannel::Create(coordinator, creds));
  v1::CreateTenantRequest req;
  req.set_version(1);
  req.set_name(spec.name);
  req.set_max_pinned_bytes(spec.max_pinned_bytes);
  req.set_kv_encoding(spec.kv_encoding);
  req.set_sequence_ttl_s(spec.sequence_ttl_s);
  for (const auto& n : spec.shared_namespaces) req.add_shared_namespaces(n);
  v1::CreateTenantResponse resp;
  KVRING_RETURN_IF_ERROR(channel->Call(
      [&] {
        auto ctx = std::make_unique<grpc::ClientContext>();
        ctx->AddMetadata("authorization", "Bearer " + admin_token);
        ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
        return ctx;
      },
      [&](v1::Coordinator::Stub& stub, grpc::ClientContext* ctx) { return stub.CreateTenant(ctx, req, &resp); }));
  return CreatedTenant{resp.token(), resp.tenant().id(), resp.tenant().namespace_()};
}

}  // namespace kvring
