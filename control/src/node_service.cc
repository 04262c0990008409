#include "kvring/control/node_service.h"

#include <chrono>
#include <cstring>

#include "kvring/control/node_wire.h"

namespace kvring {

#define KVRING_NODE_RPC(Name, Req, Resp, call)                                                   \
  grpc::Status NodeService::Name(grpc::ServerContext* ctx, const v1::Req* req, v1::Resp* resp) { \
    absl::StatusOr<v1::Tenant> t = core_->tenants()->Authenticate(*ctx);                         \
    if (!t.ok()) return ToGrpc(t.status());                                                      \
    return ToGrpc(call);                                                                         \
  }

KVRING_NODE_RPC(Lookup, LookupRequest, LookupResponse, WireLookup(*core_, *t, *req, resp))
KVRING_NODE_RPC(Put, PutRequest, PutResponse, WirePut(*core_, *t, *req, {}, resp))
KVRING_NODE_RPC(Get, GetRequest, GetResponse, WireGet(*core_, *t, *req, resp))
KVRING_NODE_RPC(Pin, PinRequest, PinResponse, WirePin(*core_, *t, *req, resp))
KVRING_NODE_RPC(Stats, StatsRequest, StatsResponse, WireStats(*core_, *t, *req, resp))
KVRING_NODE_RPC(DeleteSequence, SequenceRequest, SequenceResponse, WireSequence(*core_, *t, *req, false, resp))
KVRING_NODE_RPC(TruncateSequence, SequenceRequest, SequenceResponse, WireSequence(*core_, *t, *req, true, resp))
KVRING_NODE_RPC(ListSequences, ListSequencesRequest, ListSequencesResponse, WireListSequences(*core_, *t, *req, resp))
KVRING_NODE_RPC(ForkSequence, ForkSequenceRequest, ForkSequenceResponse, WireForkSequence(*core_, *t, *req, resp))
KVRING_NODE_RPC(ReadSequence, ReadSequenceRequest, ReadSequenceResponse, WireReadSequence(*core_, *t, *req, resp))

#undef KVRING_NODE_RPC

grpc::Status NodeService::Attend(grpc::ServerContext* ctx, const v1::AttendRequest* req, v1::AttendResponse* resp) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<v1::Tenant> t = core_->tenants()->Authenticate(*ctx);
  if (!t.ok()) return ToGrpc(t.status());
  absl::StatusOr<AttendBatch> batch = ParseAttendRequest(*req, core_->limits());
  if (!batch.ok()) return ToGrpc(batch.status());
  // The output is written straight into the response's bytes fields (or,
  // with a device exchange, into the caller's GPU memory).
  std::string* out = resp->mutable_out();
  std::string* lse = resp->mutable_lse();
  if (!req->has_device()) {
    out->resize(batch->shape.out_floats() * sizeof(float));
    lse->resize(batch->shape.lse_floats() * sizeof(float));
  }
  absl::Status s =
      WireAttend(*core_, *t, *req, *batch, resp,
                 PartialOutput{reinterpret_cast<float*>(out->data()), reinterpret_cast<float*>(lse->data())});
  if (!s.ok()) {
    resp->clear_out();
    resp->clear_lse();
  }
  resp->set_handler_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return ToGrpc(s);
}

}  // namespace kvring
