// The wire side of NodeCore's calls, shared by the daemon's two faces (gRPC:
// NodeService; UCX: UcxDataPlane). Each function checks the message's
// version and shape, parses it into the core's types (node_core.h), calls
// the core and writes the reply message; the core never sees a protobuf.
// Put's payloads arrive inline or beside the message (`external`, UCX: one
// span per block); Get's go inline in the reply, or (`held` non-null, UCX)
// stay held in the store for a zero-copy send.
//
// Errors: the request's status (malformed, unauthorized namespace, ...);
// per-block outcomes go into the reply. Thread-safe as the core is.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvring.pb.h"
#include "kvring/control/node_core.h"

namespace kvring {

absl::Status WireLookup(NodeCore& core, const v1::Tenant& t, const v1::LookupRequest& req, v1::LookupResponse* resp);
absl::Status WirePut(NodeCore& core, const v1::Tenant& t, const v1::PutRequest& req,
                     absl::Span<const absl::Span<const uint8_t>> external, v1::PutResponse* resp);
absl::Status WireGet(NodeCore& core, const v1::Tenant& t, const v1::GetRequest& req, v1::GetResponse* resp,
                     std::vector<PinnedBlock>* held = nullptr);
// Whether WireGet would stay in host memory (NodeCore::GetStaysInMemory).
bool WireGetStaysInMemory(NodeCore& core, const v1::Tenant& t, const v1::GetRequest& req);
absl::Status WirePin(NodeCore& core, const v1::Tenant& t, const v1::PinRequest& req, v1::PinResponse* resp);
absl::Status WireListSequences(NodeCore& core, const v1::Tenant& t, const v1::ListSequencesRequest& req,
                               v1::ListSequencesResponse* resp);
// DeleteSequence (truncate = false) or TruncateSequence.
absl::Status WireSequence(NodeCore& core, const v1::Tenant& t, const v1::SequenceRequest& req, bool truncate,
                          v1::SequenceResponse* resp);
absl::Status WireForkSequence(NodeCore& core, const v1::Tenant& t, const v1::ForkSequenceRequest& req,
                              v1::ForkSequenceResponse* resp);
absl::Status WireReadSequence(NodeCore& core, const v1::Tenant& t, const v1::ReadSequenceRequest& req,
                              v1::ReadSequenceResponse* resp);
absl::Status WireStats(NodeCore& core, const v1::Tenant& t, const v1::StatsRequest& req, v1::StatsResponse* resp);
// Runs a parsed Attend (request_validation.h's ParseAttendRequest) on the
// core and fills the response's header fields. The caller owns `out`, sized
// for the batch; unused with a device exchange, whose output goes to the
// caller's GPU memory, or whose refusal goes into resp->device_refusal.
absl::Status WireAttend(NodeCore& core, const v1::Tenant& t, const v1::AttendRequest& req, const AttendBatch& batch,
                        v1::AttendResponse* resp, PartialOutput out);

}  // namespace kvring
