#include "kvring/attention/ring/ring.h"

#include <array>
#include <chrono>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kvring/attention/merge.h"
#include "kvring/attention/partial_attention.h"
#include "kvring/common/status_macros.h"
#include "ring_messages.h"

namespace kvring {
namespace {

using ring_internal::DecodedKv;
using Clock = std::chrono::steady_clock;
using Record = std::array<uint64_t, 3>;

enum Kind : uint64_t {
  kSizes = 1,
  kQRing = 2,
  kKvRing = 3,
  kPartialBack = 4,
  kQAll = 5,
  kAppendSize = 6,
  kAppendK = 7,
  kAppendV = 8
};

uint64_t Tag(const RingOptions& r, Kind k, uint32_t step) {
  return (static_cast<uint64_t>(r.call_id) << 32) | (static_cast<uint64_t>(k) << 24) | (step & 0xffffffu);
}

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Tracks time blocked on the transport.
class Waiter {
 public:
  Waiter(const RingOptions& r, RingStats* st) : r_(r), st_(st) {}
  absl::StatusOr<size_t> Wait(TransportRequest& req) {
    const auto t0 = Clock::now();
    auto res = req.Wait(r_.timeout);
    if (st_) st_->wait_seconds += Seconds(t0, Clock::now());
    return res;
  }
  absl::Status WaitAll(std::vector<std::unique_ptr<TransportRequest>>& reqs) {
    absl::Status first = absl::OkStatus();
    for (auto& q : reqs) {
      if (!q) continue;
      auto r = Wait(*q);
      if (!r.ok() && first.ok()) first = r.status();
    }
    reqs.clear();
    return first;
  }

 private:
  const RingOptions& r_;
  RingStats* st_;
};

absl::StatusOr<std::unique_ptr<TransportRequest>> Send(Transport& t, int peer, uint64_t tag,
                                                       absl::Span<const uint8_t> d, RingStats* st) {
  if (st) {
    st->bytes_sent += d.size();
    ++st->hops;
  }
  return t.Isend(peer, tag, d);
}

// Every rank's record, by rank.
absl::StatusOr<std::vector<Record>> AllGather(Transport& t, const RingOptions& r, const Record& mine, RingStats* st) {
  const int n = t.size(), me = t.rank();
  std::vector<Record> all(n);
  all[me] = mine;
  std::vector<std::unique_ptr<TransportRequest>> reqs;
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    KVRING_ASSIGN_OR_RETURN(
        auto rq,
        t.Irecv(p, Tag(r, kSizes, 0), absl::MakeSpan(reinterpret_cast<uint8_t*>(all[p].data()), sizeof(Record))));
    reqs.push_back(std::move(rq));
    KVRING_ASSIGN_OR_RETURN(
        auto sq, Send(t, p, Tag(r, kSizes, 0),
                      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(mine.data()), sizeof(Record)), st));
    reqs.push_back(std::move(sq));
  }
  KVRING_RETURN_IF_ERROR(t.Flush());
  Waiter w(r, st);
  KVRING_RETURN_IF_ERROR(w.WaitAll(reqs));
  return all;
}

// Partial attention of `q` over `kv`, timed into stats.
absl::Status Compute(const AttentionOptions& o, const QueryTensor& q, const PagedKv& kv, uint32_t q_heads,
                     uint32_t head_dim, PartialResult* res, const RingOptions& r, RingStats* st) {
  const auto t0 = Clock::now();
  *res = PartialResult(q.num_rows, q_heads, head_dim);
  absl::Status s = absl::OkStatus();
  if (q.num_rows > 0) s = PartialAttention(o, q, kv, res->view(), r.pool);
  if (st) st->compute_seconds += Seconds(t0, Clock::now());
  return s;
}

void Finish(Clock::time_point start, RingStats* st) {
  if (st) st->total_seconds = Seconds(start, Clock::now());
}

void CopyOut(const PartialResult& p, PartialOutput out) {
  if (!p.out.empty()) std::memcpy(out.out, p.out.data(), 4 * p.out.size());
  if (!p.lse.empty()) std::memcpy(out.lse, p.lse.data(), 4 * p.lse.size());
}

// Returns partials computed here for other ranks' queries and merges the
// ones computed elsewhere for ours into `out`.
absl::Status ReturnAndMergePartials(Transport& t, const RingOptions& r, const QueryTensor& local_q,
                                    std::vector<PartialResult>& partial_for, PartialOutput out, RingStats* st) {
  const int n = t.size(), me = t.rank();
  std::vector<std::vector<uint8_t>> send(n), recv(n);
  std::vector<std::unique_ptr<TransportRequest>> reqs;
  const size_t my_bytes = ring_internal::PartialBytes(local_q.num_rows, local_q.q_heads, local_q.head_dim);
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    recv[p].resize(my_bytes);
    KVRING_ASSIGN_OR_RETURN(auto rq, t.Irecv(p, Tag(r, kPartialBack, 0), absl::MakeSpan(recv[p])));
    reqs.push_back(std::move(rq));
  }
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    ring_internal::EncodePartial(partial_for[p], &send[p]);
    KVRING_ASSIGN_OR_RETURN(auto sq, Send(t, p, Tag(r, kPartialBack, 0), send[p], st));
    reqs.push_back(std::move(sq));
  }
  KVRING_RETURN_IF_ERROR(t.Flush());
  Waiter w(r, st);
  KVRING_RETURN_IF_ERROR(w.WaitAll(reqs));
  const auto t0 = Clock::now();
  std::vector<ConstPartial> parts{partial_for[me].cview()};
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    KVRING_ASSIGN_OR_RETURN(ConstPartial c,
                            ring_internal::DecodePartial(recv[p], local_q.num_rows, local_q.q_heads, local_q.head_dim));
    parts.push_back(c);
  }
  absl::Status s = absl::OkStatus();
  if (local_q.num_rows > 0) s = MergePartials(parts, local_q.num_rows, local_q.q_heads, local_q.head_dim, out);
  if (st) st->compute_seconds += Seconds(t0, Clock::now());
  return s;
}

}  // namespace

absl::Status RingPassKv(Transport& t, const AttentionOptions& o, const QueryTensor& local_q, const PagedKv& local_kv,
                        PartialOutput out, const RingOptions& r, RingStats* st) {
  const auto start = Clock::now();
  const int n = t.size(), me = t.rank();
  KVRING_ASSIGN_OR_RETURN(std::vector<Record> rec,
                          AllGather(t, r, Record{local_q.num_rows, 0, ring_internal::KvChunkBytes(local_kv)}, st));
  std::vector<uint8_t> buf[2];
  ring_internal::EncodeKvChunk(local_kv, &buf[0]);
  PartialResult acc, part;
  Waiter w(r, st);
  int cur = 0;
  const int next = (me + 1) % n, prev = (me - 1 + n) % n;
  for (int s = 0; s < n; ++s) {
    std::vector<std::unique_ptr<TransportRequest>> reqs;
    if (s < n - 1) {
      const int src_owner = (me - s - 1 + 2 * n) % n;  // whose chunk arrives next
      buf[1 - cur].resize(rec[src_owner][2]);
      KVRING_ASSIGN_OR_RETURN(auto rq, t.Irecv(prev, Tag(r, kKvRing, s), absl::MakeSpan(buf[1 - cur])));
      reqs.push_back(std::move(rq));
      KVRING_ASSIGN_OR_RETURN(auto sq, Send(t, next, Tag(r, kKvRing, s), buf[cur], st));
      reqs.push_back(std::move(sq));
      KVRING_RETURN_IF_ERROR(t.Flush());
    }
    // Compute on the chunk in hand while the next one moves.
    DecodedKv decoded;
    const PagedKv* kv = &local_kv;
    if (s > 0) {
      KVRING_RETURN_IF_ERROR(ring_internal::DecodeKvChunk(buf[cur], &decoded));
      kv = &decoded.view;
    }
    KVRING_RETURN_IF_ERROR(Compute(o, local_q, *kv, local_q.q_heads, local_q.head_dim, s == 0 ? &acc : &part, r, st));
    if (s > 0 && local_q.num_rows > 0) {
      const auto t0 = Clock::now();
      MergeInto(acc.view(), part.cview(), local_q.num_rows, local_q.q_heads, local_q.head_dim);
      if (st) st->compute_seconds += Seconds(t0, Clock::now());
    }
    KVRING_RETURN_IF_ERROR(w.WaitAll(reqs));
    cur = 1 - cur;
  }
  CopyOut(acc, out);
  Finish(start, st);
  return absl::OkStatus();
}

absl::Status RingPassQ(Transport& t, const AttentionOptions& o, const QueryTensor& local_q, const PagedKv& local_kv,
                       PartialOutput out, const RingOptions& r, PassQMode mode, RingStats* st) {
  const auto start = Clock::now();
  const int n = t.size(), me = t.rank();
  KVRING_ASSIGN_OR_RETURN(std::vector<Record> rec,
                          AllGather(t, r, Record{local_q.num_rows, ring_internal::QueryChunkBytes(local_q), 0}, st));
  std::vector<PartialResult> partial_for(n);
  Waiter w(r, st);
  auto compute_for = [&](int owner, absl::Span<const uint8_t> chunk) -> absl::Status {
    KVRING_ASSIGN_OR_RETURN(QueryTensor q, ring_internal::DecodeQueryChunk(chunk));
    if (q.num_rows != rec[owner][0]) return absl::DataLossError("query chunk has the wrong number of rows");
    return Compute(o, q, local_kv, q.q_heads, q.head_dim, &partial_for[owner], r, st);
  };
  if (mode == PassQMode::kRing) {
    std::vector<uint8_t> buf[2];
    ring_internal::EncodeQueryChunk(local_q, &buf[0]);
    int cur = 0;
    const int next = (me + 1) % n, prev = (me - 1 + n) % n;
    for (int s = 0; s < n; ++s) {
      const int owner = (me - s + n) % n;
      std::vector<std::unique_ptr<TransportRequest>> reqs;
      if (s < n - 1) {
        const int src_owner = (me - s - 1 + 2 * n) % n;
        buf[1 - cur].resize(rec[src_owner][1]);
        KVRING_ASSIGN_OR_RETURN(auto rq, t.Irecv(prev, Tag(r, kQRing, s), absl::MakeSpan(buf[1 - cur])));
        reqs.push_back(std::move(rq));
        KVRING_ASSIGN_OR_RETURN(auto sq, Send(t, next, Tag(r, kQRing, s), buf[cur], st));
        reqs.push_back(std::move(sq));
        KVRING_RETURN_IF_ERROR(t.Flush());
      }
      KVRING_RETURN_IF_ERROR(compute_for(owner, buf[cur]));
      KVRING_RETURN_IF_ERROR(w.WaitAll(reqs));
      cur = 1 - cur;
    }
  } else {
    std::vector<uint8_t> mine;
    ring_internal::EncodeQueryChunk(local_q, &mine);
    std::vector<std::vector<uint8_t>> theirs(n);
    std::vector<std::unique_ptr<TransportRequest>> recvs(n), sends;
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      theirs[p].resize(rec[p][1]);
      KVRING_ASSIGN_OR_RETURN(recvs[p], t.Irecv(p, Tag(r, kQAll, 0), absl::MakeSpan(theirs[p])));
      KVRING_ASSIGN_OR_RETURN(auto sq, Send(t, p, Tag(r, kQAll, 0), mine, st));
      sends.push_back(std::move(sq));
    }
    KVRING_RETURN_IF_ERROR(t.Flush());
    KVRING_RETURN_IF_ERROR(compute_for(me, mine));  // overlaps with the incoming queries
    for (int k = 1; k < n; ++k) {
      const int p = (me + k) % n;
      KVRING_RETURN_IF_ERROR(w.Wait(*recvs[p]).status());
      KVRING_RETURN_IF_ERROR(compute_for(p, theirs[p]));
    }
    KVRING_RETURN_IF_ERROR(w.WaitAll(sends));
  }
  absl::Status s = ReturnAndMergePartials(t, r, local_q, partial_for, out, st);
  Finish(start, st);
  return s;
}

absl::Status DecodeStep(Transport& t, const AttentionOptions& o, int caller, const std::vector<int>& tail_owner,
                        const QueryTensor& q, const void* new_k, const void* new_v, KvShard& shard, PartialOutput out,
                        const RingOptions& r, RingStats* st) {
  const int n = t.size(), me = t.rank();
  const BlockLayout& L = shard.layout();
  if (tail_owner.size() != shard.num_sequences())
    return absl::InvalidArgumentError("tail_owner needs one rank per sequence");
  const size_t row_bytes = size_t{L.kv_heads} * L.head_dim * DTypeSize(L.dtype);
  Waiter w(r, st);
  if (me == caller) {
    if (q.num_rows > 0 && (new_k == nullptr || new_v == nullptr))
      return absl::InvalidArgumentError("decode needs the new K and V");
    if (q.num_rows > 0 && (q.positions == nullptr)) return absl::InvalidArgumentError("decode needs query positions");
    // Group the new rows by the rank owning their sequence's tail.
    std::vector<std::vector<uint32_t>> rows_for(n);
    for (uint32_t row = 0; row < q.num_rows; ++row) {
      const uint32_t seq = q.seq_ids ? q.seq_ids[row] : 0;
      if (seq >= tail_owner.size() || tail_owner[seq] < 0 || tail_owner[seq] >= n) {
        return absl::InvalidArgumentError(absl::StrCat("row ", row, ": no tail owner for sequence ", seq));
      }
      rows_for[tail_owner[seq]].push_back(row);
    }
    std::vector<std::vector<uint8_t>> kmsg(n), vmsg(n);
    std::vector<std::array<uint64_t, 2>> sizes(n);
    std::vector<std::unique_ptr<TransportRequest>> reqs;
    for (int p = 0; p < n; ++p) {
      const auto& rows = rows_for[p];
      std::vector<int64_t> pos;
      std::vector<uint32_t> seqs;
      std::vector<uint8_t> kd(rows.size() * row_bytes), vd(rows.size() * row_bytes);
      for (size_t i = 0; i < rows.size(); ++i) {
        pos.push_back(q.positions[rows[i]]);
        seqs.push_back(q.seq_ids ? q.seq_ids[rows[i]] : 0);
        std::memcpy(kd.data() + i * row_bytes, static_cast<const uint8_t*>(new_k) + rows[i] * row_bytes, row_bytes);
        std::memcpy(vd.data() + i * row_bytes, static_cast<const uint8_t*>(new_v) + rows[i] * row_bytes, row_bytes);
      }
      QueryTensor kt{kd.data(),  L.dtype,    static_cast<uint32_t>(rows.size()), L.kv_heads, L.head_dim,
                     pos.data(), seqs.data()};
      QueryTensor vt = kt;
      vt.data = vd.data();
      ring_internal::EncodeQueryChunk(kt, &kmsg[p]);
      ring_internal::EncodeQueryChunk(vt, &vmsg[p]);
      if (p == me) continue;
      sizes[p] = {kmsg[p].size(), vmsg[p].size()};
      const auto* sz = reinterpret_cast<const uint8_t*>(sizes[p].data());
      KVRING_ASSIGN_OR_RETURN(auto a, Send(t, p, Tag(r, kAppendSize, 0), absl::MakeConstSpan(sz, 16), st));
      KVRING_ASSIGN_OR_RETURN(auto b, Send(t, p, Tag(r, kAppendK, 0), kmsg[p], st));
      KVRING_ASSIGN_OR_RETURN(auto c, Send(t, p, Tag(r, kAppendV, 0), vmsg[p], st));
      reqs.push_back(std::move(a));
      reqs.push_back(std::move(b));
      reqs.push_back(std::move(c));
    }
    KVRING_RETURN_IF_ERROR(t.Flush());
    // Our own appends.
    KVRING_ASSIGN_OR_RETURN(QueryTensor kt, ring_internal::DecodeQueryChunk(kmsg[me]));
    KVRING_ASSIGN_OR_RETURN(QueryTensor vt, ring_internal::DecodeQueryChunk(vmsg[me]));
    for (uint32_t i = 0; i < kt.num_rows; ++i) {
      KVRING_RETURN_IF_ERROR(shard.Append(kt.seq_ids[i], o.layer, kt.positions[i],
                                          static_cast<const uint8_t*>(kt.data) + i * row_bytes,
                                          static_cast<const uint8_t*>(vt.data) + i * row_bytes));
    }
    KVRING_RETURN_IF_ERROR(w.WaitAll(reqs));
  } else {
    std::array<uint64_t, 2> sizes{};
    KVRING_ASSIGN_OR_RETURN(
        auto sq, t.Irecv(caller, Tag(r, kAppendSize, 0), absl::MakeSpan(reinterpret_cast<uint8_t*>(sizes.data()), 16)));
    KVRING_RETURN_IF_ERROR(t.Flush());
    KVRING_RETURN_IF_ERROR(w.Wait(*sq).status());
    if (sizes[0] > (1ull << 32) || sizes[1] > (1ull << 32)) return absl::DataLossError("append message size is absurd");
    std::vector<uint8_t> kmsg(sizes[0]), vmsg(sizes[1]);
    KVRING_ASSIGN_OR_RETURN(auto kr, t.Irecv(caller, Tag(r, kAppendK, 0), absl::MakeSpan(kmsg)));
    KVRING_ASSIGN_OR_RETURN(auto vr, t.Irecv(caller, Tag(r, kAppendV, 0), absl::MakeSpan(vmsg)));
    KVRING_RETURN_IF_ERROR(t.Flush());
    KVRING_RETURN_IF_ERROR(w.Wait(*kr).status());
    KVRING_RETURN_IF_ERROR(w.Wait(*vr).status());
    KVRING_ASSIGN_OR_RETURN(QueryTensor kt, ring_internal::DecodeQueryChunk(kmsg));
    KVRING_ASSIGN_OR_RETURN(QueryTensor vt, ring_internal::DecodeQueryChunk(vmsg));
    if (kt.num_rows != vt.num_rows || kt.q_heads != L.kv_heads || kt.head_dim != L.head_dim || kt.dtype != L.dtype) {
      return absl::DataLossError("append message does not match the shard's layout");
    }
    for (uint32_t i = 0; i < kt.num_rows; ++i) {
      KVRING_RETURN_IF_ERROR(shard.Append(kt.seq_ids[i], o.layer, kt.positions[i],
                                          static_cast<const uint8_t*>(kt.data) + i * row_bytes,
                                          static_cast<const uint8_t*>(vt.data) + i * row_bytes));
    }
  }
  QueryTensor local_q = q;
  if (me != caller) {
    local_q = QueryTensor{};
    local_q.dtype = q.dtype;
    local_q.q_heads = q.q_heads;
    local_q.head_dim = L.head_dim;
  }
  const PagedKv kv = shard.View(o.layer);
  return RingPassQ(t, o, local_q, kv, out, r, PassQMode::kAllToAll, st);
}

int LoadBalancedOwner(uint64_t num_blocks, int num_shards, uint64_t block) {
  const uint64_t chunks = 2 * static_cast<uint64_t>(num_shards);
  uint64_t c = 0;
  while (c + 1 < chunks && (c + 1) * num_blocks / chunks <= block) ++c;
  return c < static_cast<uint64_t>(num_shards) ? static_cast<int>(c) : static_cast<int>(chunks - 1 - c);
}

int ContiguousOwner(uint64_t num_blocks, int num_shards, uint64_t block) {
  uint64_t c = 0;
  const uint64_t n = static_cast<uint64_t>(num_shards);
  while (c + 1 < n && (c + 1) * num_blocks / n <= block) ++c;
  return static_cast<int>(c);
}

bool PreferPassKv(uint64_t new_tokens, uint64_t cached_tokens, uint32_t q_heads, uint32_t kv_heads) {
  if (new_tokens == 0) return false;
  return static_cast<double>(new_tokens) / static_cast<double>(new_tokens + cached_tokens) >= 2.0 * kv_heads / q_heads;
}

}  // namespace kvring
