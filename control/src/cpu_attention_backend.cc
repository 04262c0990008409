#include "kvring/control/cpu_attention_backend.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvring/attention/partial_attention.h"

namespace kvring {

absl::Status CpuAttentionBackend::OpenBlock(const SequenceRef& seq, uint64_t index, const BlockLayout& layout) {
  const OpenId id{seq.ns, seq.id, index};
  {
    absl::MutexLock l(&mu_);
    if (open_.contains(id)) return absl::AlreadyExistsError(absl::StrCat("block ", index, " is already open"));
  }
  // A host page of the store: counted against the host tier and the
  // tenant's one budget (the core holds the sequence's lock, so no other
  // call opens this block meanwhile).
  absl::StatusOr<ScratchPage> page = store_->AcquireScratch(seq.tenant, layout.bytes());
  if (!page.ok()) return page.status();
  auto b = std::make_unique<OpenBuffer>();
  b->page = std::move(*page);
  absl::MutexLock l(&mu_);
  open_[id] = std::move(b);
  return absl::OkStatus();
}

void CpuAttentionBackend::DiscardOpenBlock(const SequenceRef& seq, uint64_t index) {
  std::unique_ptr<OpenBuffer> gone;  // its page goes back to the store outside mu_
  absl::MutexLock l(&mu_);
  auto it = open_.find(OpenId{seq.ns, seq.id, index});
  if (it == open_.end()) return;
  gone = std::move(it->second);
  open_.erase(it);
}

void CpuAttentionBackend::ForgetSequence(const SequenceRef& seq) {
  std::vector<std::unique_ptr<OpenBuffer>> gone;
  absl::MutexLock l(&mu_);
  for (auto it = open_.begin(); it != open_.end();) {
    if (it->first.ns == seq.ns && it->first.id == seq.id) {
      gone.push_back(std::move(it->second));
      open_.erase(it++);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<CpuAttentionBackend::OpenBuffer*> CpuAttentionBackend::Find(const SequenceRef& seq, uint64_t index) {
  absl::MutexLock l(&mu_);
  auto it = open_.find(OpenId{seq.ns, seq.id, index});
  if (it == open_.end()) return absl::InternalError(absl::StrCat("block ", index, " of '", seq.id, "' is not open"));
  return it->second.get();
}

absl::Status CpuAttentionBackend::ReadOpenBlock(const SequenceRef& seq, uint64_t index, absl::Span<uint8_t> dst) {
  absl::StatusOr<OpenBuffer*> b = Find(seq, index);
  if (!b.ok()) return b.status();
  const absl::Span<uint8_t> bytes = (*b)->page.bytes();
  if (dst.size() < bytes.size()) return absl::InvalidArgumentError("destination smaller than the block");
  std::memcpy(dst.data(), bytes.data(), bytes.size());
  return absl::OkStatus();
}

absl::Status CpuAttentionBackend::Step(const StepPlan& plan, PartialOutput out, StepTimes* times) {
  if (plan.device != nullptr) {  // DeviceIoRefusal says no: the core does not send these
    return absl::FailedPreconditionError("the CPU backend cannot read or write GPU memory");
  }
  const BlockLayout& L = plan.layout;
  const size_t esz = DTypeSize(L.dtype);
  const size_t row_bytes = size_t{L.head_dim} * esz;
  // Appends: each token's heads into [layer][K|V][head][token][dim].
  for (const StepSequence& s : plan.sequences) {
    for (const StepAppend& a : s.appends) {
      absl::StatusOr<OpenBuffer*> b = Find(s.seq, a.index);
      if (!b.ok()) return b.status();
      uint8_t* base = (*b)->page.bytes().data();
      for (uint32_t t = 0; t < a.count; ++t) {
        const size_t src = (size_t{a.src_row} + t) * L.kv_heads * row_bytes;
        for (uint32_t h = 0; h < L.kv_heads; ++h) {
          std::memcpy(base + L.index(plan.shape.options.layer, 0, h, a.offset + t, 0) * esz,
                      plan.new_k.data() + src + h * row_bytes, row_bytes);
          std::memcpy(base + L.index(plan.shape.options.layer, 1, h, a.offset + t, 0) * esz,
                      plan.new_v.data() + src + h * row_bytes, row_bytes);
        }
      }
    }
  }
  if (plan.shape.num_rows == 0) return absl::OkStatus();
  // Attention over every listed block, read in place.
  std::vector<PinnedBlock> held;
  std::vector<KvBlockRef> refs;
  std::vector<uint32_t> seq_begin{0};
  std::vector<uint32_t> seq_ids(plan.shape.num_rows, 0);
  for (const StepSequence& s : plan.sequences) {
    if (s.rows == 0) continue;
    const uint32_t kseq = static_cast<uint32_t>(seq_begin.size() - 1);
    for (uint32_t r = 0; r < s.rows; ++r) seq_ids[s.row_begin + r] = kseq;
    for (const BlockRange& rg : s.ranges) {
      for (uint64_t idx = rg.begin; idx < rg.end; ++idx) {
        const uint8_t* data;
        auto full = s.full->find(idx);
        if (full == s.full->end()) {
          if (plan.encoding.quantized()) {  // the core splits such steps (StepTwoEncodings)
            return absl::InternalError(absl::StrCat("sequence '", s.seq.id, "': open block ", idx,
                                                    " (plain) in a step over quantized blocks"));
          }
          absl::StatusOr<OpenBuffer*> ob = Find(s.seq, idx);
          if (!ob.ok()) return ob.status();
          data = (*ob)->page.bytes().data();
        } else {
          absl::StatusOr<PinnedBlock> pb = store_->Acquire(s.seq.ns, full->second);
          if (!pb.ok()) {
            return absl::Status(pb.status().code(),
                                absl::StrCat("sequence '", s.seq.id, "' block ", idx, ": ", pb.status().message()));
          }
          if (!(pb->meta().layout == L) || !(pb->meta().encoding == plan.encoding)) {
            return absl::FailedPreconditionError(absl::StrCat("sequence '", s.seq.id, "' block ", idx,
                                                              " has another layout or encoding than the sequence"));
          }
          data = pb->payload().data();
          held.push_back(std::move(*pb));
        }
        refs.push_back(
            KvBlockRef{data, static_cast<int64_t>(idx * L.block_tokens), s.BlockTokens(idx, L.block_tokens)});
      }
    }
    seq_begin.push_back(static_cast<uint32_t>(refs.size()));
  }
  // Open blocks are plain; a step never mixes them with quantized blocks.
  PagedKv kv{L, plan.encoding, refs, seq_begin};
  const StepShape& sh = plan.shape;
  QueryTensor q{plan.queries.data(),   sh.q_dtype,    sh.num_rows, sh.q_heads, sh.head_dim,
                plan.positions.data(), seq_ids.data()};
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = PartialAttention(sh.options, q, kv, out, pool_);
  if (times != nullptr)
    times->kernel_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

BackendStats CpuAttentionBackend::stats() {
  BackendStats s;
  s.name = name();
  absl::MutexLock l(&mu_);
  s.open_blocks = open_.size();
  return s;
}

}  // namespace kvring
