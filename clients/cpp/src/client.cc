#include "kvring/client/client.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/create_channel.h"
#include "kvring.grpc.pb.h"
#include "kvring/attention/merge.h"
#include "kvring/attention/step/step_shape.h"
#include "kvring/cache/quantize.h"
#include "kvring/client/device_memory.h"
#include "kvring/common/logging.h"
#include "kvring/common/process.h"
#include "kvring/common/status_macros.h"
#include "kvring/common/thread_pool.h"
#include "kvring/layout/token_rows.h"
#include "kvring/protocol/chunk_routes.h"
#include "kvring/protocol/coordinator_channel.h"
#include "kvring/protocol/shard_ring.h"
#include "kvring/protocol/tls.h"
#include "kvring/protocol/wire.h"
#include "kvring/transport/ucx_rpc.h"
#include "node_channel.h"
#include "sequence_placements.h"

namespace kvring {

namespace {
using Clock = std::chrono::steady_clock;

bool IsNodeFailure(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsCancelled(s);
}

absl::Status StatusOf(const v1::Status& s) { return StatusFromProto(s); }
double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A PutBlock's block header: key, parent (none when zero), layout, and the
// payload's encoding, size and checksum; by reference (PutBlock.by_reference:
// no bytes travel), none of those three.
void PutBlockToProto(const BlockKey& key, const BlockKey& parent, const BlockLayout& layout, const KvEncoding& encoding,
                     absl::Span<const uint8_t> payload, bool by_reference, v1::PutBlock* pb) {
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

// An Attend whose payload (queries and appended K/V in host memory) is
// larger than this is sent from a pool thread, so that the fan-out's
// staging copies run in parallel; smaller ones (decode steps) are all sent
// from the caller's thread.
constexpr uint64_t kStartedAttendMaxBytes = 256 << 10;
}  // namespace

class ClientImpl {
 public:
  using Node = NodeConnection;

  explicit ClientImpl(const ClientOptions& o)
      : o_(o),
        quantize_wire_(!o.quantize               ? ""
                       : o.quantize->quantized() ? KvEncodingName(*o.quantize)
                                                 : "none"),
        pool_(o.threads ? o.threads : 16) {
    node_events_ok_ = o.node_reply_when_queued;
  }

  absl::Status Init() {
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

  std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", "Bearer " + o_.token);
    ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
    return ctx;
  }

  v1::RequestHeader Header() const {
    v1::RequestHeader h;
    h.set_version(1);
    h.set_namespace_(o_.ns);
    return h;
  }

  absl::Status RefreshMap() {
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

  std::shared_ptr<const ShardRing> Ring() {
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

  std::shared_ptr<Node> NodeFor(const std::string& id) {
    absl::MutexLock l(&mu_);
    auto it = nodes_.find(id);
    return it == nodes_.end() ? nullptr : it->second;
  }

  // The device copier, created on first use (the process may have no GPU).
  absl::StatusOr<DeviceMemory*> Dev() {
    absl::MutexLock l(&dev_mu_);
    if (dev_ == nullptr) {
      KVRING_ASSIGN_OR_RETURN(dev_, DeviceMemory::Create());
    }
    return dev_.get();
  }

  void Suspect(const std::string& id) {
    {
      absl::MutexLock l(&mu_);
      suspect_until_[id] = absl::Now() + absl::Seconds(2);
    }
    (void)RefreshMap();
  }
  bool Suspected(const std::string& id) {
    absl::MutexLock l(&mu_);
    auto it = suspect_until_.find(id);
    return it != suspect_until_.end() && it->second > absl::Now();
  }

  // Node indices for a ring position: live, unsuspected nodes first.
  std::vector<int> Candidates(const ShardRing& ring, uint64_t pos) { return Demoted(ring, ring.ReadCandidates(pos)); }
  // `nodes` with the down and suspected ones moved last, in order.
  std::vector<int> Demoted(const ShardRing& ring, absl::Span<const int> nodes) {
    std::vector<int> good, bad;
    for (int i : nodes) (ring.up(i) && !Suspected(ring.node(i).node_id()) ? good : bad).push_back(i);
    good.insert(good.end(), bad.begin(), bad.end());
    return good;
  }

  // The nodes of each chunk of a step's sequences, live and unsuspected
  // first: the cached routes (ChunkRoutes), reordered only while this client
  // suspects a node.
  struct StepRoutes {
    std::vector<std::shared_ptr<const ChunkRoutes::Route>> routes;  // per sequence
    std::vector<std::vector<std::vector<int>>> reordered;           // per sequence and chunk, when suspecting
    absl::Span<const int> operator()(size_t seq, uint64_t chunk) const {
      return reordered.empty() ? routes[seq]->candidates(chunk) : absl::MakeConstSpan(reordered[seq][chunk]);
    }
    // The digest of the placement sequence `seq` is routed by.
    uint64_t digest(size_t seq) const { return routes[seq]->placement_digest; }
  };
  StepRoutes RoutesOf(const std::shared_ptr<const ShardRing>& ring, const AttendStep& st,
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

  // One round of calls to nodes, the shape of every operation's fan-out:
  // call(j, node) for each job j, in parallel on the fan-out pool (job j
  // goes to node `nodes[j]` of `ring`; a node this client does not know gets
  // unknown_node(j)). Then every node whose result failed(result) says did
  // not answer (a node failure) is suspected, once: its replicas serve the
  // next round and the map is refreshed.
  template <typename R>
  std::vector<R> FanOut(const ShardRing& ring, absl::Span<const int> nodes, absl::FunctionRef<R(size_t, Node&)> call,
                        absl::FunctionRef<R(size_t)> unknown_node, absl::FunctionRef<bool(const R&)> failed) {
    std::vector<R> res(nodes.size());
    pool_.ParallelFor(nodes.size(), [&](size_t j) {
      std::shared_ptr<Node> node = NodeFor(ring.node(nodes[j]).node_id());
      res[j] = node ? call(j, *node) : unknown_node(j);
    });
    SuspectFailed(ring, nodes, res, failed);
    return res;
  }
  // Every node whose result failed(result) says did not answer is suspected, once.
  template <typename R>
  void SuspectFailed(const ShardRing& ring, absl::Span<const int> nodes, const std::vector<R>& res,
                     absl::FunctionRef<bool(const R&)> failed) {
    std::set<int> down;
    for (size_t j = 0; j < nodes.size(); ++j) {
      if (failed(res[j])) down.insert(nodes[j]);
    }
    for (int i : down) Suspect(ring.node(i).node_id());
  }
  // The same for calls with one status: a node failure status is a node that
  // did not answer.
  template <typename T>
  std::vector<absl::StatusOr<T>> FanOut(const ShardRing& ring, absl::Span<const int> nodes,
                                        absl::FunctionRef<absl::StatusOr<T>(size_t, Node&)> call) {
    return FanOut<absl::StatusOr<T>>(
        ring, nodes, call, [](size_t) { return absl::StatusOr<T>(absl::UnavailableError("unknown node")); },
        [](const absl::StatusOr<T>& r) { return !r.ok() && IsNodeFailure(r.status()); });
  }
  template <typename Job>
  static std::vector<int> NodesOf(const std::vector<Job>& jobs) {
    std::vector<int> nodes;
    nodes.reserve(jobs.size());
    for (const Job& j : jobs) nodes.push_back(NodeIndex(j));
    return nodes;
  }
  static int NodeIndex(const std::pair<int, std::vector<size_t>>& job) { return job.first; }
  // A plan's items per node cut into jobs of at most max_batch_bytes each
  // (`bytes_of(item)`; an item larger than that is a job of its own): the
  // node's message limit holds, and a node's jobs run in parallel.
  std::vector<std::pair<int, std::vector<size_t>>> CutIntoMessages(const std::map<int, std::vector<size_t>>& plan,
                                                                   absl::FunctionRef<uint64_t(size_t)> bytes_of) const {
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

  // ---- per-node calls ----
  absl::StatusOr<v1::PutResponse> PutOn(Node& n, v1::PutRequest req,
                                        const std::vector<absl::Span<const uint8_t>>& payloads) {
    return n.Channel()->Put(std::move(req), payloads);
  }

  // Names, in `req`, where each destination lies in this process's GPU
  // memory (the allocations as IPC handles, one place per key). False (and
  // `req` without places) when some destination cannot be exported.
  bool AddDevicePlaces(DeviceMemory& dev, const std::vector<absl::Span<uint8_t>>& dsts, v1::GetRequest* req) {
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

  // A Get reply's block header into `r` (meta and parent); remembers the
  // block size for sizing later replies. INVALID_ARGUMENT for a bad layout.
  absl::Status HeaderInto(const v1::BlockHeader& h, GetResult* r) {
    last_block_bytes_.store(h.payload_bytes(), std::memory_order_relaxed);
    KVRING_ASSIGN_OR_RETURN(r->meta.layout, LayoutFromProto(h.layout()));
    KvEncoding::Unpack(static_cast<uint8_t>(h.encoding()), &r->meta.encoding);
    r->meta.payload_bytes = h.payload_bytes();
    r->meta.checksum = h.checksum();
    r->parent = KeyFromProto(h.parent());
    return absl::OkStatus();
  }

  // `dsts` (empty, or one per key): where payloads go; else into results.
  absl::StatusOr<std::vector<GetResult>> GetOn(Node& n, const std::vector<BlockKey>& keys,
                                               const std::vector<absl::Span<uint8_t>>& dsts, bool on_device = false) {
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
    v1::GetResponse resp;
    std::vector<uint8_t> bulk;
    absl::Span<const uint8_t> bulk_view;  // the UCX payload: `bulk`, or the staging it landed in
    bool via_ucx = false;
    std::vector<GetResult> out(keys.size());
    bool landed = false;  // a single block landed straight in its destination
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
    bool in_dsts = false;
    std::shared_ptr<NodeChannel> ch = n.Channel();
    absl::Span<uint8_t> into;
    if (!ch->payloads_beside() || device_places) {
      // inline in the reply (gRPC), or nothing to land (a refusing node's
      // payloads come as their own buffer)
    } else if (on_device) {
      into = absl::MakeSpan(staging.data(), staging.size());
    } else if (keys.size() > 1 && !dsts.empty()) {
      size_t total = 0;
      in_dsts = true;
      for (size_t i = 0; i < dsts.size(); ++i) {
        in_dsts &= i == 0 || dsts[i].data() == dsts[i - 1].data() + dsts[i - 1].size();
        total += dsts[i].size();
      }
      if (in_dsts) {
        into = absl::MakeSpan(dsts[0].data(), total);
      } else {
        if (landing.n < total) {
          landing.p.reset(new uint8_t[total]);
          landing.n = total;
        }
        into = absl::MakeSpan(landing.p.get(), total);
      }
    } else if (keys.size() == 1) {
      if (!dsts.empty()) {
        into = dsts[0];
      } else {
        out[0].payload.resize(last_block_bytes_.load(std::memory_order_relaxed));
        into = absl::MakeSpan(out[0].payload);
      }
    }
    KVRING_ASSIGN_OR_RETURN(GetReply g, ch->Get(req, into));
    resp = std::move(g.resp);
    if (g.bulk_reply) {
      if (g.in_into && (on_device || (keys.size() > 1 && !dsts.empty()))) {
        bulk_view = absl::MakeConstSpan(into.data(), g.bulk_size);
      } else if (g.in_into) {
        if (dsts.empty()) out[0].payload.resize(g.bulk_size);
        landed = true;
      } else {
        bulk = std::move(g.bulk);
      }
      via_ucx = true;
    }
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
    struct Move {
      size_t i;
      const uint8_t* src;
      size_t size;
    };
    std::vector<Move> moves;
    size_t off = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      const v1::GetBlock& b = resp.blocks(static_cast<int>(i));
      GetResult& r = out[i];
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
      if (landed) {
        // already in place
      } else if (via_ucx) {
        if (bulk_view.data() == nullptr) bulk_view = bulk;
        if (off + size > bulk_view.size()) {
          r.status = absl::DataLossError("UCX Get reply shorter than its headers");
          continue;
        }
        src = bulk_view.data() + off;
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
          r.status = absl::InvalidArgumentError(
              absl::StrCat("destination of ", dsts[i].size(), " bytes for a block of ", size));
          continue;
        }
        dst = dsts[i].data();
        if (on_device) {
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
        if (!landed) r.payload.resize(size);
        dst = r.payload.data();
      }
      if (in_dsts && src != nullptr) {
        moves.push_back({i, src, size});  // in place, or moved up to its place below
        continue;
      }
      if (src != nullptr) std::memcpy(dst, src, size);
      if (PayloadChecksum(dst, size) != r.meta.checksum) {
        r.status =
            absl::DataLossError(absl::StrCat("block ", keys[i].ToHex(), " from ", n.id(), " fails its checksum"));
        r.payload.clear();
      }
    }
    // Blocks that landed in the destinations: each lies at or before its
    // place (the reply packs the found blocks back to back), so moving the
    // last first never overwrites one not yet moved.
    for (auto it = moves.rbegin(); it != moves.rend(); ++it) {
      uint8_t* dst = dsts[it->i].data();
      if (it->src != dst) std::memmove(dst, it->src, it->size);
      if (PayloadChecksum(dst, it->size) != out[it->i].meta.checksum) {
        out[it->i].status =
            absl::DataLossError(absl::StrCat("block ", keys[it->i].ToHex(), " from ", n.id(), " fails its checksum"));
      }
    }
    return out;
  }

  absl::StatusOr<uint32_t> LookupOn(Node& n, const std::vector<BlockKey>& keys) {
    v1::LookupRequest req;
    *req.mutable_header() = Header();
    for (const auto& k : keys) KeyToProto(k, req.add_keys());
    KVRING_ASSIGN_OR_RETURN(v1::LookupResponse resp, n.Grpc().Lookup(req));
    return resp.prefix_length();
  }

  absl::StatusOr<v1::PinResponse> PinOn(Node& n, const std::vector<BlockKey>& keys, bool unpin) {
    v1::PinRequest req;
    *req.mutable_header() = Header();
    req.set_unpin(unpin);
    for (const auto& k : keys) KeyToProto(k, req.add_keys());
    return n.Grpc().Pin(req);
  }

  // One Attend to one node: `parts` is the bulk payload (queries || new_k ||
  // new_v, as spans); the reply's out || lse lands in `reply` (sized for it).
  absl::StatusOr<v1::AttendResponse> AttendOn(Node& n, v1::AttendRequest req,
                                              const std::vector<absl::Span<const uint8_t>>& parts,
                                              const std::vector<absl::Span<const uint8_t>>& k_parts,
                                              const std::vector<absl::Span<const uint8_t>>& v_parts,
                                              absl::Span<uint8_t> reply) {
    return n.Channel()->Attend(std::move(req), parts, k_parts, v_parts, reply);
  }

  // ---- public operations ----
  // With `missing_on` (a sequence's blocks): by reference, no bytes sent
  // (PutBlock.by_reference); the nodes that do not hold block i go to
  // (*missing_on)[i] and count toward its write quorum (the caller sends
  // them the bytes).
  absl::StatusOr<PutReport> PutBlocks(absl::Span<const BlockData> blocks, const std::string* seq, uint64_t first_block,
                                      std::vector<std::vector<int>>* missing_on = nullptr) {
    if (missing_on != nullptr) missing_on->assign(blocks.size(), {});
    // Payloads in GPU memory: one copy each into pinned staging, sent from there.
    std::vector<BlockData> staged;
    DeviceMemory::Staging staging;
    bool any_device = false;
    for (const BlockData& b : blocks) any_device |= b.payload_on_device;
    if (any_device) {
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
      KVRING_ASSIGN_OR_RETURN(staging, dev->Pinned(total));
      staged.assign(blocks.begin(), blocks.end());
      size_t off = 0;
      for (BlockData& b : staged) {
        if (!b.payload_on_device) continue;
        KVRING_RETURN_IF_ERROR(dev->ToHost(staging.data() + off, b.payload.data(), b.payload.size()));
        b.payload = absl::MakeConstSpan(staging.data() + off, b.payload.size());
        b.payload_on_device = false;
        off += b.payload.size();
      }
      blocks = staged;
    }
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
      struct Outcome {
        absl::Status status;
        bool inserted = false;
      };
      using Outcomes = std::vector<Outcome>;
      auto any_node_failure = [](const Outcomes& os) {
        return std::any_of(os.begin(), os.end(), [](const Outcome& o) { return IsNodeFailure(o.status); });
      };
      std::vector<Outcomes> results = FanOut<Outcomes>(
          *ring, NodesOf(jobs),
          [&](size_t j, Node& node) {
            // One message: the job is cut to max_batch_bytes.
            const auto& idx = jobs[j].second;
            Outcomes res(idx.size());
            v1::PutRequest req;
            *req.mutable_header() = Header();
            req.set_quantize(quantize_wire_);
            std::vector<absl::Span<const uint8_t>> payloads;
            for (size_t i : idx) {
              const BlockData& b = blocks[i];
              v1::PutBlock* pb = req.add_blocks();
              if (missing_on != nullptr) {
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
          },
          [&](size_t j) { return Outcomes(jobs[j].second.size(), Outcome{absl::UnavailableError("unknown node")}); },
          any_node_failure);
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
    if (!first_error.ok()) {
      // A failed Put leaves no pins: every pin it placed is taken back. The
      // replicas that stored a block keep it as an ordinary cache block
      // (content-addressed and checksummed, so never wrong; evictable), and
      // a retry completes the put.
      if (absl::Status u = UnpinPlaced(*ring, blocks, pinned_on); !u.ok()) {
        first_error =
            absl::Status(first_error.code(),
                         absl::StrCat(first_error.message(), "; and taking its pins back failed: ", u.message()));
      }
      return first_error;
    }
    return rep;
  }

  // Unpins block i on each node of pinned_on[i] (one request per node).
  absl::Status UnpinPlaced(const ShardRing& ring, absl::Span<const BlockData> blocks,
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

  std::vector<GetResult> GetBlocks(absl::Span<const BlockKey> keys, absl::Span<const absl::Span<uint8_t>> dsts,
                                   bool on_device = false) {
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

  absl::StatusOr<size_t> Lookup(absl::Span<const BlockKey> chain) {
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

  // ---- attention steps ----
  // The plan of a step: which node attends which chunks of which sequence,
  // and which nodes take which appended tokens.
  struct SeqPart {
    size_t seq = 0;                             // index into step.sequences
    std::vector<uint64_t> chunks;               // chunks this node attends (ascending)
    uint64_t append_begin = 0, append_end = 0;  // appended positions it takes
  };
  struct NodeJob {
    int node = 0;
    std::vector<SeqPart> parts;
  };
  static int NodeIndex(const NodeJob& job) { return job.node; }
  // The appended tokens [begin, end) of sequence `seq` that fall in `chunk`,
  // and the replicas that acknowledged them.
  struct AppendUnit {
    size_t seq;
    uint64_t chunk, begin, end;
    int acks = 0;
    absl::Status last;
    std::vector<int> acked_on;    // nodes that acknowledged it
    std::vector<int> missing_on;  // nodes that refused it for tokens they lack before it (DATA_LOSS)
  };
  // An attended chunk a node did not serve: retried on the next replica, or
  // (same_node_again) on the same one without the append that was refused.
  struct FailedChunk {
    size_t seq = 0;
    uint64_t chunk = 0;
    bool same_node_again = false;
    std::string why;
    absl::StatusCode code = absl::StatusCode::kUnavailable;  // the node's answer
  };

  // A step whose tensors are in this process's GPU memory, run through
  // exchange buffers (kvring.proto DeviceExchange): each round's queries and
  // K/V gathered into one on the device, the nodes on this host reading them
  // and writing their partials there, the partials merged there into the
  // caller's output. A node that refuses is served from the same buffer
  // through pinned staging.
  struct DeviceStep {
    DeviceMemory* dev = nullptr;
    void* stream = nullptr;       // where the step's device work is queued
    bool stream_ordered = false;  // the caller's stream: no wait for the device at the end
    bool initialized = false;     // the output holds a first merge (every row written)
  };

  absl::Status StepInto(const AttendStep& in, PartialOutput out, AttendReport* report) {
    if (!in.device_buffers) return StepOnHost(in, out, report);
    KVRING_ASSIGN_OR_RETURN(DeviceMemory * dev, Dev());
    void* const stream = in.stream_ordered ? in.stream : DeviceMemory::ThreadStream();
    uint64_t app = 0;
    for (const auto& s : in.sequences) app += s.append_tokens;
    const StepShape shape = ShapeOf(in);
    const uint64_t step_bytes =
        shape.query_bytes() + uint64_t{shape.num_rows} * shape.partial_row_bytes() + 2 * app * in.layout.kv_row_bytes();
    if (o_.device_delivery && !host_id_.empty() && in.q.dtype == in.layout.dtype &&
        step_bytes >= o_.device_exchange_min_bytes) {
      DeviceStep dx{dev, stream, in.stream_ordered};
      KVRING_RETURN_IF_ERROR(StepOnHost(in, out, report, &dx));
      if (!dx.initialized && in.q.num_rows > 0) {
        // No round had rows to attend (sequences without tokens): O = 0, LSE = -inf.
        KVRING_RETURN_IF_ERROR(dev->MergeRows(out.out, out.lse, shape.num_rows, nullptr, nullptr, {}, nullptr,
                                              shape.q_heads, shape.head_dim, /*init=*/true, in.out_cast,
                                              in.out_cast_dtype, stream));
        return in.stream_ordered ? absl::OkStatus() : dev->Wait(stream);
      }
      return absl::OkStatus();
    }
    // Device buffers, staged: inputs to pinned staging once, the merged output back once.
    const BlockLayout& L = in.layout;
    const size_t qb = shape.query_bytes(), kvb = app * L.kv_row_bytes();
    const size_t ob = shape.out_floats() * sizeof(float), lb = shape.lse_floats() * sizeof(float);
    KVRING_ASSIGN_OR_RETURN(DeviceMemory::Staging stage, dev->Pinned(qb + 2 * kvb + ob + lb));
    AttendStep st = in;
    st.device_buffers = false;
    st.out_cast = nullptr;  // (cast on the device below, once the output is there)
    uint8_t* p = stage.data();
    // Queued on one stream and waited for once (a decode step's three small
    // copies each paid a synchronous cudaMemcpy's round trip before).
    if (qb > 0) KVRING_RETURN_IF_ERROR(dev->CopyAsync(p, in.q.data, qb, stream));
    if (kvb > 0) {
      KVRING_RETURN_IF_ERROR(dev->CopyAsync(p + qb, in.new_k, kvb, stream));
      KVRING_RETURN_IF_ERROR(dev->CopyAsync(p + qb + kvb, in.new_v, kvb, stream));
    }
    if (qb + kvb > 0) KVRING_RETURN_IF_ERROR(dev->Wait(stream));
    st.q.data = p;
    st.new_k = p + qb;
    st.new_v = p + qb + kvb;
    float* ho = reinterpret_cast<float*>(p + qb + 2 * kvb);
    float* hl = ho + ob / 4;
    KVRING_RETURN_IF_ERROR(StepOnHost(st, PartialOutput{ho, hl}, report));
    if (ob == 0) return absl::OkStatus();  // an append-only step
    KVRING_RETURN_IF_ERROR(dev->CopyAsync(out.out, ho, ob, stream));
    KVRING_RETURN_IF_ERROR(dev->CopyAsync(out.lse, hl, lb, stream));
    if (in.out_cast != nullptr) {  // (no contributions, no init: O as it is, cast)
      KVRING_RETURN_IF_ERROR(dev->MergeRows(out.out, out.lse, shape.num_rows, nullptr, nullptr, {}, nullptr,
                                            shape.q_heads, shape.head_dim, /*init=*/false, in.out_cast,
                                            in.out_cast_dtype, stream));
    }
    if (in.stream_ordered) {
      stage.UseOn(stream);  // (not reused before the copies out of it are done)
      return absl::OkStatus();
    }
    return dev->Wait(stream);  // (the staging goes back to the pool on return)
  }

  // A step, routed once more when a node says a sequence of it is a fork
  // this client has not resolved (ABORTED: the node served nothing of that
  // sequence): the placements are learned from the nodes first. What other
  // nodes applied of the first routing is applied again with the same bytes
  // (idempotent), and the output is written anew.
  absl::Status StepOnHost(const AttendStep& st, PartialOutput out, AttendReport* report, DeviceStep* dx = nullptr) {
    absl::Status s = StepRouted(st, out, report, dx);
    if (!absl::IsAborted(s)) return s;
    std::vector<std::string> ids;
    for (const auto& q : st.sequences) ids.push_back(q.sequence_id);
    KVRING_RETURN_IF_ERROR(ResolvePlacements(ids));
    if (dx != nullptr) dx->initialized = false;
    return StepRouted(st, out, report, dx);
  }

  // Copies what node `from` holds of sequence `id` in blocks [b0, b1) onto
  // node `to`: full blocks stored there as they are (under the sequence's
  // own keys: its delete erases them), the open block's tokens appended
  // layer by layer. `to` then holds what `from` holds of those blocks
  // (tokens it held already are compared, not written again).
  absl::Status CopyReplica(const ShardRing& ring, int from, int to, const std::string& id, const BlockLayout& L,
                           uint64_t b0, uint64_t b1, uint64_t digest) {
    std::shared_ptr<Node> src = NodeFor(ring.node(from).node_id()), dst = NodeFor(ring.node(to).node_id());
    if (!src || !dst) return absl::UnavailableError("repair: unknown node");
    const NamespaceId nsid = NamespaceIdOf(ns_);
    const size_t row_bytes = size_t{L.kv_heads} * L.head_dim * DTypeSize(L.dtype);
    for (uint64_t b = b0; b < b1; b += 16) {
      v1::ReadSequenceRequest rr;
      *rr.mutable_header() = Header();
      rr.set_sequence_id(id);
      rr.set_begin_block(b);
      rr.set_end_block(std::min(b1, b + 16));
      KVRING_ASSIGN_OR_RETURN(v1::ReadSequenceResponse got, src->Grpc().ReadSequence(rr));
      v1::PutRequest put;
      *put.mutable_header() = Header();
      put.set_quantize("none");  // stored as the source holds it
      std::vector<absl::Span<const uint8_t>> payloads;
      for (const v1::SequenceBlock& blk : got.blocks()) {
        const auto* bytes = reinterpret_cast<const uint8_t*>(blk.payload().data());
        if (PayloadChecksum(bytes, blk.payload().size()) != blk.block().checksum()) {
          return absl::DataLossError(absl::StrCat("repair: block ", blk.index(), " of '", id, "' arrived corrupt"));
        }
        if (blk.filled_size() > 0) continue;  // open: appended below
        v1::PutBlock* pb = put.add_blocks();
        *pb->mutable_block() = blk.block();
        KeyToProto(SequenceBlockKey(nsid, id, blk.index(), L), pb->mutable_block()->mutable_key());
        pb->mutable_sequence()->set_sequence_id(id);
        pb->mutable_sequence()->set_block_index(blk.index());
        payloads.push_back(absl::MakeConstSpan(bytes, blk.payload().size()));
      }
      if (put.blocks_size() > 0) {
        KVRING_ASSIGN_OR_RETURN(v1::PutResponse pr, PutOn(*dst, std::move(put), payloads));
        for (const auto& r : pr.results()) KVRING_RETURN_IF_ERROR(StatusOf(r.status()));
      }
      for (const v1::SequenceBlock& blk : got.blocks()) {
        if (blk.filled_size() == 0) continue;
        if (blk.payload().size() != L.bytes() || static_cast<uint32_t>(blk.filled_size()) != L.layers) {
          return absl::DataLossError(
              absl::StrCat("repair: open block ", blk.index(), " of '", id, "' does not match the step's layout"));
        }
        const auto* bytes = reinterpret_cast<const uint8_t*>(blk.payload().data());
        for (uint32_t l = 0; l < L.layers; ++l) {
          const uint32_t n = blk.filled(static_cast<int>(l));
          if (n == 0) continue;
          std::vector<uint8_t> k(n * row_bytes), v(k.size());
          CopyTokenRows(L, bytes, l, n, k.data(), v.data());
          v1::AttendRequest req;
          *req.mutable_header() = Header();
          req.set_layer(l);
          req.set_q_heads(L.kv_heads);
          req.set_head_dim(L.head_dim);
          req.set_q_dtype(static_cast<uint32_t>(L.dtype));
          LayoutToProto(L, req.mutable_layout());
          v1::AttendSequence* as = req.add_sequences();
          as->set_sequence_id(id);
          as->set_tokens(blk.index() * L.block_tokens + n);
          as->set_append_position(blk.index() * L.block_tokens);
          as->set_append_tokens(n);
          as->set_placement_digest(digest);
          KVRING_ASSIGN_OR_RETURN(v1::AttendResponse ar, AttendOn(*dst, std::move(req), {}, {k}, {v}, {}));
          for (const v1::Status& ss : ar.sequence_status()) KVRING_RETURN_IF_ERROR(StatusOf(ss));
        }
      }
    }
    return absl::OkStatus();
  }

  // The step in the vocabulary the nodes take it in (kvring/attention/step).
  static StepShape ShapeOf(const AttendStep& st) {
    return StepShape{st.options, st.q.num_rows, st.q.q_heads, st.q.head_dim, st.q.dtype};
  }

  // A step's request shape, checked before any routing, by the rules a node
  // checks it by (CheckStepShape).
  static absl::Status CheckStep(const AttendStep& st) {
    const QueryTensor& q = st.q;
    const BlockLayout& L = st.layout;
    const char* why = nullptr;
    if (!L.IsValid(&why)) return absl::InvalidArgumentError(absl::StrCat("step layout: ", why));
    if (st.sequences.empty()) return absl::InvalidArgumentError("a step names at least one sequence");
    KVRING_RETURN_IF_ERROR(CheckStepShape(ShapeOf(st), &L));
    uint64_t rows = 0, appended = 0;
    absl::flat_hash_map<std::string, int> seen;
    for (const auto& s : st.sequences) {
      KVRING_RETURN_IF_ERROR(ValidateSequenceId(s.sequence_id));
      if (!seen.emplace(s.sequence_id, 0).second) {
        return absl::InvalidArgumentError(absl::StrCat("sequence '", s.sequence_id, "' named twice in one step"));
      }
      if (s.context_tokens > kMaxSequenceTokens || s.append_tokens > kMaxSequenceTokens - s.context_tokens) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence '", s.sequence_id, "' would exceed ", kMaxSequenceTokens, " tokens"));
      }
      if (s.rows == 0 && s.append_tokens == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence '", s.sequence_id, "' has neither rows nor appended tokens"));
      }
      if (s.rows > 0 && s.context_tokens + s.append_tokens == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence '", s.sequence_id, "' attends over 0 tokens (its query rows would have nothing to attend to)"));
      }
      rows += s.rows;
      appended += s.append_tokens;
    }
    if (rows != q.num_rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("the sequences have ", rows, " rows; the queries have ", q.num_rows));
    }
    if (rows > 0 && (q.data == nullptr || q.positions == nullptr)) {
      return absl::InvalidArgumentError("queries need data and positions");
    }
    if (appended > 0 && (st.new_k == nullptr || st.new_v == nullptr)) {
      return absl::InvalidArgumentError("appending needs new_k and new_v");
    }
    if (st.out_cast != nullptr && !st.device_buffers) {
      return absl::InvalidArgumentError("out_cast is for steps on device buffers (the model's output on its GPU)");
    }
    if (st.out_cast != nullptr && st.out_cast_dtype != DType::kBF16 && st.out_cast_dtype != DType::kF16) {
      return absl::InvalidArgumentError(
          absl::StrCat("out_cast_dtype must be bf16 or f16, not ", DTypeName(st.out_cast_dtype)));
    }
    return absl::OkStatus();
  }

  // The plan of a step (StepRouted's planner): each sequence's rows,
  // appended rows, length after the step and chunks; each chunk's nodes; the
  // appended tokens by chunk (their acks counted by the rounds); round 0's
  // parts per node.
  struct RoutedStep {
    StepShape shape;
    std::vector<uint32_t> row_begin, app_begin;
    std::vector<uint64_t> total, nchunks;
    StepRoutes cands;
    std::vector<AppendUnit> units;
    std::map<int, std::map<size_t, SeqPart>> appends;  // node -> sequence -> the appended tokens it takes
    bool two_phase = false;                            // a node takes non-adjacent parts of one append
  };
  RoutedStep Route(const std::shared_ptr<const ShardRing>& ring, const AttendStep& st) {
    RoutedStep rs;
    rs.shape = ShapeOf(st);
    const uint64_t chunk = ring->chunk_blocks(), bt = st.layout.block_tokens;
    const size_t nseq = st.sequences.size();
    rs.row_begin.resize(nseq);
    rs.app_begin.resize(nseq);
    rs.total.resize(nseq);
    rs.nchunks.resize(nseq);
    for (size_t b = 0, r = 0, a = 0; b < nseq; ++b) {
      rs.row_begin[b] = static_cast<uint32_t>(r);
      rs.app_begin[b] = static_cast<uint32_t>(a);
      r += st.sequences[b].rows;
      a += st.sequences[b].append_tokens;
      rs.total[b] = st.sequences[b].context_tokens + st.sequences[b].append_tokens;
      rs.nchunks[b] = ((rs.total[b] + bt - 1) / bt + chunk - 1) / chunk;
    }
    // Candidates per (sequence, chunk): the attending replica is the first
    // that answers; appends go to the first R.
    rs.cands = RoutesOf(ring, st, rs.nchunks);
    for (size_t b = 0; b < nseq; ++b) {
      const auto& s = st.sequences[b];
      const uint64_t span = chunk * bt;
      for (uint64_t p = s.context_tokens; p < rs.total[b];) {
        const uint64_t c = p / span, e = std::min(rs.total[b], (c + 1) * span);
        rs.units.push_back(AppendUnit{b, c, p, e});
        p = e;
      }
    }
    const int R = ring->replication();
    for (const AppendUnit& u : rs.units) {
      const absl::Span<const int> cs = rs.cands(u.seq, u.chunk);
      for (int k = 0; k < R && k < static_cast<int>(cs.size()); ++k) {
        SeqPart& p = rs.appends[cs[k]][u.seq];
        p.seq = u.seq;
        if (p.append_end == p.append_begin) {
          p.append_begin = u.begin;
          p.append_end = u.end;
        } else if (p.append_end == u.begin) {
          p.append_end = u.end;
        } else {
          rs.two_phase = true;
        }
      }
    }
    return rs;
  }

  absl::Status StepRouted(const AttendStep& st, PartialOutput out, AttendReport* report, DeviceStep* dx) {
    const auto t0 = Clock::now();
    KVRING_RETURN_IF_ERROR(CheckStep(st));
    if (dx == nullptr) {  // (on the device: the first merge writes every row)
      const StepShape shape = ShapeOf(st);
      std::fill(out.out, out.out + shape.out_floats(), 0.f);
      std::fill(out.lse, out.lse + shape.lse_floats(), -std::numeric_limits<float>::infinity());
    }
    auto ring = Ring();
    if (ring->num_nodes() == 0) return absl::UnavailableError("the shard map has no nodes");
    RoutedStep rs = Route(ring, st);
    AttendReport rep;
    rep.plan_seconds = Since(t0);
    KVRING_RETURN_IF_ERROR(RunRounds(*ring, st, rs, out, dx, &rep));
    KVRING_RETURN_IF_ERROR(SettleAppends(*ring, st, rs, &rep));
    rep.seconds = Since(t0);
    if (report) *report = rep;
    return absl::OkStatus();
  }

  // The step's rounds: with a two-phase plan its appends first (one request
  // per node and contiguous part); then every chunk attended on its first
  // candidate with the appends beside, and the chunks a node did not serve
  // on their next candidate, until every chunk is served or one has no
  // candidate left.
  absl::Status RunRounds(const ShardRing& ring, const AttendStep& st, RoutedStep& rs, PartialOutput out, DeviceStep* dx,
                         AttendReport* rep) {
    const PlannedStep planned{st, rs.shape, rs.row_begin, rs.app_begin, rs.total, rs.cands};
    absl::Status last_error = absl::OkStatus();
    std::map<int, std::map<size_t, SeqPart>> plan = std::move(rs.appends);  // node -> seq -> part
    if (rs.two_phase) {
      std::vector<NodeJob> jobs;
      for (const AppendUnit& u : rs.units) {
        const absl::Span<const int> cs = rs.cands(u.seq, u.chunk);
        for (int k = 0; k < ring.replication() && k < static_cast<int>(cs.size()); ++k) {
          jobs.push_back(NodeJob{cs[k], {SeqPart{u.seq, {}, u.begin, u.end}}});
        }
      }
      KVRING_RETURN_IF_ERROR(RunJobs(planned, ring, jobs, RoundSink{rs.units, out, dx, rep, &last_error}));
      plan.clear();
    }
    std::vector<std::pair<size_t, uint64_t>> pending;  // (sequence, chunk) still to attend
    std::vector<std::vector<size_t>> next(st.sequences.size());
    for (size_t b = 0; b < st.sequences.size(); ++b) {
      next[b].assign(rs.nchunks[b], 0);
      if (st.sequences[b].rows == 0) continue;
      for (uint64_t c = 0; c < rs.nchunks[b]; ++c) pending.emplace_back(b, c);
    }
    std::map<std::pair<size_t, uint64_t>, std::vector<FailedChunk>> tried;  // why each replica did not serve a chunk
    for (int round = 0; !pending.empty() || !plan.empty(); ++round) {
      for (const auto& [b, c] : pending) {
        if (next[b][c] >= rs.cands(b, c).size()) return NoReplicaLeft(st.sequences[b].sequence_id, c, tried[{b, c}]);
        SeqPart& p = plan[rs.cands(b, c)[next[b][c]++]][b];
        p.seq = b;
        p.chunks.push_back(c);
      }
      if (round > 0) rep->retries += static_cast<int>(plan.size());
      std::vector<NodeJob> jobs;
      for (auto& [node, parts] : plan) {
        NodeJob j{node, {}};
        for (auto& [b, p] : parts) j.parts.push_back(std::move(p));
        jobs.push_back(std::move(j));
      }
      plan.clear();
      std::vector<FailedChunk> failed;
      KVRING_RETURN_IF_ERROR(RunJobs(planned, ring, jobs, RoundSink{rs.units, out, dx, rep, &last_error, &failed}));
      pending.clear();
      for (FailedChunk& f : failed) {
        pending.emplace_back(f.seq, f.chunk);
        if (f.same_node_again) --next[f.seq][f.chunk];  // the same replica once more, attend only
        tried[{f.seq, f.chunk}].push_back(std::move(f));
      }
    }
    return absl::OkStatus();
  }

  // A chunk no candidate served. When every replica that answered refused
  // for the same reason (NOT_FOUND, FAILED_PRECONDITION, DATA_LOSS with the
  // first lost position...), that is the step's error class, one the engine
  // can act on (a dead replica beside them cannot serve the chunk either);
  // with no answer at all, UNAVAILABLE.
  static absl::Status NoReplicaLeft(const std::string& id, uint64_t chunk, const std::vector<FailedChunk>& tried) {
    absl::StatusCode code = absl::StatusCode::kUnavailable;
    std::vector<absl::StatusCode> answered;
    std::vector<std::string> why;
    for (const FailedChunk& f : tried) {
      why.push_back(f.why);
      if (f.code != absl::StatusCode::kUnavailable && f.code != absl::StatusCode::kDeadlineExceeded &&
          f.code != absl::StatusCode::kOk) {
        answered.push_back(f.code);
      }
    }
    if (!answered.empty() &&
        std::all_of(answered.begin(), answered.end(), [&](absl::StatusCode x) { return x == answered.front(); })) {
      code = answered.front();
    }
    return absl::Status(code, absl::StrCat("no live replica holds chunk ", chunk, " of sequence '", id, "' (",
                                           absl::StrJoin(why, "; "), ")"));
  }

  // After the rounds: a write replica that lacks the tokens before an
  // append (the new replica after a node's death, or one that restarted
  // without its open block) gets the chunk's blocks copied from a replica
  // that acknowledged the append (repair), so the sequence keeps R copies
  // and W=R steps go on; then every append needs its write quorum.
  absl::Status SettleAppends(const ShardRing& ring, const AttendStep& st, RoutedStep& rs, AttendReport* rep) {
    const uint64_t chunk = ring.chunk_blocks(), bt = st.layout.block_tokens;
    const int R = ring.replication(), W = ring.write_quorum();
    for (AppendUnit& u : rs.units) {
      for (int n : u.missing_on) {
        if (u.acks >= R || u.acked_on.empty()) break;
        const uint64_t b0 = u.chunk * chunk, b1 = (u.end - 1) / bt + 1;
        absl::Status r = CopyReplica(ring, u.acked_on.front(), n, st.sequences[u.seq].sequence_id, st.layout, b0, b1,
                                     rs.cands.digest(u.seq));
        if (!r.ok()) {
          u.last = r;
          continue;
        }
        ++u.acks;
        ++rep->repairs;
      }
    }
    for (const AppendUnit& u : rs.units) {
      if (u.acks < W) {
        return absl::Status(u.last.ok() ? absl::StatusCode::kUnavailable : u.last.code(),
                            absl::StrCat("tokens [", u.begin, ", ", u.end, ") of sequence '",
                                         st.sequences[u.seq].sequence_id, "' appended on ", u.acks, " of ", W,
                                         " required replicas", u.last.ok() ? "" : ": ", std::string(u.last.message())));
      }
      rep->appended_tokens += static_cast<uint32_t>((u.end - u.begin) * u.acks);
    }
    return absl::OkStatus();
  }

  // What the rounds of one step share (StepRouted computes it once).
  struct PlannedStep {
    const AttendStep& st;
    const StepShape& shape;                  // st's
    const std::vector<uint32_t>& row_begin;  // each sequence's first query row
    const std::vector<uint32_t>& app_begin;  // each sequence's first row of new_k / new_v
    const std::vector<uint64_t>& total;      // each sequence's tokens after the step
    const StepRoutes& routes;                // each chunk's nodes, each sequence's placement digest
  };

  // A step's places in the exchange buffer (device tensors), per job: its
  // partial rows (from a multiple of 64 rows, so every region is 256-byte
  // aligned), their LSE, its queries and K/V; then the merge's row lists.
  struct JobPlace {
    uint64_t q = 0, k = 0, v = 0;
    uint32_t rows = 0, app = 0, part_row = 0;
  };
  struct ExchangeStage {
    std::vector<JobPlace> place;
    DeviceMemory::Exchange xb;
    std::string inputs_event;  // the inputs' event (cudaIpcEventHandle_t bytes), or empty: waited for
    uint64_t l_base = 0, csr_off = 0;
    std::vector<int> same_rows_as;  // per job: an earlier job whose copy of the queries it reads, or -1
  };
  // Plans the exchange buffer of `jobs` (ex->place, l_base, csr_off,
  // same_rows_as; jobs that attend the same sequences share one copy of
  // their queries) and returns its size in bytes.
  static uint64_t PlaceJobs(const PlannedStep& sh, const std::vector<NodeJob>& jobs, ExchangeStage* ex) {
    const AttendStep& st = sh.st;
    const StepShape& shape = sh.shape;
    const size_t qrow = shape.query_row_bytes(), kvrow = st.layout.kv_row_bytes(), hq = shape.row_elems();
    std::vector<JobPlace>& place = ex->place;
    std::vector<int>& same_rows_as = ex->same_rows_as;
    uint64_t& l_base = ex->l_base;
    auto align = [](uint64_t n) {
      return (n + kDeviceExchangeAlign - 1) / kDeviceExchangeAlign * kDeviceExchangeAlign;
    };
    uint32_t part_rows = 0;
    for (size_t j = 0; j < jobs.size(); ++j) {
      for (const SeqPart& p : jobs[j].parts) {
        if (!p.chunks.empty()) place[j].rows += st.sequences[p.seq].rows;
        place[j].app += static_cast<uint32_t>(p.append_end - p.append_begin);
      }
      place[j].part_row = part_rows;
      part_rows += (place[j].rows + 63) / 64 * 64;
    }
    l_base = uint64_t{part_rows} * hq * sizeof(float);
    uint64_t off = align(l_base + uint64_t{part_rows} * shape.q_heads * sizeof(float));
    // Jobs that attend the same sequences read one copy of their rows (a
    // sequence spread over N nodes: N requests, one copy of its queries).
    std::vector<std::vector<size_t>> attends(jobs.size());
    same_rows_as.assign(jobs.size(), -1);
    for (size_t j = 0; j < jobs.size(); ++j) {
      for (const SeqPart& p : jobs[j].parts) {
        if (!p.chunks.empty()) attends[j].push_back(p.seq);
      }
      for (size_t e = 0; e < j && !attends[j].empty(); ++e) {
        if (same_rows_as[e] < 0 && attends[e] == attends[j]) {
          same_rows_as[j] = static_cast<int>(e);
          break;
        }
      }
    }
    for (size_t j = 0; j < jobs.size(); ++j) {
      JobPlace& jp = place[j];
      if (same_rows_as[j] >= 0) {
        jp.q = place[same_rows_as[j]].q;
      } else {
        jp.q = off;
        off = align(off + uint64_t{jp.rows} * qrow);
      }
      jp.k = off;
      off = align(off + uint64_t{jp.app} * kvrow);
      jp.v = off;
      off = align(off + uint64_t{jp.app} * kvrow);
    }
    ex->csr_off = off;
    return off + (uint64_t{shape.num_rows} + 1 + part_rows) * sizeof(int32_t);
  }

  // Copies each job's rows of the engine's tensors into its place in the
  // exchange buffer, in the order its request lists them, on dx's stream.
  absl::Status CopyIntoExchange(const PlannedStep& sh, const std::vector<NodeJob>& jobs, DeviceStep* dx,
                                ExchangeStage* ex) {
    const AttendStep& st = sh.st;
    const QueryTensor& q = st.q;
    const std::vector<uint32_t>&row_begin = sh.row_begin, &app_begin = sh.app_begin;
    const size_t qrow = sh.shape.query_row_bytes(), kvrow = st.layout.kv_row_bytes();
    const std::vector<JobPlace>& place = ex->place;
    const std::vector<int>& same_rows_as = ex->same_rows_as;
    DeviceMemory::Exchange& xb = ex->xb;
    // Each job's rows, in the order its request lists them; copies from
    // one of the caller's tensors whose sources and destinations follow
    // each other go as one. (Only within a tensor: two tensors may lie
    // back to back in memory, but one copy may not span two allocations.)
    std::vector<DeviceMemory::DeviceCopy> copies;
    int last_tensor = -1;  // the tensor of copies.back(): 0 q, 1 new_k, 2 new_v
    auto copy = [&](int tensor, uint64_t dst_off, const void* src, uint64_t n) {
      uint8_t* dst = xb.data() + dst_off;
      const auto* from = static_cast<const uint8_t*>(src);
      if (!copies.empty() && last_tensor == tensor) {
        DeviceMemory::DeviceCopy& last = copies.back();
        if (static_cast<uint8_t*>(last.dst) + last.bytes == dst &&
            static_cast<const uint8_t*>(last.src) + last.bytes == from) {
          last.bytes += n;
          return;
        }
      }
      copies.push_back(DeviceMemory::DeviceCopy{dst, from, n});
      last_tensor = tensor;
    };
    // (All of them in one launch: as cudaMemcpyAsync calls, a 4-node decode
    // step's queries and K/V were 9 API calls on the engine's thread.)
    for (size_t j = 0; j < jobs.size(); ++j) {
      uint64_t qo = place[j].q, ko = place[j].k, vo = place[j].v;
      for (const SeqPart& p : jobs[j].parts) {
        if (p.chunks.empty() || same_rows_as[j] >= 0) continue;
        const uint64_t n = uint64_t{st.sequences[p.seq].rows} * qrow;
        copy(0, qo, static_cast<const uint8_t*>(q.data) + row_begin[p.seq] * qrow, n);
        qo += n;
      }
      for (int kv = 0; kv < 2; ++kv) {
        const void* from = kv == 0 ? st.new_k : st.new_v;
        uint64_t& o = kv == 0 ? ko : vo;
        for (const SeqPart& p : jobs[j].parts) {
          if (p.append_end == p.append_begin) continue;
          const uint64_t n = p.append_end - p.append_begin;
          const uint64_t src = app_begin[p.seq] + (p.append_begin - st.sequences[p.seq].context_tokens);
          copy(1 + kv, o, static_cast<const uint8_t*>(from) + src * kvrow, n * kvrow);
          o += n * kvrow;
        }
      }
    }
    return dx->dev->CopyDevice(copies, dx->stream);
  }

  // Plans the exchange buffer of `jobs` and copies the engine's rows into it
  // (adjacent runs of one tensor as one copy; jobs that attend the same
  // sequences share one copy of their queries); on the caller's stream, the
  // nodes wait on an event recorded after the copies, else this waits.
  absl::Status StageExchange(const PlannedStep& sh, const std::vector<NodeJob>& jobs, DeviceStep* dx,
                             ExchangeStage* ex) {
    const uint64_t bytes = PlaceJobs(sh, jobs, ex);
    KVRING_ASSIGN_OR_RETURN(ex->xb, dx->dev->ExchangeBuffer(bytes, dx->stream));
    // On the caller's stream, work on xb may still be queued when it goes.
    if (dx->stream_ordered) ex->xb.UseOn(dx->stream);
    KVRING_RETURN_IF_ERROR(CopyIntoExchange(sh, jobs, dx, ex));
    std::string& inputs_event = ex->inputs_event;
    // In place before any node reads them: on the caller's stream, the
    // nodes wait on an event recorded after the copies; else this waits.
    if (dx->stream_ordered && events_ok_.load()) {
      absl::StatusOr<std::string> ev = dx->dev->RecordInputsEvent(dx->stream);
      if (ev.ok()) {
        inputs_event = std::move(*ev);
      } else {
        KVRING_LOG(INFO) << "steps on the caller's stream wait for their inputs here: " << ev.status().message();
        events_ok_ = false;
      }
    }
    if (inputs_event.empty()) KVRING_RETURN_IF_ERROR(dx->dev->Wait(dx->stream));
    return absl::OkStatus();
  }

  // Where a round's outcome goes: the appends' acks, the output, the report,
  // the last refusal and (when the caller retries) the chunks not served.
  struct RoundSink {
    std::vector<AppendUnit>& units;
    PartialOutput out;
    DeviceStep* dx;
    AttendReport* rep;
    absl::Status* last_error;
    std::vector<FailedChunk>* failed = nullptr;
  };

  // One round of a step: one request per job (every job's request built
  // first, then sent from this thread where the carrier allows it, else on
  // the pool), the replies turned into acks, retries and partials, and the
  // partials merged into the output (on the host, or in one MergeRows launch
  // over the exchange buffer). Attended chunks whose node failed or did not
  // hold them go to sink.failed (retried on the next replica); any other
  // refusal is the round's error. Lives for one RunJobs call on its thread;
  // Call runs on pool threads for different jobs at once.
  class StepRound {
   public:
    StepRound(ClientImpl& c, const PlannedStep& sh, const ShardRing& ring, const std::vector<NodeJob>& jobs,
              RoundSink k)
        : c_(c),
          sh_(sh),
          st_(sh.st),
          q_(sh.st.q),
          shape_(sh.shape),
          ring_(ring),
          jobs_(jobs),
          k_(k),
          dx_(k.dx),
          qrow_(shape_.query_row_bytes()),
          kvrow_(st_.layout.kv_row_bytes()),
          hq_(shape_.row_elems()) {}

    absl::Status Run() {
      const auto t_stage = Clock::now();
      ex_.place.resize(jobs_.size());
      if (dx_ != nullptr) {
        KVRING_RETURN_IF_ERROR(c_.StageExchange(sh_, jobs_, dx_, &ex_));
        k_.rep->stage_seconds += Since(t_stage);
      }
      {
        absl::MutexLock l(&waited_mu_);
        inputs_waited_ = ex_.inputs_event.empty();  // the inputs complete now (not only on the stream)
      }
      prepared_.resize(jobs_.size());
      for (size_t j = 0; j < jobs_.size(); ++j) prepared_[j] = Prepare(j);
      res_.resize(jobs_.size());
      SendAll();
      c_.SuspectFailed<Result>(ring_, NodesOf(jobs_), res_,
                               [](const Result& r) { return !r.resp.ok() && IsNodeFailure(r.resp.status()); });
      const auto tm = Clock::now();
      // A node that did not answer may still write into the exchange buffer
      // later: it is not reused.
      for (const Result& r : res_) {
        if (dx_ != nullptr && !r.resp.ok() && IsNodeFailure(r.resp.status())) ex_.xb.Drop();
      }
      KVRING_RETURN_IF_ERROR(WaitQueuedNodes());
      std::vector<std::vector<int32_t>> contrib(dx_ != nullptr ? shape_.num_rows : 0);  // per output row: partial rows
      for (size_t j = 0; j < jobs_.size(); ++j) KVRING_RETURN_IF_ERROR(Collect(j, contrib));
      KVRING_RETURN_IF_ERROR(MergeOnDevice(contrib));
      k_.rep->merge_seconds += Since(tm);
      absl::MutexLock l(&waited_mu_);
      k_.rep->inputs_waited_on_device = !ex_.inputs_event.empty() && !inputs_waited_;
      return absl::OkStatus();
    }

   private:
    struct Result {
      absl::StatusOr<v1::AttendResponse> resp = absl::UnknownError("");
      std::vector<uint8_t> reply;
      uint32_t rows = 0;
      uint64_t sent = 0, received = 0;  // bulk bytes
      bool in_place = false;            // served through the exchange buffer
      double round_trip = 0;            // seconds in the node's requests, at this end
    };
    // Job j's request and its payload (spans of the caller's q, new_k, new_v).
    struct Prepared {
      v1::AttendRequest req;
      std::vector<absl::Span<const uint8_t>> qp, kp, vp;
      uint32_t rows = 0;
      uint64_t bytes = 0;
    };

    Prepared Prepare(size_t j) const {
      const BlockLayout& L = st_.layout;
      const uint64_t chunk = ring_.chunk_blocks(), bt = L.block_tokens;
      Prepared pr;
      v1::AttendRequest& req = pr.req;
      *req.mutable_header() = c_.Header();
      req.set_layer(shape_.options.layer);
      req.set_q_heads(shape_.q_heads);
      req.set_head_dim(shape_.head_dim);
      req.set_q_dtype(static_cast<uint32_t>(shape_.q_dtype));
      req.set_causal(shape_.options.causal);
      req.set_window(shape_.options.window);
      req.set_softmax_scale(shape_.options.softmax_scale);
      req.set_quantize(c_.quantize_wire_);  // what the appends' completed blocks are stored as
      LayoutToProto(L, req.mutable_layout());
      for (const SeqPart& p : jobs_[j].parts) {
        const auto& s = st_.sequences[p.seq];
        v1::AttendSequence* as = req.add_sequences();
        as->set_sequence_id(s.sequence_id);
        as->set_tokens(sh_.total[p.seq]);
        as->set_placement_digest(sh_.routes.digest(p.seq));
        const uint64_t nblocks = (sh_.total[p.seq] + bt - 1) / bt;
        std::vector<uint64_t> chunks = p.chunks;
        std::sort(chunks.begin(), chunks.end());
        for (uint64_t c : chunks) {
          const uint64_t b0 = c * chunk, b1 = std::min(nblocks, (c + 1) * chunk);
          if (as->ranges_size() > 0 && as->ranges(as->ranges_size() - 1).end() == b0) {
            as->mutable_ranges(as->ranges_size() - 1)->set_end(b1);
          } else {
            v1::BlockRange* r = as->add_ranges();
            r->set_begin(b0);
            r->set_end(b1);
          }
        }
        if (!p.chunks.empty()) {
          const uint32_t r0 = sh_.row_begin[p.seq];
          as->set_rows(s.rows);
          pr.rows += s.rows;
          for (uint32_t r = 0; r < s.rows; ++r) req.add_positions(q_.positions[r0 + r]);
          pr.qp.push_back(absl::MakeConstSpan(static_cast<const uint8_t*>(q_.data) + r0 * qrow_, s.rows * qrow_));
          pr.bytes += s.rows * qrow_;
        }
        if (p.append_end > p.append_begin) {
          const uint64_t n = p.append_end - p.append_begin;
          const uint64_t src = sh_.app_begin[p.seq] + (p.append_begin - s.context_tokens);
          as->set_append_position(p.append_begin);
          as->set_append_tokens(static_cast<uint32_t>(n));
          pr.kp.push_back(absl::MakeConstSpan(static_cast<const uint8_t*>(st_.new_k) + src * kvrow_, n * kvrow_));
          pr.vp.push_back(absl::MakeConstSpan(static_cast<const uint8_t*>(st_.new_v) + src * kvrow_, n * kvrow_));
          pr.bytes += 2 * n * kvrow_;
        }
      }
      req.set_num_rows(pr.rows);
      return pr;
    }

    // A job sent with its payload beside the request (not through the
    // exchange buffer): the bytes it sends and the host buffer its reply's
    // O and LSE land in.
    void SizeHostReply(const Prepared& pr, Result& r) const {
      r.rows = pr.rows;
      r.sent = pr.bytes + pr.req.ByteSizeLong();
      r.reply.resize(size_t{pr.rows} * shape_.partial_row_bytes());
      r.received = r.reply.size();
    }

    // Where a job's partial O and LSE go in the exchange buffer.
    uint64_t OutOffset(const JobPlace& jp) const { return uint64_t{jp.part_row} * hq_ * sizeof(float); }
    uint64_t LseOffset(const JobPlace& jp) const {
      return ex_.l_base + uint64_t{jp.part_row} * shape_.q_heads * sizeof(float);
    }

    // A job's request reads its inputs from, and writes its partial into,
    // the exchange buffer.
    v1::DeviceExchange* SetDevice(v1::AttendRequest& req, const JobPlace& jp) const {
      v1::DeviceExchange* d = req.mutable_device();
      d->set_host_id(c_.host_id_);
      d->set_ipc_handle(ex_.xb.ipc_handle());
      d->set_queries_offset(jp.q);
      d->set_new_k_offset(jp.k);
      d->set_new_v_offset(jp.v);
      d->set_out_offset(OutOffset(jp));
      d->set_lse_offset(LseOffset(jp));
      if (!ex_.inputs_event.empty()) {
        d->set_inputs_ready_event(ex_.inputs_event);
        // (the merge waits for the node's work on the same stream)
        if (c_.node_events_ok_.load()) d->set_reply_when_queued(true);
      }
      return d;
    }

    // The inputs complete before the host reads them or a node that cannot
    // wait on their event is asked.
    absl::Status WaitInputs() ABSL_LOCKS_EXCLUDED(waited_mu_) {
      absl::MutexLock l(&waited_mu_);
      if (inputs_waited_) return absl::OkStatus();
      KVRING_RETURN_IF_ERROR(dx_->dev->Wait(dx_->stream));
      inputs_waited_ = true;
      return absl::OkStatus();
    }

    // A request to a node, its round trip timed into `r`.
    void TimedAttend(Result& r, Node& node, v1::AttendRequest req, const std::vector<absl::Span<const uint8_t>>& qp,
                     const std::vector<absl::Span<const uint8_t>>& kp, const std::vector<absl::Span<const uint8_t>>& vp,
                     absl::Span<uint8_t> reply) {
      const auto t = Clock::now();
      r.resp = c_.AttendOn(node, std::move(req), qp, kp, vp, reply);
      r.round_trip += Since(t);
    }

    // A job's request through the exchange buffer: the node reads and writes
    // it in place, or (a node that cannot) is sent the job's rows from it
    // and its partial goes back into it (Staged).
    Result ThroughExchange(Node& node, v1::AttendRequest req, const JobPlace& jp) {
      Result out;
      out.rows = jp.rows;
      if (node.attend_device_refused.load()) return Staged(node, std::move(req), jp, std::move(out));
      v1::DeviceExchange* d = SetDevice(req, jp);
      out.sent = req.ByteSizeLong();
      TimedAttend(out, node, req, {}, {}, {}, {});
      if (out.resp.ok() && !out.resp->device_refusal().empty() && !d->inputs_ready_event().empty()) {
        // It may refuse the event only: asked again, the inputs waited for.
        if (c_.events_ok_.exchange(false)) {
          KVRING_LOG(INFO) << "node " << node.id() << " refused the inputs' event (" << out.resp->device_refusal()
                           << "); steps on the caller's stream wait for their inputs here";
        }
        if (absl::Status w = WaitInputs(); !w.ok()) {
          out.resp = w;
          return out;
        }
        d->clear_inputs_ready_event();
        TimedAttend(out, node, req, {}, {}, {}, {});
      }
      if (!out.resp.ok() || out.resp->device_refusal().empty()) {
        out.in_place = out.resp.ok();
        return out;
      }
      if (!node.attend_device_refused.exchange(true)) {
        KVRING_LOG(INFO) << "node " << node.id() << " does not attend in this process's GPU memory ("
                         << out.resp->device_refusal() << "); its steps go through pinned staging";
      }
      req.clear_device();
      return Staged(node, std::move(req), jp, std::move(out));
    }

    // The job's rows copied from the exchange buffer through pinned staging
    // to a node that cannot read it, and its partial copied back into it.
    Result Staged(Node& node, v1::AttendRequest req, const JobPlace& jp, Result out) {
      if (absl::Status w = WaitInputs(); !w.ok()) {
        out.resp = w;
        return out;
      }
      DeviceMemory& dev = *dx_->dev;
      uint8_t* xb = ex_.xb.data();
      const size_t qb = size_t{jp.rows} * qrow_, kb = size_t{jp.app} * kvrow_;
      const size_t ob = size_t{jp.rows} * hq_ * sizeof(float), lb = size_t{jp.rows} * shape_.q_heads * sizeof(float);
      absl::StatusOr<DeviceMemory::Staging> stage = dev.Pinned(qb + 2 * kb + ob + lb);
      absl::Status s = stage.status();
      uint8_t* h = s.ok() ? stage->data() : nullptr;
      if (s.ok() && qb > 0) s = dev.ToHost(h, xb + jp.q, qb);
      if (s.ok() && kb > 0) s = dev.ToHost(h + qb, xb + jp.k, kb);
      if (s.ok() && kb > 0) s = dev.ToHost(h + qb + kb, xb + jp.v, kb);
      if (!s.ok()) {
        out.resp = s;
        return out;
      }
      std::vector<absl::Span<const uint8_t>> qp, kp, vp;
      if (qb > 0) qp.push_back(absl::MakeConstSpan(h, qb));
      if (kb > 0) {
        kp.push_back(absl::MakeConstSpan(h + qb, kb));
        vp.push_back(absl::MakeConstSpan(h + qb + kb, kb));
      }
      out.sent = qb + 2 * kb + req.ByteSizeLong();
      out.received = ob + lb;
      TimedAttend(out, node, std::move(req), qp, kp, vp, absl::MakeSpan(h + qb + 2 * kb, ob + lb));
      if (out.resp.ok() && ob > 0) {
        s = dev.ToDevice(xb + OutOffset(jp), h + qb + 2 * kb, ob);
        if (s.ok()) s = dev.ToDevice(xb + LseOffset(jp), h + qb + 2 * kb + ob, lb);
        if (!s.ok()) out.resp = s;
      }
      return out;
    }

    // Job j on `node`, waited for on this thread.
    Result Call(size_t j, Node& node) {
      Prepared& pr = prepared_[j];
      if (dx_ != nullptr) {
        Result out = ThroughExchange(node, std::move(pr.req), ex_.place[j]);
        out.rows = pr.rows;
        return out;
      }
      Result out;
      SizeHostReply(pr, out);
      TimedAttend(out, node, std::move(pr.req), pr.qp, pr.kp, pr.vp, absl::MakeSpan(out.reply));
      return out;
    }

    // Every request is sent from this thread before any reply is waited for,
    // where the carrier allows it (UCX): a fan-out to N nodes then wakes no
    // pool thread and hands each call to a progress thread once. The rest
    // (gRPC; a node that refused the exchange buffer; payloads large enough
    // that staging them is worth spreading over threads) run on the pool.
    void SendAll() {
      const size_t n = jobs_.size();
      std::vector<std::shared_ptr<Node>> nodes(n);
      std::vector<std::shared_ptr<NodeChannel>> channels(n);  // held for their calls
      std::vector<std::unique_ptr<PendingAttend>> pending(n);
      std::vector<Clock::time_point> sent_at(n);
      std::vector<size_t> waited_jobs;
      for (size_t j = 0; j < n; ++j) {
        nodes[j] = c_.NodeFor(ring_.node(jobs_[j].node).node_id());
        if (nodes[j] == nullptr || (dx_ != nullptr && nodes[j]->attend_device_refused.load())) {
          waited_jobs.push_back(j);
          continue;
        }
        Prepared& pr = prepared_[j];
        Result& r = res_[j];
        r.rows = pr.rows;
        if (dx_ == nullptr && pr.bytes > kStartedAttendMaxBytes) {
          waited_jobs.push_back(j);
          continue;
        }
        channels[j] = nodes[j]->Channel();
        sent_at[j] = Clock::now();
        if (dx_ != nullptr) {
          SetDevice(pr.req, ex_.place[j]);
          r.sent = pr.req.ByteSizeLong();
          pending[j] = channels[j]->StartAttend(pr.req, {}, {}, {}, {});
        } else {
          SizeHostReply(pr, r);
          pending[j] = channels[j]->StartAttend(pr.req, pr.qp, pr.kp, pr.vp, absl::MakeSpan(r.reply));
        }
        if (pending[j] == nullptr) waited_jobs.push_back(j);
      }
      c_.pool_.ParallelFor(waited_jobs.size(), [&](size_t i) {
        const size_t j = waited_jobs[i];
        res_[j] = nodes[j] ? Call(j, *nodes[j]) : Result{absl::UnavailableError("unknown node")};
      });
      for (size_t j = 0; j < n; ++j) {
        if (pending[j] == nullptr) continue;
        Result& r = res_[j];
        r.resp = pending[j]->Wait();
        r.round_trip += Since(sent_at[j]);
        pending[j].reset();
        if (dx_ != nullptr && r.resp.ok() && !r.resp->device_refusal().empty()) {
          // The exchange buffer (or only the inputs' event) refused: the
          // waited path asks again the way this node can be served.
          res_[j] = Call(j, *nodes[j]);
          continue;
        }
        r.in_place = dx_ != nullptr && r.resp.ok();
      }
    }

    // Nodes that answered once their work was queued on their GPU: the
    // stream waits for it now, before anything later on it (the merge, the
    // caller's next kernels, the exchange buffer's next user) and whatever
    // this round returns.
    absl::Status WaitQueuedNodes() {
      for (const Result& r : res_) {
        if (!r.in_place || !r.resp.ok() || r.resp->done_event().empty()) continue;
        ++k_.rep->shards_replied_queued;
        if (absl::Status w = dx_->dev->WaitNodeEvent(r.resp->done_event(), dx_->stream); !w.ok()) {
          c_.node_events_ok_ = false;  // not asked for again
          ex_.xb.Drop();               // its node may still write into it
          return absl::InternalError(
              absl::StrCat("a node answered before its work was done and its event cannot be "
                           "waited for here (",
                           w.message(), "); later steps wait for the nodes' work"));
        }
      }
      return absl::OkStatus();
    }

    // f(u) for each append unit of sequence `seq` that [begin, end) overlaps.
    template <typename F>
    void ForUnits(size_t seq, uint64_t begin, uint64_t end, F f) {
      for (AppendUnit& u : k_.units) {
        if (u.seq == seq && u.begin < end && begin < u.end) f(u);
      }
    }

    // Job j's outcome: acks, refusals and retries, its partials merged on
    // the host or listed in `contrib` for the device merge, the report.
    absl::Status Collect(size_t j, std::vector<std::vector<int32_t>>& contrib) {
      const NodeJob& job = jobs_[j];
      if (!res_[j].resp.ok()) return CollectFailed(j, res_[j].resp.status());
      const v1::AttendResponse& r = *res_[j].resp;
      if (r.sequence_status_size() != 0 && r.sequence_status_size() != static_cast<int>(job.parts.size())) {
        return absl::DataLossError("Attend reply has the wrong number of sequence statuses");
      }
      std::vector<bool> served(job.parts.size(), true);
      for (size_t k = 0; k < job.parts.size(); ++k) {
        const absl::Status ps =
            r.sequence_status_size() ? StatusOf(r.sequence_status(static_cast<int>(k))) : absl::OkStatus();
        if (!ps.ok()) served[k] = false;
        KVRING_RETURN_IF_ERROR(CollectPart(job, job.parts[k], ps));
      }
      if (res_[j].rows == 0) return absl::OkStatus();  // appends only: no partial, not a shard of the attention
      KVRING_RETURN_IF_ERROR(MergePartials(j, served, contrib));
      Account(j);
      return absl::OkStatus();
    }

    // A node that failed or refused the whole request: its appends are not
    // acked; a refusal (it lacks blocks or tokens: NOT_FOUND, DATA_LOSS with
    // the first missing position; an append it cannot take:
    // FAILED_PRECONDITION) or its failure sends the chunks to the next
    // replica; anything else is the round's error.
    absl::Status CollectFailed(size_t j, const absl::Status& s) {
      const NodeJob& job = jobs_[j];
      *k_.last_error = s;
      for (const SeqPart& p : job.parts) {
        ForUnits(p.seq, p.append_begin, p.append_end, [&](AppendUnit& u) {
          u.last = s;
          if (absl::IsDataLoss(s)) u.missing_on.push_back(job.node);
        });
      }
      const bool refusal = absl::IsNotFound(s) || absl::IsFailedPrecondition(s) || absl::IsDataLoss(s);
      if (!IsNodeFailure(s) && !refusal) return s;
      if ((absl::IsFailedPrecondition(s) || absl::IsDataLoss(s)) && k_.failed == nullptr) return s;
      if (k_.failed == nullptr) return absl::OkStatus();
      for (const SeqPart& p : job.parts) {
        for (uint64_t c : p.chunks) {
          k_.failed->push_back(
              FailedChunk{p.seq, c, false, absl::StrCat(ring_.node(job.node).node_id(), ": ", s.ToString()), s.code()});
        }
      }
      return absl::OkStatus();
    }

    // One sequence of a request the node answered: its appends acked, or
    // (ps not OK: the node did not serve the sequence) not acked here and
    // its chunks retried.
    absl::Status CollectPart(const NodeJob& job, const SeqPart& p, const absl::Status& ps) {
      if (ps.ok()) {
        ForUnits(p.seq, p.append_begin, p.append_end, [&](AppendUnit& u) {
          ++u.acks;
          u.acked_on.push_back(job.node);
        });
        return absl::OkStatus();
      }
      *k_.last_error = ps;
      ForUnits(p.seq, p.append_begin, p.append_end, [&](AppendUnit& u) {
        u.last = ps;
        if (absl::IsDataLoss(ps)) u.missing_on.push_back(job.node);
      });
      if (!absl::IsNotFound(ps) && !absl::IsFailedPrecondition(ps) && !absl::IsDataLoss(ps)) return ps;
      // A refused append (a replica behind on another chunk's tail, or
      // missing tokens before it: DATA_LOSS) also refuses the attends beside
      // it: those are retried on this node without the append first. The
      // append counts its acks; short of the write quorum, the step fails
      // with this refusal (for DATA_LOSS: the first missing position).
      const bool again_here = (absl::IsFailedPrecondition(ps) || absl::IsDataLoss(ps)) && p.append_end > p.append_begin;
      for (uint64_t c : p.chunks) {
        if (k_.failed == nullptr) return ps;
        k_.failed->push_back(FailedChunk{p.seq, c, again_here,
                                         absl::StrCat(ring_.node(job.node).node_id(), ": ", ps.ToString()), ps.code()});
      }
      return absl::OkStatus();
    }

    // Job j's partial rows of the sequences it served: merged into the
    // output here, or (the exchange buffer) listed per output row.
    absl::Status MergePartials(size_t j, const std::vector<bool>& served, std::vector<std::vector<int32_t>>& contrib) {
      const Result& res = res_[j];
      const v1::AttendResponse& r = *res.resp;
      if (r.num_rows() != res.rows || r.q_heads() != shape_.q_heads || r.head_dim() != shape_.head_dim) {
        return absl::DataLossError("Attend reply has the wrong shape");
      }
      const float* po = reinterpret_cast<const float*>(res.reply.data());
      const float* pl = po + size_t{res.rows} * hq_;
      uint32_t off = 0;
      for (size_t k = 0; k < jobs_[j].parts.size(); ++k) {
        const SeqPart& p = jobs_[j].parts[k];
        if (p.chunks.empty()) continue;
        const uint32_t n = st_.sequences[p.seq].rows, r0 = sh_.row_begin[p.seq];
        if (served[k] && dx_ != nullptr) {  // merged on the device (MergeOnDevice)
          for (uint32_t i = 0; i < n; ++i) {
            contrib[r0 + i].push_back(static_cast<int32_t>(ex_.place[j].part_row + off + i));
          }
        } else if (served[k]) {
          MergeInto(PartialOutput{k_.out.out + size_t{r0} * hq_, k_.out.lse + size_t{r0} * shape_.q_heads},
                    ConstPartial{po + size_t{off} * hq_, pl + size_t{off} * shape_.q_heads}, n, shape_.q_heads,
                    shape_.head_dim);
        }
        off += n;
      }
      return absl::OkStatus();
    }

    // Job j in the step's report (the slowest shard's round trip and its
    // transport).
    void Account(size_t j) {
      const Result& res = res_[j];
      const v1::AttendResponse& r = *res.resp;
      AttendReport* rep = k_.rep;
      ++rep->shards;
      if (res.in_place) ++rep->shards_in_place;
      rep->blocks += r.blocks_used();
      rep->bytes_sent += res.sent;
      rep->bytes_received += r.ByteSizeLong() + res.received;
      rep->node_seconds = std::max(rep->node_seconds, r.compute_seconds());
      if (res.round_trip > rep->round_trip_seconds) {
        rep->round_trip_seconds = res.round_trip;
        // (the node's handling where it says, else its compute time)
        const double node_s = r.handler_seconds() > 0 ? r.handler_seconds() : r.compute_seconds();
        rep->transport_seconds = std::max(0.0, res.round_trip - node_s);
      }
      rep->kernel_seconds = std::max(rep->kernel_seconds, r.kernel_seconds());
      rep->copy_seconds = std::max(rep->copy_seconds, r.copy_seconds());
    }

    // One launch merges every partial of the round into the output (the
    // step's first also writes the rows nothing reached: O = 0, LSE = -inf).
    absl::Status MergeOnDevice(const std::vector<std::vector<int32_t>>& contrib) {
      uint32_t round_rows = 0;
      for (const JobPlace& jp : ex_.place) round_rows += jp.rows;
      if (dx_ == nullptr || round_rows == 0) return absl::OkStatus();
      std::vector<int32_t> csr(size_t{shape_.num_rows} + 1);
      for (uint32_t r = 0; r < shape_.num_rows; ++r) csr[r + 1] = csr[r] + static_cast<int32_t>(contrib[r].size());
      for (const auto& c : contrib) csr.insert(csr.end(), c.begin(), c.end());
      DeviceMemory& dev = *dx_->dev;
      uint8_t* xb = ex_.xb.data();
      // (The indexes travel in the merge's launch; a large set goes through
      // the buffer's csr area.)
      KVRING_RETURN_IF_ERROR(dev.MergeRows(
          k_.out.out, k_.out.lse, shape_.num_rows, reinterpret_cast<const float*>(xb),
          reinterpret_cast<const float*>(xb + ex_.l_base), csr, reinterpret_cast<int32_t*>(xb + ex_.csr_off),
          shape_.q_heads, shape_.head_dim, !dx_->initialized, st_.out_cast, st_.out_cast_dtype, dx_->stream));
      // (On the caller's stream, the buffers go back to their pools marked in
      // use until the stream has passed the merge.)
      if (!dx_->stream_ordered) KVRING_RETURN_IF_ERROR(dev.Wait(dx_->stream));
      dx_->initialized = true;
      return absl::OkStatus();
    }

    ClientImpl& c_;
    const PlannedStep& sh_;
    const AttendStep& st_;
    const QueryTensor& q_;
    const StepShape& shape_;  // q_'s and the options
    const ShardRing& ring_;
    const std::vector<NodeJob>& jobs_;
    const RoundSink k_;
    DeviceStep* const dx_;
    const size_t qrow_, kvrow_, hq_;  // bytes of a query row and a K/V row; floats of an output row
    ExchangeStage ex_;
    std::vector<Prepared> prepared_;
    std::vector<Result> res_;
    absl::Mutex waited_mu_;
    bool inputs_waited_ ABSL_GUARDED_BY(waited_mu_) = true;
  };

  absl::Status RunJobs(const PlannedStep& sh, const ShardRing& ring, const std::vector<NodeJob>& jobs, RoundSink k) {
    StepRound round(*this, sh, ring, jobs, k);
    return round.Run();
  }

  // The nodes of `ring` marked UP (the lifecycle calls go to each of them).
  static std::vector<int> UpNodes(const ShardRing& ring) {
    std::vector<int> nodes;
    for (int i = 0; i < ring.num_nodes(); ++i) {
      if (ring.node(i).state() == v1::NodeInfo::UP) nodes.push_back(i);
    }
    return nodes;
  }

  absl::StatusOr<SequenceChangeReport> ChangeSequence(const std::string& id, bool truncate, uint64_t tokens) {
    KVRING_RETURN_IF_ERROR(ValidateSequenceId(id));
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

  // The caller's sequences (or `ids`) on every UP node, merged by id. With
  // `tolerant`, nodes that do not answer are left out (an error only when
  // none answered).
  absl::StatusOr<std::vector<SequenceListing>> ListSequences(absl::Span<const std::string> ids, bool tolerant = false) {
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

  // Learns the placement of each of `ids` from the nodes (every node records
  // a fork's).
  absl::Status ResolvePlacements(absl::Span<const std::string> ids) {
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

  static absl::StatusOr<SequencePlacement> PlacementOf(const SequenceListing& l) {
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

  absl::StatusOr<PrefixStartReport> StartFromPrefix(const std::string& id, const BlockLayout& L,
                                                    absl::Span<const BlockKey> chain) {
    KVRING_RETURN_IF_ERROR(ValidateSequenceId(id));
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
        return undo(absl::Status(
            got[k].status.code(),
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

  absl::StatusOr<ForkReport> ForkSequence(const std::string& source, const std::string& id, uint64_t tokens) {
    KVRING_RETURN_IF_ERROR(ValidateSequenceId(source));
    KVRING_RETURN_IF_ERROR(ValidateSequenceId(id));
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

  std::vector<NodeStats> Stats() {
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

  absl::Status PinBlocks(absl::Span<const BlockKey> keys, bool unpin) {
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

  std::atomic<size_t> last_block_bytes_{0};
  const std::string host_id_ = HostBootId().value_or("");  // for same-host delivery ("": never asked)
  // Steps on the caller's stream hand nodes an event to wait on (false once
  // this device or a node cannot: then the client waits for the inputs).
  std::atomic<bool> events_ok_{true};
  // Nodes may answer steps on the caller's stream once their work is queued
  // (DeviceExchange.reply_when_queued); false once a node's event could not
  // be waited for here.
  std::atomic<bool> node_events_ok_{true};
  absl::Mutex dev_mu_;
  std::unique_ptr<DeviceMemory> dev_ ABSL_GUARDED_BY(dev_mu_);
  ClientOptions o_;
  const std::string quantize_wire_;  // PutRequest.quantize: o_.quantize spelled for the wire
  std::shared_ptr<grpc::ChannelCredentials> creds_;
  v1::Tenant tenant_;
  std::string ns_;
  NamespaceId ns_id_ = 0;
  std::unique_ptr<CoordinatorChannel> coord_;
  ThreadPool pool_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const ShardRing> ring_ ABSL_GUARDED_BY(mu_);
  absl::Time last_refresh_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Node>> nodes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, absl::Time> suspect_until_ ABSL_GUARDED_BY(mu_);
  SequencePlacements placements_;  // the forks this client knows
  ChunkRoutes routes_;             // the nodes of the chunks of the sequences this client steps
};

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
