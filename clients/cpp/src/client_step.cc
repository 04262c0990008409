// ClientImpl's attention steps: the step checked and planned (Route: rows,
// chunks and their nodes, appends per replica), run in rounds (RunRounds,
// StepRound: one request per node and job, retries on the next replica,
// partials merged on the host or in the exchange buffer on the device), and
// the appends settled (repair of a replica that lacks the tokens before an
// append, then the write quorum).
#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client_impl.h"
#include "kvring/attention/merge.h"
#include "kvring/common/logging.h"
#include "kvring/common/status_macros.h"
#include "kvring/layout/token_rows.h"

namespace kvring {
namespace {
using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// An Attend whose payload (queries and appended K/V in host memory) is
// larger than this is sent from a pool thread, so that the fan-out's
// staging copies run in parallel; smaller ones (decode steps) are all sent
// from the caller's thread.
constexpr uint64_t kStartedAttendMaxBytes = 256 << 10;
}  // namespace

absl::Status ClientImpl::StepInto(const AttendStep& in, PartialOutput out, AttendReport* report) {
  if (DetachedRounds* d = Detached(); d != nullptr) KVRING_RETURN_IF_ERROR(d->TakeError());
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
                                          shape.q_heads, shape.head_dim, /*init=*/false, in.out_cast, in.out_cast_dtype,
                                          stream));
  }
  if (in.stream_ordered) {
    stage.UseOn(stream);  // (not reused before the copies out of it are done)
    return absl::OkStatus();
  }
  return dev->Wait(stream);  // (the staging goes back to the pool on return)
}

absl::Status ClientImpl::StepOnHost(const AttendStep& st, PartialOutput out, AttendReport* report, DeviceStep* dx) {
  absl::Status s = StepRouted(st, out, report, dx);
  if (!absl::IsAborted(s)) return s;
  std::vector<std::string> ids;
  for (const auto& q : st.sequences) ids.push_back(q.sequence_id);
  KVRING_RETURN_IF_ERROR(ResolvePlacements(ids));
  if (dx != nullptr) dx->initialized = false;
  return StepRouted(st, out, report, dx);
}

absl::Status ClientImpl::CopyReplica(const ShardRing& ring, int from, int to, const std::string& id,
                                     const BlockLayout& L, uint64_t b0, uint64_t b1, uint64_t digest) {
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

StepShape ClientImpl::ShapeOf(const AttendStep& st) {
  return StepShape{st.options, st.q.num_rows, st.q.q_heads, st.q.head_dim, st.q.dtype};
}

absl::Status ClientImpl::CheckStep(const AttendStep& st) {
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

ClientImpl::RoutedStep ClientImpl::Route(const std::shared_ptr<const ShardRing>& ring, const AttendStep& st) {
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

absl::Status ClientImpl::StepRouted(const AttendStep& st, PartialOutput out, AttendReport* report, DeviceStep* dx) {
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

absl::Status ClientImpl::RunRounds(const ShardRing& ring, const AttendStep& st, RoutedStep& rs, PartialOutput out,
                                   DeviceStep* dx, AttendReport* rep) {
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

absl::Status ClientImpl::NoReplicaLeft(const std::string& id, uint64_t chunk, const std::vector<FailedChunk>& tried) {
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

absl::Status ClientImpl::SettleAppends(const ShardRing& ring, const AttendStep& st, RoutedStep& rs, AttendReport* rep) {
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

uint64_t ClientImpl::PlaceJobs(const PlannedStep& sh, const std::vector<NodeJob>& jobs, ExchangeStage* ex) {
  const AttendStep& st = sh.st;
  const StepShape& shape = sh.shape;
  const size_t qrow = shape.query_row_bytes(), kvrow = st.layout.kv_row_bytes(), hq = shape.row_elems();
  std::vector<JobPlace>& place = ex->place;
  std::vector<int>& same_rows_as = ex->same_rows_as;
  uint64_t& l_base = ex->l_base;
  auto align = [](uint64_t n) { return (n + kDeviceExchangeAlign - 1) / kDeviceExchangeAlign * kDeviceExchangeAlign; };
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
  off += (uint64_t{shape.num_rows} + 1 + part_rows) * sizeof(int32_t);
  ex->flags_off = align(off);
  return ex->flags_off + jobs.size() * sizeof(uint32_t);
}

absl::Status ClientImpl::CopyIntoExchange(const PlannedStep& sh, const std::vector<NodeJob>& jobs, DeviceStep* dx,
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

absl::Status ClientImpl::StageExchange(const PlannedStep& sh, const std::vector<NodeJob>& jobs, DeviceStep* dx,
                                       ExchangeStage* ex) {
  const uint64_t bytes = PlaceJobs(sh, jobs, ex);
  ex->flag_base = next_flag_.fetch_add(static_cast<uint32_t>(jobs.size()));
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

class ClientImpl::StepRound {
 public:
  StepRound(ClientImpl& c, const PlannedStep& sh, const ShardRing& ring, const std::vector<NodeJob>& jobs, RoundSink k)
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
    StartAll();
    if (DetachedRounds* d = Detachable(); d != nullptr) return Detach(*d);
    FinishAll();
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
  v1::DeviceExchange* SetDevice(v1::AttendRequest& req, size_t j) const {
    const JobPlace& jp = ex_.place[j];
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
      // Early answers only by the word: waiting on another process's event
      // cost the engine more than it saved (docs/MPS.md). (The node sets the
      // job's word when done; one that cannot answers with an event.)
      if (c_.node_events_ok_.load() && dx_->dev->WaitsOnWords()) {
        d->set_reply_when_queued(true);
        d->set_done_flag_offset(ex_.flags_off + j * sizeof(uint32_t));
        d->set_done_flag_value(FlagValue(j));
      }
    }
    return d;
  }

  // The value job j's node sets its done flag to.
  uint32_t FlagValue(size_t j) const {
    const uint32_t v = ex_.flag_base + static_cast<uint32_t>(j);
    return v == 0 ? 1 : v;
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
  Result ThroughExchange(Node& node, v1::AttendRequest req, size_t j) {
    const JobPlace& jp = ex_.place[j];
    Result out;
    out.rows = jp.rows;
    if (node.attend_device_refused.load()) return Staged(node, std::move(req), jp, std::move(out));
    v1::DeviceExchange* d = SetDevice(req, j);
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
      Result out = ThroughExchange(node, std::move(pr.req), j);
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
  // that staging them is worth spreading over threads) run on the pool
  // (FinishAll).
  void StartAll() {
    const size_t n = jobs_.size();
    nodes_.assign(n, nullptr);
    channels_.assign(n, nullptr);
    pending_.clear();
    pending_.resize(n);
    sent_at_.assign(n, Clock::time_point());
    waited_jobs_.clear();
    for (size_t j = 0; j < n; ++j) {
      nodes_[j] = c_.NodeFor(ring_.node(jobs_[j].node).node_id());
      if (nodes_[j] == nullptr || (dx_ != nullptr && nodes_[j]->attend_device_refused.load())) {
        waited_jobs_.push_back(j);
        continue;
      }
      Prepared& pr = prepared_[j];
      Result& r = res_[j];
      r.rows = pr.rows;
      if (dx_ == nullptr && pr.bytes > kStartedAttendMaxBytes) {
        waited_jobs_.push_back(j);
        continue;
      }
      channels_[j] = nodes_[j]->Channel();
      sent_at_[j] = Clock::now();
      if (dx_ != nullptr) {
        SetDevice(pr.req, j);
        r.sent = pr.req.ByteSizeLong();
        pending_[j] = channels_[j]->StartAttend(pr.req, {}, {}, {}, {});
      } else {
        SizeHostReply(pr, r);
        pending_[j] = channels_[j]->StartAttend(pr.req, pr.qp, pr.kp, pr.vp, absl::MakeSpan(r.reply));
      }
      if (pending_[j] == nullptr) waited_jobs_.push_back(j);
    }
  }

  // The jobs StartAll could not start, run on the pool, and every reply.
  void FinishAll() {
    c_.pool_.ParallelFor(waited_jobs_.size(), [&](size_t i) {
      const size_t j = waited_jobs_[i];
      res_[j] = nodes_[j] ? Call(j, *nodes_[j]) : Result{absl::UnavailableError("unknown node")};
    });
    for (size_t j = 0; j < jobs_.size(); ++j) {
      if (pending_[j] == nullptr) continue;
      Result& r = res_[j];
      r.resp = pending_[j]->Wait();
      r.round_trip += Since(sent_at_[j]);
      pending_[j].reset();
      if (dx_ != nullptr && r.resp.ok() && !r.resp->device_refusal().empty()) {
        // The exchange buffer (or only the inputs' event) refused: the
        // waited path asks again the way this node can be served.
        res_[j] = Call(j, *nodes_[j]);
        continue;
      }
      r.in_place = dx_ != nullptr && r.resp.ok();
    }
    channels_.clear();
  }

  // Whether the round goes on without its replies
  // (ClientOptions::detach_device_steps): a step's attend round (one that
  // may retry: not a two-phase step's appends) on the caller's stream,
  // every job sent through the exchange buffer with its word, each of at
  // most kMaxDetachedRows rows and appended tokens. The client's collector
  // when it does, else null.
  DetachedRounds* Detachable() const {
    if (dx_ == nullptr || !dx_->stream_ordered || k_.failed == nullptr || !waited_jobs_.empty()) return nullptr;
    if (ex_.inputs_event.empty() || !c_.node_events_ok_.load() || !dx_->dev->WaitsOnWords()) return nullptr;
    for (size_t j = 0; j < jobs_.size(); ++j) {
      if (pending_[j] == nullptr || ex_.place[j].rows > kMaxDetachedRows || ex_.place[j].app > kMaxDetachedRows) {
        return nullptr;
      }
    }
    return c_.Detached();
  }

  // The round without its replies: every append counted as acknowledged,
  // the stream's waits on every job's word and the merge of the partials
  // the plan expects queued now; the replies go to the client's collector
  // (DetachedRounds), which sets the word of a job whose node did not and
  // keeps a failure for the next call.
  absl::Status Detach(DetachedRounds& collector) {
    DetachedRounds::Round round;
    round.stream = dx_->stream;
    round.what = absl::StrCat("layer ", shape_.options.layer, " of sequence '",
                              st_.sequences.empty() ? "" : st_.sequences[0].sequence_id, "'",
                              st_.sequences.size() > 1 ? absl::StrCat(" and ", st_.sequences.size() - 1, " more") : "");
    std::vector<std::vector<int32_t>> contrib(shape_.num_rows);
    for (size_t j = 0; j < jobs_.size(); ++j) {
      const NodeJob& job = jobs_[j];
      DetachedRounds::Job dj;
      dj.pending = std::move(pending_[j]);
      dj.channel = std::move(channels_[j]);
      dj.node_id = ring_.node(job.node).node_id();
      dj.sequences = static_cast<int>(job.parts.size());
      dj.word = ex_.xb.data() + ex_.flags_off + j * sizeof(uint32_t);
      dj.value = FlagValue(j);
      round.jobs.push_back(std::move(dj));
      for (const SeqPart& p : job.parts) {
        (void)CollectPart(job, p, absl::OkStatus());  // (acknowledged: a failure comes back later)
      }
      ForPartialRows(j, [&](size_t, uint32_t r0, uint32_t n, uint32_t off) { ListOnDevice(j, r0, n, off, contrib); });
      AttendReport* rep = k_.rep;
      if (res_[j].rows > 0) {
        ++rep->shards;
        ++rep->shards_in_place;
      }
      ++rep->shards_detached;
      rep->bytes_sent += res_[j].sent;
    }
    k_.rep->inputs_waited_on_device = true;  // (the nodes wait on the inputs' event)
    absl::Status s;
    for (size_t j = 0; j < round.jobs.size() && s.ok(); ++j) {
      s = dx_->dev->WaitWord(round.jobs[j].word, round.jobs[j].value, dx_->stream);
    }
    if (s.ok()) s = MergeOnDevice(contrib);
    round.xb = std::move(ex_.xb);
    // (Handed over also when the waits or the merge could not be queued: the
    // collector still sets the words and drops the buffer where needed.)
    collector.Add(std::move(round));
    return s;
  }

  // Nodes that answered once their work was queued on their GPU: the
  // stream waits for it now, before anything later on it (the merge, the
  // caller's next kernels, the exchange buffer's next user) and whatever
  // this round returns.
  absl::Status WaitQueuedNodes() {
    for (size_t j = 0; j < res_.size(); ++j) {
      const Result& r = res_[j];
      if (!r.in_place || !r.resp.ok()) continue;
      const bool by_flag = r.resp->done_flag();
      if (!by_flag && r.resp->done_event().empty()) continue;
      ++k_.rep->shards_replied_queued;
      k_.rep->shards_done_by_flag += by_flag ? 1 : 0;
      const absl::Status w =
          by_flag ? dx_->dev->WaitWord(ex_.xb.data() + ex_.flags_off + j * sizeof(uint32_t), FlagValue(j), dx_->stream)
                  : dx_->dev->WaitNodeEvent(r.resp->done_event(), dx_->stream);
      if (!w.ok()) {
        c_.node_events_ok_ = false;  // not asked for again
        ex_.xb.Drop();               // its node may still write into it
        return absl::InternalError(absl::StrCat("a node answered before its work was done and its ",
                                                by_flag ? "done flag" : "event", " cannot be waited for here (",
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
    ForPartialRows(j, [&](size_t k, uint32_t r0, uint32_t n, uint32_t off) {
      if (served[k] && dx_ != nullptr) {  // merged on the device (MergeOnDevice)
        ListOnDevice(j, r0, n, off, contrib);
      } else if (served[k]) {
        MergeInto(PartialOutput{k_.out.out + size_t{r0} * hq_, k_.out.lse + size_t{r0} * shape_.q_heads},
                  ConstPartial{po + size_t{off} * hq_, pl + size_t{off} * shape_.q_heads}, n, shape_.q_heads,
                  shape_.head_dim);
      }
    });
    return absl::OkStatus();
  }

  // f(k, r0, n, off) for each part k of job j that attends: its rows are the
  // step's rows [r0, r0 + n) and the job's partial rows [off, off + n).
  template <typename F>
  void ForPartialRows(size_t j, F f) const {
    uint32_t off = 0;
    for (size_t k = 0; k < jobs_[j].parts.size(); ++k) {
      const SeqPart& p = jobs_[j].parts[k];
      if (p.chunks.empty()) continue;
      const uint32_t n = st_.sequences[p.seq].rows;
      f(k, sh_.row_begin[p.seq], n, off);
      off += n;
    }
  }

  // Job j's partial rows [off, off + n) listed for the step's rows
  // [r0, r0 + n) in the device merge (by their rows in the exchange buffer).
  void ListOnDevice(size_t j, uint32_t r0, uint32_t n, uint32_t off, std::vector<std::vector<int32_t>>& contrib) const {
    for (uint32_t i = 0; i < n; ++i) {
      contrib[r0 + i].push_back(static_cast<int32_t>(ex_.place[j].part_row + off + i));
    }
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
    KVRING_RETURN_IF_ERROR(dev.MergeRows(k_.out.out, k_.out.lse, shape_.num_rows, reinterpret_cast<const float*>(xb),
                                         reinterpret_cast<const float*>(xb + ex_.l_base), csr,
                                         reinterpret_cast<int32_t*>(xb + ex_.csr_off), shape_.q_heads, shape_.head_dim,
                                         !dx_->initialized, st_.out_cast, st_.out_cast_dtype, dx_->stream));
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
  // StartAll's: each job's node, channel (held for its call), pending call
  // (null: run on the pool) and when it was sent; the jobs left to the pool.
  std::vector<std::shared_ptr<Node>> nodes_;
  std::vector<std::shared_ptr<NodeChannel>> channels_;
  std::vector<std::unique_ptr<PendingAttend>> pending_;
  std::vector<Clock::time_point> sent_at_;
  std::vector<size_t> waited_jobs_;
  absl::Mutex waited_mu_;
  bool inputs_waited_ ABSL_GUARDED_BY(waited_mu_) = true;
};

absl::Status ClientImpl::RunJobs(const PlannedStep& sh, const ShardRing& ring, const std::vector<NodeJob>& jobs,
                                 RoundSink k) {
  StepRound round(*this, sh, ring, jobs, k);
  return round.Run();
}

}  // namespace kvring
