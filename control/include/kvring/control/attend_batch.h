// AttendBatch: a batched, appending Attend in kvring's native types, as the
// node core takes it (the gRPC and UCX faces parse the wire request into it,
// request_validation.h). Views: the spans point into the request's buffers,
// which must outlive the batch.
//
// Rows are grouped by sequence in the order of `sequences`; appended K/V rows
// likewise. The output of a batch is [num_rows, q_heads, head_dim] fp32 and
// [num_rows, q_heads] fp32 LSE (natural log), rows in the same order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvring/attention/step/step_shape.h"
#include "kvring/attention/tensors.h"
#include "kvring/layout/block_layout.h"

namespace kvring {

struct AttendSequenceSpec {
  std::string sequence_id;
  std::vector<BlockRange> ranges;  // sorted, disjoint, non-empty
  uint64_t tokens = 0;             // tokens on the layer once the append is applied
  uint32_t rows = 0;               // query rows (0: append only)
  uint32_t append_tokens = 0;
  uint64_t append_position = 0;
  uint64_t placement_digest = 0;  // of the placement the caller routed by (0: the sequence's own)
};

// A batch whose queries, appended K/V and output are in a same-host
// caller's GPU memory, mapped into this process (kvring.proto
// DeviceExchange; the wire layer maps and range-checks them). Device
// pointers, valid for the call; `read` copies device bytes to the host (a
// retried append compares its tokens with those held).
struct AttendDeviceIo {
  const uint8_t* queries = nullptr;  // [num_rows, q_heads, head_dim] in q_dtype
  const uint8_t* new_k = nullptr;    // [append rows, kv_heads, head_dim] in layout->dtype
  const uint8_t* new_v = nullptr;
  float* out = nullptr;  // [num_rows, q_heads, head_dim]
  float* lse = nullptr;  // [num_rows, q_heads]
  // A cudaEvent_t (opened here) that completes once the caller's inputs are
  // written, or null (they were when the request came). Device work that
  // reads them waits for it on its stream; `read` waits for it.
  void* inputs_ready = nullptr;
  std::function<absl::Status(const uint8_t* device_src, absl::Span<uint8_t> dst)> read;
  // The caller's stream waits for the step's work (inputs_ready set): a
  // backend may return once the work is queued (StepTimes::done_event),
  // holding `keepalive` (the mapped memory and event) until it completes.
  bool reply_when_queued = false;
  // With reply_when_queued: a 32-bit word in the caller's memory that the
  // backend's stream sets to done_flag_value once the work is done
  // (StepTimes::done_flag), or null: an event instead.
  uint32_t* done_flag = nullptr;
  uint32_t done_flag_value = 0;
  std::shared_ptr<void> keepalive;
};

struct AttendBatch {
  StepShape shape;                    // rows, heads, q_dtype, layer, scale, causal, window
  absl::Span<const uint8_t> queries;  // [num_rows, q_heads, head_dim] in q_dtype
  std::vector<int64_t> positions;     // [num_rows]
  std::vector<AttendSequenceSpec> sequences;
  std::optional<BlockLayout> layout;       // required when appending
  absl::Span<const uint8_t> new_k, new_v;  // [append rows, kv_heads, head_dim] in layout->dtype
  // Set: queries/new_k/new_v are empty and the bytes are on the device
  // (the output too: the node core writes nothing into its host output).
  const AttendDeviceIo* device = nullptr;
  // What blocks this batch's appends complete are stored as (the request's
  // quantize; unset: the tenant's kv_encoding). A sequence with full blocks
  // on the node keeps their encoding.
  std::optional<KvEncoding> quantize;

  uint32_t append_rows() const {
    uint32_t n = 0;
    for (const auto& s : sequences) n += s.append_tokens;
    return n;
  }
};

// What the node reports about one Attend beside its output.
struct AttendStats {
  uint32_t blocks_used = 0;
  uint32_t appended_tokens = 0;
  uint32_t completed_blocks = 0;
  double compute_seconds = 0;  // the core's whole handling of the request
  double kernel_seconds = 0;   // the attention computation
  double copy_seconds = 0;     // staging and host<->device copies (GPU backends)
  std::string backend;
  // Per sequence of the batch, in order: OK, or why this node did not serve it.
  std::vector<absl::Status> sequence_status;
  // A device batch this node will not run (it did nothing): why.
  std::string device_refusal;
  // The step's device work was still queued when the node answered: a
  // cudaIpcEventHandle_t that completes with it (AttendResponse.done_event).
  std::string done_event;
  bool done_flag = false;  // or: the caller's word (AttendDeviceIo::done_flag) is set when it is
};

}  // namespace kvring
