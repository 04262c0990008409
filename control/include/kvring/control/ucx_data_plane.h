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

struct UcxDataPlaneOptions {
  // host:port to listen on (the UCX worker uses only that address's network
  // device; 0.0.0.0: all). Required.
  std::string listen;
  // Largest request accepted. Default: 512 MiB.
  uint64_t max_message_bytes = 512ull << 20;
  // Handler threads for requests not served on the UCX thread. Default: 4.
  size_t threads = 4;
  // The UCX progress thread's polling (ucx_rpc.h).
  UcxLoopOptions loop;
  // Attend requests of at most this many query rows (decode steps) are
  // served on the UCX thread itself: two thread hand-offs fewer a step, at
  // the price of that thread not progressing other requests meanwhile (one
  // step's node time, tens of microseconds on a GPU node). 0: every Attend
  // goes to the handler threads. Default: 0.
  uint32_t inline_attend_rows = 0;
};

class UcxDataPlane {
 public:
  // Starts serving; `core` must outlive the plane.
  static absl::StatusOr<std::unique_ptr<UcxDataPlane>> Start(NodeCore* core, const UcxDataPlaneOptions& options);
  ~UcxDataPlane();
  const std::string& address() const { return server_->address(); }

 private:
  UcxDataPlane() = default;
  void Handle(UcxRequest&& req, UcxReplier reply);
  // On the UCX thread: a Get whose blocks are all in host memory (or
  // absent), and an Attend of few rows when options.inline_attend_rows says
  // so, are served there, without the pool's two thread hand-offs; anything
  // that could touch the disk tier or compute much goes to the pool.
  bool HandleFast(UcxRequest& req, UcxReplier& reply);
  void ServeGet(const v1::Tenant& tenant, const v1::GetRequest& r, UcxReplier& reply);
  void ServeAttend(const v1::Tenant& tenant, const v1::AttendRequest& r, const UcxRequest& req, UcxReplier& reply);
  UcxDataPlaneOptions options_;
  NodeCore* core_ = nullptr;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<UcxRpcServer> server_;
};

}  // namespace kvring
