// Validation of every request a daemon accepts, before any of it is used.
// Pure functions of the message and the limits: the fuzz targets call them
// on arbitrary bytes. Errors are INVALID_ARGUMENT (or FAILED_PRECONDITION for
// a protocol version) with a message naming the field.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "kvring.pb.h"
#include "kvring/cache/block_key.h"
#include "kvring/cache/block_meta.h"
#include "kvring/control/attend_batch.h"
#include "kvring/protocol/wire.h"

namespace kvring {

struct RequestLimits {
  uint32_t max_keys = 1u << 16;  // per Lookup / Get / Pin
  uint32_t max_blocks_per_put = 1024;
  uint64_t max_payload_bytes = 64ull << 20;  // per block (the daemon sets its page size)
  uint64_t max_request_bytes = 512ull << 20;
  uint32_t max_attend_rows = 4096;
  uint32_t max_attend_blocks = 1u << 20;  // blocks over all ranges of one Attend
  uint32_t max_attend_sequences = 1024;   // sequences in one Attend
  uint32_t max_sequence_id_bytes = kMaxSequenceIdBytes;
  uint32_t max_namespace_bytes = kMaxNamespaceBytes;
  // Refuse an Attend whose appended K/V (host bytes: inline or over UCX)
  // holds a NaN or an infinity: one such token would poison every later
  // step of its sequence (NaN K gives O = 0, Inf V gives O = inf). Costs one
  // pass over the appended bytes (a decode step's few KB; measured in
  // bench/RESULTS.md). Appends read from a caller's GPU memory (device
  // exchange) are not checked. Default: true.
  bool finite_appends = true;
};

// The first non-finite value of `bytes` read as `dtype` (f32, f16, bf16):
// its element index, or -1 when every value is finite.
int64_t FirstNonFinite(absl::Span<const uint8_t> bytes, DType dtype);

absl::Status ValidateHeader(const v1::RequestHeader& h, const RequestLimits& limits);
absl::Status ValidateKeys(const google::protobuf::RepeatedPtrField<v1::Key>& keys, const RequestLimits& limits);
absl::Status ValidateKeys(absl::Span<const BlockKey> keys, const RequestLimits& limits);

// A Get's device places (kvring.proto DevicePlace), when it has any: one per
// key, each naming one of at most kMaxGetDeviceAllocations allocations (wire.h),
// each handle kIpcHandleBytes long, a host id of at most 64 bytes. Where a
// place lands inside the allocation is checked by the node that maps it.
absl::Status ValidateDevicePlaces(const v1::GetRequest& r);

// A block of a Put: header fields, sizes, and (unless it travels separately,
// `payload_external`) that the payload has exactly payload_bytes bytes.
// On success fills `meta` (layout, encoding, size, checksum).
absl::Status ValidatePutBlock(const v1::PutBlock& b, const RequestLimits& limits, bool payload_external,
                              BlockMeta* meta);
absl::Status ValidatePutRequest(const v1::PutRequest& r, const RequestLimits& limits, bool payload_external);

// Parses and validates an Attend: shapes, dtypes, sizes, row and append
// counts, block ranges (sorted, disjoint, within the sequence's tokens),
// positions, one entry per sequence. The bulk bytes come from the message's
// own fields unless `external` is set (the UCX payload, cut by the sizes the
// message declares: queries || new_k || new_v). The result views the message
// (or `external`), which must outlive it.
absl::StatusOr<AttendBatch> ParseAttendRequest(const v1::AttendRequest& r, const RequestLimits& limits,
                                               std::optional<absl::Span<const uint8_t>> external = std::nullopt);
// The bytes ParseAttendRequest cuts from an external payload: queries, new_k
// and new_v (each 0 when the message does not declare them).
struct AttendPayloadSizes {
  uint64_t queries = 0, new_k = 0, new_v = 0;
};
AttendPayloadSizes AttendPayloadSizesOf(const v1::AttendRequest& r);

}  // namespace kvring
