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

namespace kvring {

struct RequestLimits {
  uint32_t max_keys = 1u << 16;          // per Lookup / Get / Pin
  uint32_t max_blocks_per_put = 1024;
  uint64_t max_payload_bytes = 64ull << 20;  // per block (the daemon sets its page size)
  uint64_t max_request_bytes = 512ull << 20;
  uint32_t max_attend_rows = 4096;
  uint32_t max_attend_blocks = 1u << 20;
  uint32_t max_sequence_id_bytes = 256;
  uint32_t max_namespace_bytes = 256;
};

absl::Status ValidateHeader(const v1::RequestHeader& h, const RequestLimits& limits);
absl::StatusOr<BlockLayout> LayoutFromProto(const v1::Layout& l);
void LayoutToProto(const BlockLayout& l, v1::Layout* out);
BlockKey KeyFromProto(const v1::Key& k);
void KeyToProto(const BlockKey& k, v1::Key* out);
absl::Status ValidateKeys(const google::protobuf::RepeatedPtrField<v1::Key>& keys, const RequestLimits& limits);
absl::Status ValidateSequenceId(const std::string& id, const RequestLimits& limits);

// A block of a Put: header fields, sizes, and (unless it travels separately,
// `payload_external`) that the payload has exactly payload_bytes bytes.
// On success fills `meta` (layout, encoding, size, checksum).
absl::Status ValidatePutBlock(const v1::PutBlock& b, const RequestLimits& limits, bool payload_external,
                              BlockMeta* meta);
absl::Status ValidatePutRequest(const v1::PutRequest& r, const RequestLimits& limits, bool payload_external);

// Shapes, dtype, sizes and index lists of an Attend.
absl::Status ValidateAttendRequest(const v1::AttendRequest& r, const RequestLimits& limits);

}  // namespace kvring
