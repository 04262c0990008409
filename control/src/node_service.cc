#include "kvring/control/node_service.h"

namespace kvring {

#define KVRING_NODE_RPC(Name, Req, Resp, call)                                                        \
  grpc::Status NodeService::Name(grpc::ServerContext* ctx, const v1::Req* req, v1::Resp* resp) {      \
    absl::StatusOr<v1::Tenant> t = core_->tenants()->Authenticate(*ctx);                              \
    if (!t.ok()) return ToGrpc(t.status());                                                           \
    return ToGrpc(call);                                                                              \
  }

KVRING_NODE_RPC(Lookup, LookupRequest, LookupResponse, core_->Lookup(*t, *req, resp))
KVRING_NODE_RPC(Put, PutRequest, PutResponse, core_->Put(*t, *req, {}, resp))
KVRING_NODE_RPC(Get, GetRequest, GetResponse, core_->Get(*t, *req, resp))
KVRING_NODE_RPC(Pin, PinRequest, PinResponse, core_->Pin(*t, *req, resp))
KVRING_NODE_RPC(Attend, AttendRequest, AttendResponse, core_->Attend(*t, *req, resp))
KVRING_NODE_RPC(Stats, StatsRequest, StatsResponse, core_->Stats(*t, *req, resp))

#undef KVRING_NODE_RPC

}  // namespace kvring
