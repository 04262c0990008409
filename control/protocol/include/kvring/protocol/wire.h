// What client and server agree on besides the .proto: conversions between
// the wire messages and kvring's native types, the mapping of statuses to
// gRPC and back, tenant namespace resolution, and the wire's own rules for
// identifiers. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "kvring.pb.h"
#include "kvring/cache/block_key.h"
#include "kvring/layout/block_layout.h"

namespace kvring {

// Longest sequence id and namespace name the protocol carries.
inline constexpr uint32_t kMaxSequenceIdBytes = 256;
inline constexpr uint32_t kMaxNamespaceBytes = 256;
// A Get's device places (kvring.proto DevicePlace): at most this many
// allocations, each named by a CUDA IPC handle of kIpcHandleBytes bytes
// (sizeof(cudaIpcMemHandle_t)).
inline constexpr int kMaxGetDeviceAllocations = 16;
inline constexpr size_t kIpcHandleBytes = 64;
// An Attend's device exchange (kvring.proto DeviceExchange): every region's
// offset is a multiple of this.
inline constexpr uint64_t kDeviceExchangeAlign = 256;

// INVALID_ARGUMENT naming what is wrong with the layout (dtype code, ranges).
absl::StatusOr<BlockLayout> LayoutFromProto(const v1::Layout& l);
void LayoutToProto(const BlockLayout& l, v1::Layout* out);
BlockKey KeyFromProto(const v1::Key& k);
void KeyToProto(const BlockKey& k, v1::Key* out);

// absl::Status <-> the wire's Status message and gRPC's status.
absl::Status StatusFromProto(const v1::Status& s);
void StatusToProto(const absl::Status& s, v1::Status* out);
grpc::Status ToGrpc(const absl::Status& s);
absl::Status FromGrpc(const grpc::Status& s);

// A sequence id is 1..kMaxSequenceIdBytes bytes of printable ASCII without
// '/' (it is part of placement hashes and metadata keys).
absl::Status ValidateSequenceId(const std::string& id, uint32_t max_bytes = kMaxSequenceIdBytes);

// The namespace a request acts in: the tenant's own (requested empty or equal
// to it) or one of its shared namespaces; PERMISSION_DENIED otherwise.
absl::StatusOr<std::string> ResolveNamespace(const v1::Tenant& tenant, const std::string& requested);

// A tenant's own namespace: "tenant/<id>". Ids are never reused, so neither
// is a namespace.
std::string TenantNamespace(uint32_t tenant_id);

}  // namespace kvring
