// libFuzzer target: every node request a client can send, as raw protobuf
// bytes, through request validation and the real NodeCore on a real
// BlockStore (the code a daemon runs per request). The first byte picks the
// request kind; for Put, a second byte may split the input so the tail
// travels as external (UCX-style) payloads. Nothing may crash, leak, trip a
// sanitizer or allocate without a bound; errors are statuses.
#include <cstdint>
#include <memory>
#include <string>

#include "google/protobuf/stubs/logging.h"
#include "kvring/cache/block_store.h"
#include "kvring/common/metrics.h"
#include "kvring/common/thread_pool.h"
#include "kvring/control/auth.h"
#include "kvring/control/cpu_attention_backend.h"
#include "kvring/control/node_core.h"
#include "kvring/control/node_wire.h"
#include "kvring/control/request_validation.h"
#include "kvring/control/sequence_table.h"

namespace {

struct Env {
  std::unique_ptr<kvring::BlockStore> store;
  std::unique_ptr<kvring::SequenceTable> sequences;
  kvring::TenantDirectory tenants;
  kvring::ThreadPool pool{1};
  kvring::MetricsRegistry metrics;
  std::unique_ptr<kvring::CpuAttentionBackend> backend;
  std::unique_ptr<kvring::NodeCore> core;
  kvring::v1::Tenant tenant;

  Env() {
    google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in string fields is expected here, and logged
    kvring::BlockStoreOptions o;
    o.page_bytes = 64 << 10;
    o.num_pages = 64;
    o.prefault = false;
    store = std::move(kvring::BlockStore::Create(o).value());
    sequences = std::move(kvring::SequenceTable::Create(nullptr).value());
    kvring::NodeCoreOptions no;
    no.node_id = "fuzz";
    no.limits.max_payload_bytes = o.page_bytes;
    backend = std::make_unique<kvring::CpuAttentionBackend>(store.get(), &pool);
    core = std::make_unique<kvring::NodeCore>(no, store.get(), sequences.get(), backend.get(), &tenants, &metrics);
    tenant.set_id(7);
    tenant.set_name("fuzz");
    tenant.set_namespace_("tenant/fuzz");
    tenant.add_shared_namespaces("shared/sys");
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Env* env = new Env();  // one daemon's state for the whole run (never freed: libFuzzer exits)
  if (size < 2) return 0;
  const uint8_t kind = data[0] % 6;
  const uint8_t split = data[1];
  const uint8_t* body = data + 2;
  size_t n = size - 2;
  using namespace kvring;
  switch (kind) {
    case 0: {
      v1::LookupRequest r;
      v1::LookupResponse resp;
      if (r.ParseFromArray(body, static_cast<int>(n))) (void)WireLookup(*env->core, env->tenant, r, &resp);
      break;
    }
    case 1: {  // inline payloads
      v1::PutRequest r;
      v1::PutResponse resp;
      if (r.ParseFromArray(body, static_cast<int>(n))) (void)WirePut(*env->core, env->tenant, r, {}, &resp);
      break;
    }
    case 2: {  // external payloads: the message, then the tail cut into one span per block
      const size_t msg = n * split / 256;
      v1::PutRequest r;
      v1::PutResponse resp;
      if (!r.ParseFromArray(body, static_cast<int>(msg))) break;
      std::vector<absl::Span<const uint8_t>> ext;
      const size_t blocks = static_cast<size_t>(r.blocks_size());
      const size_t rest = n - msg;
      for (size_t i = 0; i < blocks && blocks <= 64; ++i) {
        ext.push_back(absl::MakeConstSpan(body + msg + rest * i / blocks, rest / blocks));
      }
      (void)WirePut(*env->core, env->tenant, r, ext, &resp);
      break;
    }
    case 3: {
      v1::GetRequest r;
      v1::GetResponse resp;
      if (r.ParseFromArray(body, static_cast<int>(n))) (void)WireGet(*env->core, env->tenant, r, &resp);
      break;
    }
    case 4: {
      // As the daemon's faces do: parse and validate, then the core (the
      // output sized by the validated request, so bounded by the input).
      v1::AttendRequest r;
      if (!r.ParseFromArray(body, static_cast<int>(n))) break;
      absl::StatusOr<kvring::AttendBatch> b = kvring::ParseAttendRequest(r, env->core->limits());
      if (!b.ok()) break;
      std::vector<float> out(b->shape.out_floats()), lse(b->shape.lse_floats());
      (void)env->core->Attend(env->tenant, r.header().namespace_(), *b, kvring::PartialOutput{out.data(), lse.data()},
                              nullptr);
      break;
    }
    case 5: {
      v1::PinRequest r;
      v1::PinResponse resp;
      if (r.ParseFromArray(body, static_cast<int>(n))) (void)WirePin(*env->core, env->tenant, r, &resp);
      break;
    }
  }
  return 0;
}
