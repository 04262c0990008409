// NodeChannel: the client's calls to one daemon, whatever carries them
// (internal to the client library).
//
// Two carriers answer the same calls: gRPC (every call; payloads inline in
// the messages) and the daemon's UCX data plane (Put, Get and Attend with
// their payloads beside the message, landing in the caller's buffers; the
// control calls Lookup, Pin and Stats go through the daemon's gRPC channel).
// NodeConnection (below) picks UCX when the daemon has it and it is up, and
// gRPC otherwise, so the client's operations never ask which it got.
//
// Errors: transport failures are UNAVAILABLE / DEADLINE_EXCEEDED (a node
// failure: the caller tries a replica); the daemon's own refusals come back
// with its code and message; a reply that does not parse is DATA_LOSS.
//
// Thread-safe: calls on one channel may run concurrently.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "kvring.grpc.pb.h"
#include "kvring/transport/ucx_rpc.h"

namespace kvring {

using ByteSpans = absl::Span<const absl::Span<const uint8_t>>;

// A Get's answer. Over gRPC each block's payload is inline in `resp`; over
// UCX they follow as one buffer, in the caller's `into` (in_into) or in
// `bulk`, bulk_size bytes in the order of the blocks.
struct GetReply {
  v1::GetResponse resp;
  bool bulk_reply = false;
  bool in_into = false;
  size_t bulk_size = 0;
  std::vector<uint8_t> bulk;
};

// An Attend sent without waiting for it (NodeChannel::StartAttend): Wait
// returns what NodeChannel::Attend would have. Dropped without a Wait, its
// reply is discarded. One thread at a time.
class PendingAttend {
 public:
  virtual ~PendingAttend() = default;
  virtual absl::StatusOr<v1::AttendResponse> Wait() = 0;
};

class NodeChannel {
 public:
  virtual ~NodeChannel() = default;
  // Whether payloads travel beside the messages (UCX): then a Get's `into`
  // is worth preparing.
  virtual bool payloads_beside() const = 0;
  // `payloads`: one per block of `req`, in order.
  virtual absl::StatusOr<v1::PutResponse> Put(v1::PutRequest req, ByteSpans payloads) = 0;
  // `into` (may be empty): where a UCX reply's payloads should land.
  virtual absl::StatusOr<GetReply> Get(const v1::GetRequest& req, absl::Span<uint8_t> into) = 0;
  // The queries, new K and new V as spans; the reply's O || LSE lands in
  // `reply`, which has exactly its size.
  virtual absl::StatusOr<v1::AttendResponse> Attend(v1::AttendRequest req, ByteSpans queries, ByteSpans new_k,
                                                    ByteSpans new_v, absl::Span<uint8_t> reply) = 0;
  // Attend in two halves, for a fan-out from one thread: sends the request
  // and returns at once (the spans may go then; `reply` must live until the
  // Wait or the drop). nullptr: this carrier waits for each call (gRPC): use
  // Attend.
  virtual std::unique_ptr<PendingAttend> StartAttend(const v1::AttendRequest& req, ByteSpans queries, ByteSpans new_k,
                                                     ByteSpans new_v, absl::Span<uint8_t> reply) {
    return nullptr;
  }
  virtual absl::StatusOr<v1::LookupResponse> Lookup(const v1::LookupRequest& req) = 0;
  virtual absl::StatusOr<v1::PinResponse> Pin(const v1::PinRequest& req) = 0;
  virtual absl::StatusOr<v1::StatsResponse> Stats(const v1::StatsRequest& req, absl::Duration timeout) = 0;
  // DeleteSequence (truncate = false) or TruncateSequence: control calls,
  // over gRPC on every channel.
  virtual absl::StatusOr<v1::SequenceResponse> Sequence(const v1::SequenceRequest& req, bool truncate) = 0;
  virtual absl::StatusOr<v1::ListSequencesResponse> ListSequences(const v1::ListSequencesRequest& req) = 0;
  virtual absl::StatusOr<v1::ForkSequenceResponse> ForkSequence(const v1::ForkSequenceRequest& req) = 0;
  virtual absl::StatusOr<v1::ReadSequenceResponse> ReadSequence(const v1::ReadSequenceRequest& req) = 0;
};

// What every call carries: the tenant's token and the deadline of a call.
struct ChannelCallOptions {
  std::string token;
  absl::Duration timeout = absl::Seconds(10);
};

std::unique_ptr<NodeChannel> MakeGrpcNodeChannel(std::shared_ptr<grpc::Channel> channel, ChannelCallOptions o);
// `control` carries Lookup, Pin and Stats (the daemon's gRPC channel).
std::unique_ptr<NodeChannel> MakeUcxNodeChannel(std::unique_ptr<UcxRpcClient> ucx, std::shared_ptr<NodeChannel> control,
                                                ChannelCallOptions o);

// One daemon as the client knows it: its gRPC channel (always) and its UCX
// data plane (when it advertises one and use_ucx): connected on first use,
// reconnected at most every 10 s after a failure, meanwhile served by gRPC.
class NodeConnection {
 public:
  NodeConnection(std::string id, std::string grpc_address, std::string ucx_address,
                 std::shared_ptr<grpc::ChannelCredentials> creds, ChannelCallOptions o, bool use_ucx,
                 UcxLoopOptions loop);
  const std::string& id() const { return id_; }
  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& ucx_address() const { return ucx_address_; }
  // The channel for a call: UCX when up, else gRPC. Keep the pointer for the
  // call (a reconnect replaces the UCX channel; this one stays valid).
  std::shared_ptr<NodeChannel> Channel() ABSL_LOCKS_EXCLUDED(mu_);
  // The gRPC channel alone (control calls).
  NodeChannel& Grpc() { return *grpc_; }

  // The node answered device places with payloads: it cannot deliver into
  // this process's GPU memory (no GPU, another host); not asked again.
  std::atomic<bool> device_refused{false};
  // The node answered an Attend's device exchange with a refusal (no GPU,
  // another host, blocks its kernels do not take); not asked again.
  std::atomic<bool> attend_device_refused{false};

 private:
  const std::string id_, grpc_address_, ucx_address_;
  const ChannelCallOptions o_;
  const bool use_ucx_;
  const UcxLoopOptions loop_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<NodeChannel> grpc_;
  absl::Mutex mu_;
  std::shared_ptr<NodeChannel> ucx_ ABSL_GUARDED_BY(mu_);
  UcxRpcClient* ucx_client_ ABSL_GUARDED_BY(mu_) = nullptr;  // owned by ucx_
  absl::Time ucx_retry_after_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace kvring
