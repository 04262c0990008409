// NodeService: the gRPC face of a daemon. Each RPC authenticates the bearer
// token and hands the request to NodeCore; a bad request gets its status and
// the daemon keeps serving. Thread-safe.
#pragma once

#include "kvring.grpc.pb.h"
#include "kvring/control/node_core.h"

namespace kvring {

class NodeService final : public v1::Node::Service {
 public:
  explicit NodeService(NodeCore* core) : core_(core) {}
  grpc::Status Lookup(grpc::ServerContext* ctx, const v1::LookupRequest* req, v1::LookupResponse* resp) override;
  grpc::Status Put(grpc::ServerContext* ctx, const v1::PutRequest* req, v1::PutResponse* resp) override;
  grpc::Status Get(grpc::ServerContext* ctx, const v1::GetRequest* req, v1::GetResponse* resp) override;
  grpc::Status Pin(grpc::ServerContext* ctx, const v1::PinRequest* req, v1::PinResponse* resp) override;
  grpc::Status Attend(grpc::ServerContext* ctx, const v1::AttendRequest* req, v1::AttendResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::StatsRequest* req, v1::StatsResponse* resp) override;
  grpc::Status DeleteSequence(grpc::ServerContext* ctx, const v1::SequenceRequest* req,
                              v1::SequenceResponse* resp) override;
  grpc::Status TruncateSequence(grpc::ServerContext* ctx, const v1::SequenceRequest* req,
                                v1::SequenceResponse* resp) override;
  grpc::Status ForkSequence(grpc::ServerContext* ctx, const v1::ForkSequenceRequest* req,
                            v1::ForkSequenceResponse* resp) override;
  grpc::Status ReadSequence(grpc::ServerContext* ctx, const v1::ReadSequenceRequest* req,
                            v1::ReadSequenceResponse* resp) override;
  grpc::Status ListSequences(grpc::ServerContext* ctx, const v1::ListSequencesRequest* req,
                             v1::ListSequencesResponse* resp) override;

 private:
  NodeCore* core_;
};

}  // namespace kvring
