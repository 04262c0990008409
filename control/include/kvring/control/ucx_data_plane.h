// UcxDataPlane: a daemon's UCX face. Serves Put, Get and Attend with the
// block payloads (and queries / partials) out of band over UCX active
// messages, and the same NodeCore as gRPC, so both paths validate and
// authorize identically. Method ids and payload conventions are shared with
// the client (kUcxMethod*): Put sends the blocks' payloads concatenated in
// request order; Get replies with the payloads of the blocks it found, in
// order, straight from the store's pages (held until sent); Attend sends the
// queries as payload and replies with out || lse.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "kvring/control/node_core.h"
#include "kvring/protocol/ucx_methods.h"
#include "kvring/transport/ucx_rpc.h"

namespace kvring {

class UcxDataPlane {
 public:
  // Starts serving on `listen` (host:port); `core` must outlive the plane.
  static absl::StatusOr<std::unique_ptr<UcxDataPlane>> Start(NodeCore* core, const std::string& listen,
                                                             uint64_t max_message_bytes, size_t threads,
                                                             const UcxLoopOptions& loop = {});
  ~UcxDataPlane();
  const std::string& address() const { return server_->address(); }

 private:
  UcxDataPlane() = default;
  void Handle(UcxRequest&& req, UcxReplier reply);
  // On the UCX thread: a Get whose blocks are all in host memory (or
  // absent) is served there, without the pool's two thread hand-offs; anything
  // that could touch the disk tier or compute goes to the pool.
  bool HandleFast(UcxRequest& req, UcxReplier& reply);
  void ServeGet(const v1::Tenant& tenant, const v1::GetRequest& r, UcxReplier& reply);
  NodeCore* core_ = nullptr;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<UcxRpcServer> server_;
};

}  // namespace kvring
