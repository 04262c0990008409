// CpuAttentionBackend: attention_backend.h's contract on the host. Full
// blocks are read in place from the node's BlockStore (host pages, promoted
// from the cold tier when needed), open blocks live in host pages lent by
// the store (ScratchPage: within the host tier's size and the tenant's one
// budget, so open blocks can never grow a node past --host_bytes), and
// attention runs on the CPU kernels (attention/partial_attention.h) over the
// pool's threads. Thread-safe as the interface requires.
#pragma once

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kvring/cache/block_store.h"
#include "kvring/common/thread_pool.h"
#include "kvring/control/attention_backend.h"

namespace kvring {

class CpuAttentionBackend final : public AttentionBackend {
 public:
  // `store` and `pool` (optional) are not owned and must outlive the backend.
  CpuAttentionBackend(BlockStore* store, ThreadPool* pool) : store_(store), pool_(pool) {}

  std::string name() const override { return "cpu"; }
  absl::Status AdmitBlock(const SequenceRef&, uint64_t, const BlockKey&, const BlockMeta&,
                          absl::Span<const uint8_t>) override {
    return absl::OkStatus();  // read from the store when attended
  }
  absl::Status OpenBlock(const SequenceRef& seq, uint64_t index, const BlockLayout& layout) override;
  void DiscardOpenBlock(const SequenceRef& seq, uint64_t index) override;
  absl::Status Step(const StepPlan& plan, PartialOutput out, StepTimes* times) override;
  absl::Status ReadOpenBlock(const SequenceRef& seq, uint64_t index, absl::Span<uint8_t> dst) override;
  void SealBlock(const SequenceRef& seq, uint64_t index, const BlockKey&, const KvEncoding&) override {
    DiscardOpenBlock(seq, index);
  }
  void ForgetSequence(const SequenceRef& seq) override;
  // The store applies the tenant's budget to open blocks (AcquireScratch).
  void SetTenantQuota(TenantId, uint64_t) override {}
  BackendStats stats() override;

 private:
  struct OpenId {
    NamespaceId ns;
    std::string id;
    uint64_t index;
    friend bool operator==(const OpenId& a, const OpenId& b) {
      return a.ns == b.ns && a.index == b.index && a.id == b.id;
    }
    template <typename H>
    friend H AbslHashValue(H h, const OpenId& k) {
      return H::combine(std::move(h), k.ns, k.id, k.index);
    }
  };
  struct OpenBuffer {
    ScratchPage page;  // layout.bytes() of it, zero-filled at open
  };
  // The buffer of an open block (stable while the sequence's lock is held).
  absl::StatusOr<OpenBuffer*> Find(const SequenceRef& seq, uint64_t index) ABSL_LOCKS_EXCLUDED(mu_);

  BlockStore* store_;
  ThreadPool* pool_;
  absl::Mutex mu_;
  absl::flat_hash_map<OpenId, std::unique_ptr<OpenBuffer>> open_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring
