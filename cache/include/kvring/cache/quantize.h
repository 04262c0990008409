// Quantized KV blocks: int8 and fp8-e4m3 codes with fp32 scales per group
// (kv_encoding.h gives the payload layout and the scale modes). A block is
// quantized once, at Put time, when the tenant or the request asks for it;
// attention reads the codes directly (PartialAttention on the CPU and the
// CUDA decode kernel dequantize in their inner loops).
//
// Scales are symmetric absmax: scale = max|x| / qmax over the group (qmax
// 127 for int8, 448 for e4m3), code = round(x / scale) saturated to the code
// range; a group of zeros gets scale 1. Errors: INVALID_ARGUMENT for a
// non-finite input value (NaN/Inf are never encoded), a layout that is not
// plain f32/f16/bf16, or a payload of the wrong size. Pure functions;
// thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvring/layout/block_layout.h"
#include "kvring/layout/kv_encoding.h"

namespace kvring {

absl::Status QuantizeBlock(const BlockLayout& layout, absl::Span<const uint8_t> plain, KvEncoding encoding,
                           std::vector<uint8_t>* out);
// Back to the layout's dtype (for clients and tests).
absl::Status DequantizeBlock(const BlockLayout& layout, KvEncoding encoding, absl::Span<const uint8_t> encoded,
                             std::vector<uint8_t>* plain);
// Element e (layout order) of a plain block as float.
float PlainElement(const BlockLayout& layout, const uint8_t* data, uint64_t e);

// Parses "int8", "fp8", with an optional "/per-head", "/per-token" or
// "/kivi" (K per channel, V per token); "none" or "" is plain.
absl::Status ParseKvEncoding(std::string_view text, KvEncoding* out);
std::string KvEncodingName(KvEncoding e);

}  // namespace kvring
