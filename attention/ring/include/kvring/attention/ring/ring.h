// Part of the ring library (attention/ring/, target kvring_ring): a library
// that kvringd does not serve yet. The daemons serve pass-Q as the Attend
// call, fanned out by the client; these rings are exercised by tests and
// benches (bench/gpu/ring_bench.cu, bench/gpu/multi_gpu.sh).
//
// Distributed attention over a Transport: pass-KV and pass-Q rings, the
// all-to-all (fan-out) variant of pass-Q, and a batched decode step.
// After "Context Parallelism for Scalable Million-Token Inference".
//
// All functions are collective: every rank of the transport's group calls
// the same function with the same AttentionOptions and RingOptions::call_id;
// each rank passes its own queries (possibly none) and its own KV (possibly
// none for some sequences). Sequence ids are global: sequence s of one
// rank's PagedKv is sequence s everywhere. Results are exact up to fp32
// rounding (partials merge by LSE, merge.h) and land in `out` of each rank,
// for that rank's own queries.
//
//  - RingPassKv: queries stay, KV chunks travel the ring (N-1 hops). For full
//    prefill, when the new tokens are a large share of the context.
//  - RingPassQ (mode kRing): KV stays, query chunks travel the ring (N-1
//    hops); partials return to their owners in one all-to-all.
//  - RingPassQ (mode kAllToAll): each rank sends its queries to every other
//    rank at once and gets partials back: 2 message latencies instead of N.
//    The decode path.
// In both rings the next chunk is sent and received while the current one is
// computed (double buffering); RingStats says how long each rank waited on
// the network beyond its compute.
//
// Errors: a rank's failure (bad input, a transport error) makes it return
// that error; its peers then fail with DEADLINE_EXCEEDED / UNAVAILABLE after
// RingOptions::timeout. No rank ever returns a partial result as if it were
// complete.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvring/attention/ring/kv_shard.h"
#include "kvring/attention/tensors.h"
#include "kvring/common/thread_pool.h"
#include "kvring/transport/transport.h"

namespace kvring {

struct RingOptions {
  // Distinguishes concurrent collectives on one transport (part of every tag).
  uint32_t call_id = 0;
  // Bound on each wait for a peer's message.
  absl::Duration timeout = absl::Seconds(60);
  // Threads for the local attention compute (optional).
  ThreadPool* pool = nullptr;
};

struct RingStats {
  double total_seconds = 0;
  double compute_seconds = 0;  // local PartialAttention + merges
  double wait_seconds = 0;     // blocked on the transport, not hidden by compute
  uint64_t bytes_sent = 0;
  uint32_t hops = 0;
};

enum class PassQMode { kRing, kAllToAll };

absl::Status RingPassKv(Transport& t, const AttentionOptions& options, const QueryTensor& local_q,
                        const PagedKv& local_kv, PartialOutput out, const RingOptions& ring,
                        RingStats* stats = nullptr);

absl::Status RingPassQ(Transport& t, const AttentionOptions& options, const QueryTensor& local_q,
                       const PagedKv& local_kv, PartialOutput out, const RingOptions& ring, PassQMode mode,
                       RingStats* stats = nullptr);

// One decode step of a batch (collective). On the rank holding the batch
// (`caller`): `q` has the new query rows (1..8 per sequence, seq_ids and
// positions set) and new_k / new_v their K and V ([num_rows, kv_heads,
// head_dim], layout dtype). First each row's K/V goes to the rank owning its
// sequence's tail (`tail_owner[seq]`), which appends it for options.layer;
// then pass-Q (all-to-all) computes attention over all KV, the new tokens
// included. Other ranks pass an empty q and null new_k/new_v. `out` is
// written on the caller only.
absl::Status DecodeStep(Transport& t, const AttentionOptions& options, int caller, const std::vector<int>& tail_owner,
                        const QueryTensor& q, const void* new_k, const void* new_v, KvShard& shard, PartialOutput out,
                        const RingOptions& ring, RingStats* stats = nullptr);

// The load-balanced causal layout: a sequence of `num_blocks` blocks cut into
// 2N contiguous chunks; shard i holds chunks i and 2N-1-i. Returns the shard
// of block b.
int LoadBalancedOwner(uint64_t num_blocks, int num_shards, uint64_t block);
// Contiguous layout: N near-equal contiguous ranges.
int ContiguousOwner(uint64_t num_blocks, int num_shards, uint64_t block);

// The paper's rule: pass-KV when the new tokens are a large enough share of
// the context (T / (T + P) >= 2 * kv_heads / q_heads), pass-Q otherwise.
bool PreferPassKv(uint64_t new_tokens, uint64_t cached_tokens, uint32_t q_heads, uint32_t kv_heads);

}  // namespace kvring
