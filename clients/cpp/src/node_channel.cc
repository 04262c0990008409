#include "node_channel.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "kvring/common/logging.h"
#include "kvring/common/status_macros.h"
#include "kvring/protocol/ucx_methods.h"
#include "kvring/protocol/wire.h"

namespace kvring {
namespace {

class GrpcNodeChannel final : public NodeChannel {
 public:
  GrpcNodeChannel(std::shared_ptr<grpc::Channel> ch, ChannelCallOptions o)
      : stub_(v1::Node::NewStub(ch)), o_(std::move(o)) {}

  bool payloads_beside() const override { return false; }

  absl::StatusOr<v1::PutResponse> Put(v1::PutRequest req, ByteSpans payloads) override {
    if (payloads.size() != static_cast<size_t>(req.blocks_size())) {
      return absl::InvalidArgumentError("Put: one payload per block");
    }
    for (int i = 0; i < req.blocks_size(); ++i) {
      req.mutable_blocks(i)->set_payload(reinterpret_cast<const char*>(payloads[i].data()), payloads[i].size());
    }
    v1::PutResponse resp;
    auto ctx = Context(o_.timeout);
    if (grpc::Status s = stub_->Put(ctx.get(), req, &resp); !s.ok()) return FromGrpc(s);
    return resp;
  }

  absl::StatusOr<GetReply> Get(const v1::GetRequest& req, absl::Span<uint8_t>) override {
    GetReply r;
    auto ctx = Context(o_.timeout);
    if (grpc::Status s = stub_->Get(ctx.get(), req, &r.resp); !s.ok()) return FromGrpc(s);
    return r;
  }

  absl::StatusOr<v1::AttendResponse> Attend(v1::AttendRequest req, ByteSpans queries, ByteSpans new_k, ByteSpans new_v,
                                            absl::Span<uint8_t> reply) override {
    auto cat = [](ByteSpans ps, std::string* dst) {
      size_t n = 0;
      for (const auto& p : ps) n += p.size();
      dst->reserve(n);
      for (const auto& p : ps) dst->append(reinterpret_cast<const char*>(p.data()), p.size());
    };
    cat(queries, req.mutable_queries());
    cat(new_k, req.mutable_new_k());
    cat(new_v, req.mutable_new_v());
    v1::AttendResponse resp;
    auto ctx = Context(o_.timeout);
    if (grpc::Status s = stub_->Attend(ctx.get(), req, &resp); !s.ok()) return FromGrpc(s);
    if (resp.out().size() + resp.lse().size() != reply.size()) {
      return absl::DataLossError("Attend reply has the wrong size");
    }
    std::memcpy(reply.data(), resp.out().data(), resp.out().size());
    std::memcpy(reply.data() + resp.out().size(), resp.lse().data(), resp.lse().size());
    resp.clear_out();
    resp.clear_lse();
    return resp;
  }

  absl::StatusOr<v1::LookupResponse> Lookup(const v1::LookupRequest& req) override {
    v1::LookupResponse resp;
    auto ctx = Context(o_.timeout);
    if (grpc::Status s = stub_->Lookup(ctx.get(), req, &resp); !s.ok()) return FromGrpc(s);
    return resp;
  }

  absl::StatusOr<v1::PinResponse> Pin(const v1::PinRequest& req) override {
    v1::PinResponse resp;
    auto ctx = Context(o_.timeout);
    if (grpc::Status s = stub_->Pin(ctx.get(), req, &resp); !s.ok()) return FromGrpc(s);
    return resp;
  }

  absl::StatusOr<v1::StatsResponse> Stats(const v1::StatsRequest& req, absl::Duration timeout) override {
    v1::StatsResponse resp;
    auto ctx = Context(timeout);
    if (grpc::Status s = stub_->Stats(ctx.get(), req, &resp); !s.ok()) return FromGrpc(s);
    return resp;
  }

  absl::StatusOr<v1::SequenceResponse> Sequence(const v1::SequenceRequest& req, bool truncate) override {
    v1::SequenceResponse resp;
    auto ctx = Context(o_.timeout);
    grpc::Status s =
        truncate ? stub_->TruncateSequence(ctx.get(), req, &resp) : stub_->DeleteSequence(ctx.get(), req, &resp);
    if (!s.ok()) return FromGrpc(s);
    return resp;
  }

  absl::StatusOr<v1::ListSequencesResponse> ListSequences(const v1::ListSequencesRequest& req) override {
    v1::ListSequencesResponse resp;
    auto ctx = Context(o_.timeout);
    if (grpc::Status s = stub_->ListSequences(ctx.get(), req, &resp); !s.ok()) return FromGrpc(s);
    return resp;
  }

  absl::StatusOr<v1::ForkSequenceResponse> ForkSequence(const v1::ForkSequenceRequest& req) override {
    v1::ForkSequenceResponse resp;
    auto ctx = Context(o_.timeout);
    if (grpc::Status s = stub_->ForkSequence(ctx.get(), req, &resp); !s.ok()) return FromGrpc(s);
    return resp;
  }

  absl::StatusOr<v1::ReadSequenceResponse> ReadSequence(const v1::ReadSequenceRequest& req) override {
    v1::ReadSequenceResponse resp;
    auto ctx = Context(o_.timeout);
    if (grpc::Status s = stub_->ReadSequence(ctx.get(), req, &resp); !s.ok()) return FromGrpc(s);
    return resp;
  }

 private:
  std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", "Bearer " + o_.token);
    ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
    return ctx;
  }

  std::unique_ptr<v1::Node::Stub> stub_;
  const ChannelCallOptions o_;
};

class UcxNodeChannel final : public NodeChannel {
 public:
  UcxNodeChannel(std::unique_ptr<UcxRpcClient> ucx, std::shared_ptr<NodeChannel> control, ChannelCallOptions o)
      : ucx_(std::move(ucx)), control_(std::move(control)), o_(std::move(o)) {}

  bool payloads_beside() const override { return true; }

  absl::StatusOr<v1::PutResponse> Put(v1::PutRequest req, ByteSpans payloads) override {
    KVRING_ASSIGN_OR_RETURN(UcxReply r, Call(kUcxMethodPut, req.SerializeAsString(), payloads, {}));
    v1::PutResponse resp;
    if (!resp.ParseFromString(r.meta)) return absl::DataLossError("bad UCX Put reply");
    return resp;
  }

  absl::StatusOr<GetReply> Get(const v1::GetRequest& req, absl::Span<uint8_t> into) override {
    KVRING_ASSIGN_OR_RETURN(UcxReply r, Call(kUcxMethodGet, req.SerializeAsString(), {}, into));
    GetReply g;
    if (!g.resp.ParseFromString(r.meta)) return absl::DataLossError("bad UCX Get reply");
    g.bulk_reply = true;
    g.in_into = r.payload_in_buffer;
    g.bulk_size = r.payload_size;
    if (!r.payload_in_buffer) g.bulk = std::move(r.payload);
    return g;
  }

  absl::StatusOr<v1::AttendResponse> Attend(v1::AttendRequest req, ByteSpans queries, ByteSpans new_k, ByteSpans new_v,
                                            absl::Span<uint8_t> reply) override {
    KVRING_ASSIGN_OR_RETURN(UcxReply r,
                            Call(kUcxMethodAttend, req.SerializeAsString(), Concat(queries, new_k, new_v), reply));
    return AttendReply(std::move(r), reply);
  }

  std::unique_ptr<PendingAttend> StartAttend(const v1::AttendRequest& req, ByteSpans queries, ByteSpans new_k,
                                             ByteSpans new_v, absl::Span<uint8_t> reply) override {
    class Pending final : public PendingAttend {
     public:
      Pending(UcxNodeChannel* ch, absl::StatusOr<UcxPendingCall> call, absl::Span<uint8_t> reply)
          : ch_(ch), call_(std::move(call)), reply_(reply) {}
      absl::StatusOr<v1::AttendResponse> Wait() override {
        if (!call_.ok()) return call_.status();
        absl::StatusOr<UcxReply> r = ch_->ucx_->Finish(std::move(*call_), ch_->o_.timeout);
        call_ = absl::FailedPreconditionError("PendingAttend::Wait called twice");
        if (!r.ok()) return r.status();
        if (!r->status.ok()) return r->status;
        return AttendReply(std::move(*r), reply_);
      }

     private:
      UcxNodeChannel* ch_;  // outlives this: the caller holds the channel for the call
      absl::StatusOr<UcxPendingCall> call_;
      absl::Span<uint8_t> reply_;
    };
    return std::make_unique<Pending>(
        this, ucx_->Start(kUcxMethodAttend, o_.token, req.SerializeAsString(), Concat(queries, new_k, new_v), reply),
        reply);
  }

  absl::StatusOr<v1::LookupResponse> Lookup(const v1::LookupRequest& req) override { return control_->Lookup(req); }
  absl::StatusOr<v1::PinResponse> Pin(const v1::PinRequest& req) override { return control_->Pin(req); }
  absl::StatusOr<v1::StatsResponse> Stats(const v1::StatsRequest& req, absl::Duration timeout) override {
    return control_->Stats(req, timeout);
  }
  absl::StatusOr<v1::SequenceResponse> Sequence(const v1::SequenceRequest& req, bool truncate) override {
    return control_->Sequence(req, truncate);
  }
  absl::StatusOr<v1::ListSequencesResponse> ListSequences(const v1::ListSequencesRequest& req) override {
    return control_->ListSequences(req);
  }
  absl::StatusOr<v1::ForkSequenceResponse> ForkSequence(const v1::ForkSequenceRequest& req) override {
    return control_->ForkSequence(req);
  }
  absl::StatusOr<v1::ReadSequenceResponse> ReadSequence(const v1::ReadSequenceRequest& req) override {
    return control_->ReadSequence(req);
  }

 private:
  // Transport failures are the status; so is the daemon's refusal.
  absl::StatusOr<UcxReply> Call(uint32_t method, const std::string& meta, ByteSpans payload, absl::Span<uint8_t> into) {
    absl::StatusOr<UcxReply> r = ucx_->Call(method, o_.token, meta, payload, into, o_.timeout);
    if (!r.ok()) return r.status();
    if (!r->status.ok()) return r->status;
    return r;
  }

  static std::vector<absl::Span<const uint8_t>> Concat(ByteSpans queries, ByteSpans new_k, ByteSpans new_v) {
    std::vector<absl::Span<const uint8_t>> all;
    all.reserve(queries.size() + new_k.size() + new_v.size());
    all.insert(all.end(), queries.begin(), queries.end());
    all.insert(all.end(), new_k.begin(), new_k.end());
    all.insert(all.end(), new_v.begin(), new_v.end());
    return all;
  }
  static absl::StatusOr<v1::AttendResponse> AttendReply(UcxReply r, absl::Span<uint8_t> reply) {
    v1::AttendResponse resp;
    if (!resp.ParseFromString(r.meta)) return absl::DataLossError("bad UCX Attend reply");
    if (r.payload_size != reply.size()) return absl::DataLossError("UCX Attend reply has the wrong size");
    if (!r.payload_in_buffer) std::memcpy(reply.data(), r.payload.data(), reply.size());
    return resp;
  }

  std::unique_ptr<UcxRpcClient> ucx_;
  std::shared_ptr<NodeChannel> control_;
  const ChannelCallOptions o_;
};

}  // namespace

std::unique_ptr<NodeChannel> MakeGrpcNodeChannel(std::shared_ptr<grpc::Channel> channel, ChannelCallOptions o) {
  return std::make_unique<GrpcNodeChannel>(std::move(channel), std::move(o));
}

std::unique_ptr<NodeChannel> MakeUcxNodeChannel(std::unique_ptr<UcxRpcClient> ucx, std::shared_ptr<NodeChannel> control,
                                                ChannelCallOptions o) {
  return std::make_unique<UcxNodeChannel>(std::move(ucx), std::move(control), std::move(o));
}

NodeConnection::NodeConnection(std::string id, std::string grpc_address, std::string ucx_address,
                               std::shared_ptr<grpc::ChannelCredentials> creds, ChannelCallOptions o, bool use_ucx,
                               UcxLoopOptions loop)
    : id_(std::move(id)),
      grpc_address_(std::move(grpc_address)),
      ucx_address_(std::move(ucx_address)),
      o_(std::move(o)),
      use_ucx_(use_ucx),
      loop_(loop) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  channel_ = grpc::CreateCustomChannel(grpc_address_, creds, args);
  grpc_ = MakeGrpcNodeChannel(channel_, o_);
}

std::shared_ptr<NodeChannel> NodeConnection::Channel() {
  if (!use_ucx_ || ucx_address_.empty()) return grpc_;
  absl::MutexLock l(&mu_);
  if (ucx_ != nullptr && ucx_client_->connected()) return ucx_;
  // Down, or never connected: (re)connect, but not more often than every
  // 10 s; meanwhile the node is served over gRPC.
  if (absl::Now() < ucx_retry_after_) return grpc_;
  ucx_.reset();
  ucx_client_ = nullptr;
  // The daemon's gRPC channel doubles as the liveness signal for UCX calls.
  std::shared_ptr<grpc::Channel> ch = channel_;
  auto c = UcxRpcClient::Connect(
      ucx_address_, absl::Seconds(2),
      [ch] {
        // try_to_connect: a dropped connection goes IDLE; reconnecting to a dead
        // daemon turns it TRANSIENT_FAILURE within milliseconds.
        const grpc_connectivity_state s = ch->GetState(/*try_to_connect=*/true);
        return s != GRPC_CHANNEL_TRANSIENT_FAILURE && s != GRPC_CHANNEL_SHUTDOWN;
      },
      loop_);
  if (!c.ok()) {
    KVRING_LOG(WARNING) << "UCX to " << id_ << " failed (" << c.status().message() << "); using gRPC payloads";
    ucx_retry_after_ = absl::Now() + absl::Seconds(10);
    return grpc_;
  }
  ucx_client_ = c->get();
  ucx_ = MakeUcxNodeChannel(std::move(*c), grpc_, o_);
  return ucx_;
}

}  // namespace kvring
