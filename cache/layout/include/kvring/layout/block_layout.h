// The shape and byte layout of one KV block, shared by host and device code.
//
// A block holds the keys and values of `block_tokens` consecutive tokens for
// `layers` layers, laid out row-major as
//     [layer][K|V][kv_head][token][head_dim]
// in `dtype`. Plain value type; every member is constexpr and usable from
// CUDA device code. IsValid() checks the limits kvring accepts at its
// boundaries.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvring {

enum class DType : uint8_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kFP8E4M3 = 3,  // only as a quantized encoding, see kv_encoding.h
  kINT8 = 4,     // only as a quantized encoding, see kv_encoding.h
};

constexpr uint32_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kFP8E4M3:
      return 1;
    case DType::kINT8:
      return 1;
  }
  return 0;
}

constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kFP8E4M3:
      return "fp8e4m3";
    case DType::kINT8:
      return "int8";
  }
  return "invalid";
}

// True for the dtypes an engine's KV comes in (fp32/fp16/bf16).
constexpr bool IsFloatKvDType(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

// Limits accepted at kvring's boundaries.
inline constexpr uint32_t kMinBlockTokens = 1;
inline constexpr uint32_t kMaxBlockTokens = 256;
inline constexpr uint32_t kMaxLayers = 256;
inline constexpr uint32_t kMaxKvHeads = 256;
inline constexpr uint32_t kMaxHeadDim = 512;
inline constexpr uint64_t kMaxBlockBytes = 64ull << 20;
// Longest attention sequence (positions fit the kernels' int32).
inline constexpr uint64_t kMaxSequenceTokens = 1ull << 30;

struct BlockLayout {
  uint32_t block_tokens = 16;
  uint32_t layers = 1;
  uint32_t kv_heads = 8;
  uint32_t head_dim = 128;
  DType dtype = DType::kBF16;

  // Elements of one [token][head_dim] plane (one layer, K or V, one head).
  constexpr uint64_t plane_elems() const { return uint64_t{block_tokens} * head_dim; }
  // Elements of the whole block (K and V, all layers and heads).
  constexpr uint64_t elements() const { return uint64_t{layers} * 2 * kv_heads * plane_elems(); }
  // Bytes of the block in `dtype`.
  constexpr uint64_t bytes() const { return elements() * DTypeSize(dtype); }
  // Bytes of one token's K (or V) on one layer, all heads, in `dtype`: a row
  // of the K / V an engine appends.
  constexpr uint64_t kv_row_bytes() const { return uint64_t{kv_heads} * head_dim * DTypeSize(dtype); }
  // Element index of (layer, kv: 0 = K / 1 = V, head, token, dim).
  constexpr uint64_t index(uint32_t layer, uint32_t kv, uint32_t head, uint32_t token, uint32_t dim) const {
    return (((uint64_t{layer} * 2 + kv) * kv_heads + head) * block_tokens + token) * head_dim + dim;
  }
  // Element index of the first element of the (layer, kv, head) plane.
  constexpr uint64_t plane_index(uint32_t layer, uint32_t kv, uint32_t head) const {
    return ((uint64_t{layer} * 2 + kv) * kv_heads + head) * plane_elems();
  }

  // False with a static reason in *why when a field is out of range.
  constexpr bool IsValid(const char** why) const {
    const char* reason = nullptr;
    if (block_tokens < kMinBlockTokens || block_tokens > kMaxBlockTokens)
      reason = "block_tokens must be in [1, 256]";
    else if (layers == 0 || layers > kMaxLayers)
      reason = "layers must be in [1, 256]";
    else if (kv_heads == 0 || kv_heads > kMaxKvHeads)
      reason = "kv_heads must be in [1, 256]";
    else if (head_dim == 0 || head_dim > kMaxHeadDim || head_dim % 8 != 0)
      reason = "head_dim must be a multiple of 8 in [8, 512]";
    else if (!IsFloatKvDType(dtype))
      reason = "dtype must be f32, f16 or bf16";
    else if (bytes() > kMaxBlockBytes)
      reason = "block is larger than 64 MiB";
    if (why != nullptr) *why = reason;
    return reason == nullptr;
  }

  friend constexpr bool operator==(const BlockLayout& a, const BlockLayout& b) {
    return a.block_tokens == b.block_tokens && a.layers == b.layers && a.kv_heads == b.kv_heads &&
           a.head_dim == b.head_dim && a.dtype == b.dtype;
  }
};

}  // namespace kvring
