// How a block's payload encodes its K and V: plain (the layout's dtype) or
// quantized with per-block scales. Shared by host and device code.
//
// Quantized payload = codes (1 byte per element, in the block layout order
// [layer][K|V][kv_head][token][head_dim]) followed by fp32 scales:
//   kPerHead:    one scale per (layer, K|V, kv_head)            -> layers*2*kv_heads
//   kPerToken:   one per (layer, K|V, kv_head, token)           -> layers*2*kv_heads*block_tokens
//   kKChannelVToken: K per (layer, kv_head, channel), V per (layer, kv_head, token)
//                (KIVI's split: K has outlier channels, V does not)
//                -> layers*kv_heads*(head_dim + block_tokens)
// Scales are stored K then V within a layer: for kKChannelVToken the order is
// [layer][kv_head][head_dim] K scales then [layer][kv_head][token] V scales,
// both regions per layer: [layer]{ K: [kv_head][head_dim], V: [kv_head][token] }.
// A code c decodes to c * scale (int8: c in [-127, 127]; fp8: e4m3, max 448).
// Kernels template on KvCodec and ScaleMode and index scales through
// ScaleIndexAs (callable from device code), so this header is the one
// description of a quantized block on the host and the device.
#pragma once

#include <cstdint>

#include "kvring/layout/block_layout.h"

#if defined(__CUDACC__)
#define KVRING_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVRING_HOST_DEVICE inline
#endif

namespace kvring {

enum class KvCodec : uint8_t { kPlain = 0, kInt8 = 1, kFp8E4M3 = 2 };
enum class ScaleMode : uint8_t { kPerHead = 0, kPerToken = 1, kKChannelVToken = 2 };

struct KvEncoding {
  KvCodec codec = KvCodec::kPlain;
  ScaleMode scales = ScaleMode::kPerHead;

  constexpr bool quantized() const { return codec != KvCodec::kPlain; }
  // One byte: codec in the low nibble, scale mode in the high nibble.
  constexpr uint8_t Pack() const {
    return static_cast<uint8_t>(static_cast<uint8_t>(codec) | (static_cast<uint8_t>(scales) << 4));
  }
  static constexpr bool Unpack(uint8_t b, KvEncoding* out) {
    const uint8_t c = b & 0xf, s = b >> 4;
    if (c > 2 || s > 2) return false;
    out->codec = static_cast<KvCodec>(c);
    out->scales = static_cast<ScaleMode>(s);
    return true;
  }
  friend constexpr bool operator==(const KvEncoding& a, const KvEncoding& b) {
    return a.codec == b.codec && (a.codec == KvCodec::kPlain || a.scales == b.scales);
  }
};

constexpr uint64_t ScaleCount(const BlockLayout& l, ScaleMode m) {
  switch (m) {
    case ScaleMode::kPerHead:
      return uint64_t{l.layers} * 2 * l.kv_heads;
    case ScaleMode::kPerToken:
      return uint64_t{l.layers} * 2 * l.kv_heads * l.block_tokens;
    case ScaleMode::kKChannelVToken:
      return uint64_t{l.layers} * l.kv_heads * (l.head_dim + l.block_tokens);
  }
  return 0;
}

// Bytes of a block of layout `l` in encoding `e`.
constexpr uint64_t EncodedBytes(const BlockLayout& l, KvEncoding e) {
  if (!e.quantized()) return l.bytes();
  return l.elements() + 4 * ScaleCount(l, e.scales);
}

// Index (in floats, from the start of the scale region) of the scale that
// applies to element (layer, kv: 0 = K / 1 = V, head, token, dim) of a block
// with `kv_heads`, `block_tokens` and `head_dim`, computed in the integer
// type I. Device code uses a 32-bit I: a page's scale count fits (the
// kernels' CheckViews bounds a page below 2^31 bytes).
template <typename I>
KVRING_HOST_DEVICE constexpr I ScaleIndexAs(I kv_heads, I block_tokens, I head_dim, ScaleMode m, I layer, I kv, I head,
                                            I token, I dim) {
  switch (m) {
    case ScaleMode::kPerHead:
      return (layer * 2 + kv) * kv_heads + head;
    case ScaleMode::kPerToken:
      return ((layer * 2 + kv) * kv_heads + head) * block_tokens + token;
    case ScaleMode::kKChannelVToken: {
      const I base = layer * kv_heads * (head_dim + block_tokens);
      return kv == 0 ? base + head * head_dim + dim : base + kv_heads * head_dim + head * block_tokens + token;
    }
  }
  return 0;
}

constexpr uint64_t ScaleIndex(const BlockLayout& l, ScaleMode m, uint32_t layer, uint32_t kv, uint32_t head,
                              uint32_t token, uint32_t dim) {
  return ScaleIndexAs<uint64_t>(l.kv_heads, l.block_tokens, l.head_dim, m, layer, kv, head, token, dim);
}

}  // namespace kvring
