// Request/reply messaging over UCX active messages: the daemon's bulk data
// plane. gRPC carries control and small messages; block payloads (Put, Get)
// travel here, over whatever UCX picks between the two processes (shared
// memory and cross-memory attach on one host, TCP or RDMA across hosts).
//
// A request is one active message: a fixed header plus data = token || meta
// || payload, where meta is a serialized protobuf and payload the raw bytes
// (sent from an iovec, without concatenating). The reply is one message back
// on the same endpoint: status || meta || payload. Large data moves with
// UCX's rendezvous protocol (zero-copy where the transport allows).
//
// Addressing: peers connect by UCX worker address ("ucxw:<hex>", from
// UcxRpcServer::address(), published in the shard map), so UCX selects
// every transport the two workers share: shared memory on one host, TCP or
// RDMA across hosts. A client first sends a hello with its own worker
// address; the server opens an endpoint back to it for replies. The TCP
// transport listens on the daemon's --ucx_listen port.
// Failure and departure: every endpoint runs in UCX's peer-failure mode
// (the shared-memory transports with error handling on), so a dead peer is
// reported and an endpoint can be closed at once. A client says bye when it
// goes and the server closes its endpoint then, releasing the client's
// shared-memory segments; a same-host client that dies without a bye is
// found by its pid (checked every 500 ms), and a reply in flight longer than
// 30 s closes its endpoint. A client abandons a connection whose call timed
// out (UNAVAILABLE; the next Connect starts afresh) but never closes an
// endpoint while its worker lives on: UCX 1.13 answers a peer's wireup for
// a closed endpoint with a new one and the peer aborts on the changed id.
// Request payloads are staged (copied into pooled buffers), so a call always
// returns by its deadline without the caller's memory still being read.
// Trade-off measured: in peer-failure mode UCX 1.13 does not use CMA
// zero-copy between processes, so same-host bulk moves through shared-memory
// copies (bench/RESULTS.md).
//
// UcxRpcServer: serves requests; each request runs the handler on the
// given ThreadPool; the handler replies exactly once through its UcxReplier
// (from any thread). An optional fast handler sees each request first, on
// the UCX worker's own thread (no hand-off to the pool and back): it either
// replies and returns true, or leaves request and replier untouched and
// returns false (the request then goes to the pool). It must not block. Payload spans given to Send() must stay valid
// until the reply is sent: pass their owner as `keepalive`. UcxRpcClient: one endpoint to a server; Call() is
// thread-safe and may be issued from many threads at once. A connection failure fails every pending call with
// UNAVAILABLE. Both are torn down by their destructors.
#pragma once

#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvring/common/thread_pool.h"

namespace kvring {

namespace ucx_internal {
class UcxWorkerLoop;
struct ServerState;
struct ClientState;
}  // namespace ucx_internal

// How a UCX endpoint's progress thread waits for messages.
//
// Adaptive spin (the default on hosts of 8 or more cores): after a message
// the thread busy-polls spin_us before sleeping on the worker's event fd; but
// while messages keep coming (the last one woke it within spin_max_us of the
// activity before it: a decode loop stepping layer after layer) it polls
// spin_max_us after each, so the next one is taken without a sleep and wake
// (each costs tens of microseconds, and a reply's wake is on the step's
// critical path). When the traffic stops the thread sleeps again: an idle
// endpoint costs no CPU, a streaming one about a core (bench/RESULTS.md has
// what it costs and what it saves). A caller waiting in UcxRpcClient::Call
// polls its reply for the same window before it sleeps.
struct UcxLoopOptions {
  // Busy-poll this long after each message before sleeping when the traffic
  // is not streaming. -1: 20 us on hosts of 8 or more cores, 0 below (on a
  // small machine spinning loops take the cores from the work itself: 2
  // cores, 2 daemons + a client, 256 KiB gets ran 1.2 GB/s spinning, 1.7
  // without). Default: -1.
  int spin_us = -1;
  // Busy-poll this long after each message while the traffic streams (see
  // above); 0 turns the adaptive spin off (spin_us only). -1: 2000 us on
  // hosts of 8 or more cores, 0 below. Default: -1.
  int spin_max_us = -1;
  // Sleep on the worker's event fd between messages (UCP_FEATURE_WAKEUP).
  // false: the loop polls without ever sleeping (lowest latency, a core always
  // busy). Default: true.
  bool wakeup = true;
  // The network devices the worker may use (UCX's device names, e.g. "lo",
  // "eth0"; comma-separated). Empty: every device. A server sets it from its
  // listen address, so that it opens no listener on another interface.
  // Shared-memory transports are not network devices and stay available.
  std::string net_devices;
};

// INVALID_ARGUMENT naming the field when spin_us or spin_max_us is outside
// -1 (by core count) .. 1000000. UcxRpcServer::Start and
// UcxRpcClient::Connect check it; callers that take the options from a user
// (flags, ClientOptions) check it up front with this.
absl::Status ValidateUcxLoopOptions(const UcxLoopOptions& options);

struct UcxRequest {
  uint32_t method = 0;
  std::string token;
  std::string meta;
  absl::Span<const uint8_t> payload;
  std::shared_ptr<void> storage;  // owns `payload`
  // What a fast handler that declined the request already worked out (its
  // parsed form, say), handed to the pool's handler with the request; the
  // transport never looks at it.
  std::shared_ptr<void> handler_state;
};

class UcxReplier {
 public:
  UcxReplier() = default;
  UcxReplier(UcxReplier&&) = default;
  UcxReplier& operator=(UcxReplier&&) = default;
  // Sends the reply (once; later calls are ignored).
  void Send(const absl::Status& status, std::string meta, std::vector<absl::Span<const uint8_t>> payload = {},
            std::shared_ptr<void> keepalive = nullptr);

 private:
  friend struct ucx_internal::ServerState;
  std::shared_ptr<ucx_internal::ServerState> server_;
  void* ep_ = nullptr;
  uint64_t request_id_ = 0;
  uint64_t ep_generation_ = 0;
};

using UcxHandler = std::function<void(UcxRequest&&, UcxReplier)>;
// Runs on the progress thread first: true when it answered the request; false
// hands the request (with any handler_state it set) to the pool's handler.
using UcxFastHandler = std::function<bool(UcxRequest&, UcxReplier&)>;

class UcxRpcServer {
 public:
  // `pool` runs the handlers and must outlive the server. `listen` is kept
  // for logs only (peers use the worker address).
  static absl::StatusOr<std::unique_ptr<UcxRpcServer>> Start(const std::string& listen, UcxHandler handler,
                                                             ThreadPool* pool, uint64_t max_message_bytes,
                                                             UcxFastHandler fast_handler = nullptr,
                                                             const UcxLoopOptions& loop = {});
  ~UcxRpcServer();
  // "ucxw:<hex worker address>": what clients pass to Connect().
  const std::string& address() const { return address_; }
  // How often the progress thread has gone to sleep (each sleep is a wake-up
  // some later message pays). Any thread.
  uint64_t sleeps() const;

 private:
  UcxRpcServer() = default;
  std::unique_ptr<ucx_internal::UcxWorkerLoop> loop_;
  std::shared_ptr<ucx_internal::ServerState> state_;
  std::string address_;
};

struct UcxReply {
  absl::Status status;
  std::string meta;
  std::vector<uint8_t> payload;  // when it did not fit the caller's buffer
  size_t payload_size = 0;
  bool payload_in_buffer = false;
};

// A call in flight (UcxRpcClient::Start): finish it with
// UcxRpcClient::Finish. Dropped unfinished, its reply is discarded when it
// comes (a reply landing at that moment is waited for), so the reply buffer
// it was given may go once the handle has. Move-only; one thread at a time.
class UcxPendingCall {
 public:
  UcxPendingCall() = default;
  UcxPendingCall(UcxPendingCall&& o) noexcept { *this = std::move(o); }
  UcxPendingCall& operator=(UcxPendingCall&& o) noexcept;
  ~UcxPendingCall() { Abandon(); }

 private:
  friend class UcxRpcClient;
  void Abandon();
  std::shared_ptr<ucx_internal::ClientState> state_;  // null: nothing in flight
  uint64_t id_ = 0;
  std::future<UcxReply> reply_;
  std::shared_future<int> sent_;  // the send's ucs_status_t
};

class UcxRpcClient {
 public:
  // `peer_alive` (optional) is polled while a call waits; when it says the
  // peer is gone (e.g. its gRPC channel failed) the call fails at once with
  // UNAVAILABLE instead of waiting out its timeout.
  static absl::StatusOr<std::unique_ptr<UcxRpcClient>> Connect(const std::string& address,
                                                               absl::Duration timeout = absl::Seconds(5),
                                                               std::function<bool()> peer_alive = nullptr,
                                                               const UcxLoopOptions& loop = {});
  ~UcxRpcClient();
  // Sends a request and waits for its reply. The reply payload lands in
  // `reply_buffer` when it fits (payload_in_buffer), else in reply.payload.
  // Transport failures are the returned status; the server's answer is
  // reply.status.
  absl::StatusOr<UcxReply> Call(uint32_t method, const std::string& token, const std::string& meta,
                                absl::Span<const absl::Span<const uint8_t>> payload, absl::Span<uint8_t> reply_buffer,
                                absl::Duration timeout);
  // Call in two halves, for a caller with several calls to make at once (a
  // fan-out to many servers, from one thread: no thread per call). Start
  // sends the request and returns at once (the payload is staged: the
  // caller's spans may go); Finish waits for the reply as Call does, the
  // timeout counted from Finish. `reply_buffer` must stay valid until Finish
  // returns or the handle is dropped.
  absl::StatusOr<UcxPendingCall> Start(uint32_t method, const std::string& token, const std::string& meta,
                                       absl::Span<const absl::Span<const uint8_t>> payload,
                                       absl::Span<uint8_t> reply_buffer);
  absl::StatusOr<UcxReply> Finish(UcxPendingCall call, absl::Duration timeout);
  bool connected() const;
  const std::string& address() const { return address_; }
  // True when the server is on this host (shared-memory / CMA lanes).
  bool same_host() const { return same_host_; }
  // How often the progress thread has gone to sleep. Any thread.
  uint64_t sleeps() const;

 private:
  UcxRpcClient() = default;
  void Break(const absl::Status& why);
  // Waits for `f` up to `timeout`, polling peer_alive_; false on timeout or
  // a dead peer.
  template <typename F>
  bool WaitFor(F& f, absl::Duration timeout);
  bool same_host_ = false;
  // A same-host daemon's process (0: unknown): its death fails calls at once.
  uint32_t server_pid_ = 0;
  uint64_t server_start_time_ = 0;
  std::function<bool()> peer_alive_;
  std::unique_ptr<ucx_internal::UcxWorkerLoop> loop_;
  std::shared_ptr<ucx_internal::ClientState> state_;
  std::string address_;
};

}  // namespace kvring
