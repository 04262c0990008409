#include "kvring/cache/quantize.h"

#include "kvring/common/quote.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kvring/layout/float_convert.h"
#include "kvring/layout/fp8.h"

namespace kvring {

float PlainElement(const BlockLayout& l, const uint8_t* d, uint64_t e) {
  switch (l.dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, d + 4 * e, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, d + 2 * e, 2);
      return Bf16ToFloat(h);
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, d + 2 * e, 2);
      return F16ToFloat(h);
    }
    default:
      return 0;
  }
}

namespace {

// FloatToFp8E4M3 (fp8.h) by table: the 127 non-negative finite codes sorted
// by value, searched in 7 steps. Same rounding (nearest, ties to even code).
uint8_t ToFp8(float f) {
  static const std::array<float, 127> kValues = [] {
    std::array<float, 127> v{};
    for (int i = 0; i < 127; ++i) v[i] = Fp8E4M3ToFloat(static_cast<uint8_t>(i));
    return v;
  }();
  const bool neg = f < 0;
  const float a = std::min(neg ? -f : f, kFp8E4M3Max);
  int code = static_cast<int>(std::lower_bound(kValues.begin(), kValues.end(), a) - kValues.begin());
  if (code > 0) {
    const float up = kValues[code], down = kValues[code - 1];
    if (a - down < up - a || (a - down == up - a && ((code - 1) & 1) == 0)) --code;
  }
  return static_cast<uint8_t>(code | (neg && code != 0 ? 0x80 : 0));
}

void StorePlain(const BlockLayout& l, uint8_t* d, uint64_t e, float v) {
  switch (l.dtype) {
    case DType::kF32:
      std::memcpy(d + 4 * e, &v, 4);
      return;
    case DType::kBF16: {
      const uint16_t h = FloatToBf16(v);
      std::memcpy(d + 2 * e, &h, 2);
      return;
    }
    case DType::kF16: {
      const uint16_t h = FloatToF16(v);
      std::memcpy(d + 2 * e, &h, 2);
      return;
    }
    default:
      return;
  }
}

absl::Status Check(const BlockLayout& l, KvEncoding e) {
  const char* why = nullptr;
  if (!l.IsValid(&why)) return absl::InvalidArgumentError(absl::StrCat("bad layout: ", why));
  if (!e.quantized()) return absl::InvalidArgumentError("target encoding is not quantized");
  return absl::OkStatus();
}

}  // namespace

absl::Status QuantizeBlock(const BlockLayout& l, absl::Span<const uint8_t> plain, KvEncoding enc,
                           std::vector<uint8_t>* out) {
  if (absl::Status s = Check(l, enc); !s.ok()) return s;
  if (plain.size() != l.bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("plain block is ", plain.size(), " bytes, layout needs ", l.bytes()));
  }
  const bool fp8 = enc.codec == KvCodec::kFp8E4M3;
  const float qmax = fp8 ? kFp8E4M3Max : 127.0f;
  const uint32_t T = l.block_tokens, D = l.head_dim;
  out->assign(EncodedBytes(l, enc), 0);
  uint8_t* codes = out->data();
  float* scales = reinterpret_cast<float*>(out->data() + l.elements());
  std::vector<float> x(size_t{T} * D), sc(size_t{T} * D);  // a plane, and the scale of each element
  // One (layer, K|V, head) plane at a time: convert, group maxima, codes.
  for (uint32_t layer = 0; layer < l.layers; ++layer)
    for (uint32_t kv = 0; kv < 2; ++kv)
      for (uint32_t h = 0; h < l.kv_heads; ++h) {
        const uint64_t base = l.plane_index(layer, kv, h);
        for (uint32_t i = 0; i < T * D; ++i) {
          x[i] = PlainElement(l, plain.data(), base + i);
          if (!std::isfinite(x[i])) {
            return absl::InvalidArgumentError(absl::StrCat("non-finite value in the KV block (layer ", layer,
                                                           kv ? " V" : " K", " head ", h, " token ", i / D, " dim ",
                                                           i % D, "): refusing to quantize"));
          }
        }
        // Scale of a group: amax / qmax, but never below the smallest normal
        // float (a group of subnormals would otherwise get scale 0 and 0/0
        // codes; found by fuzz_blocks), and 1 for a group of zeros.
        auto finish = [&](float amax) {
          return amax > 0 ? std::max(amax / qmax, std::numeric_limits<float>::min()) : 1.0f;
        };
        if (enc.scales == ScaleMode::kPerHead) {
          float m = 0;
          for (float v : x) m = std::max(m, std::fabs(v));
          const float s1 = finish(m);
          scales[ScaleIndex(l, enc.scales, layer, kv, h, 0, 0)] = s1;
          std::fill(sc.begin(), sc.end(), s1);
        } else if (enc.scales == ScaleMode::kPerToken || kv == 1) {  // per token (V under kivi too)
          for (uint32_t t = 0; t < T; ++t) {
            float m = 0;
            for (uint32_t d = 0; d < D; ++d) m = std::max(m, std::fabs(x[t * D + d]));
            const float s1 = finish(m);
            scales[ScaleIndex(l, enc.scales, layer, kv, h, t, 0)] = s1;
            std::fill(sc.begin() + t * D, sc.begin() + (t + 1) * D, s1);
          }
        } else {  // kivi K: per channel
          for (uint32_t d = 0; d < D; ++d) {
            float m = 0;
            for (uint32_t t = 0; t < T; ++t) m = std::max(m, std::fabs(x[t * D + d]));
            const float s1 = finish(m);
            scales[ScaleIndex(l, enc.scales, layer, kv, h, 0, d)] = s1;
            for (uint32_t t = 0; t < T; ++t) sc[t * D + d] = s1;
          }
        }
        for (uint32_t i = 0; i < T * D; ++i) {
          const float y = x[i] / sc[i];
          if (fp8) {
            codes[base + i] = ToFp8(y);
          } else {
            codes[base + i] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(std::clamp(y, -127.0f, 127.0f))));
          }
        }
      }
  return absl::OkStatus();
}

absl::Status DequantizeBlock(const BlockLayout& l, KvEncoding enc, absl::Span<const uint8_t> encoded,
                             std::vector<uint8_t>* plain) {
  if (absl::Status s = Check(l, enc); !s.ok()) return s;
  if (encoded.size() != EncodedBytes(l, enc)) {
    return absl::InvalidArgumentError(
        absl::StrCat("encoded block is ", encoded.size(), " bytes, expected ", EncodedBytes(l, enc)));
  }
  plain->assign(l.bytes(), 0);
  const uint64_t n = l.elements();
  const bool fp8 = enc.codec == KvCodec::kFp8E4M3;
  for (uint32_t layer = 0; layer < l.layers; ++layer)
    for (uint32_t kv = 0; kv < 2; ++kv)
      for (uint32_t h = 0; h < l.kv_heads; ++h)
        for (uint32_t t = 0; t < l.block_tokens; ++t)
          for (uint32_t d = 0; d < l.head_dim; ++d) {
            const uint64_t e = l.index(layer, kv, h, t, d);
            float sc;
            std::memcpy(&sc, encoded.data() + n + 4 * ScaleIndex(l, enc.scales, layer, kv, h, t, d), 4);
            const uint8_t c = encoded[e];
            const float v = (fp8 ? Fp8E4M3ToFloat(c) : static_cast<float>(static_cast<int8_t>(c))) * sc;
            StorePlain(l, plain->data(), e, v);
          }
  return absl::OkStatus();
}

absl::Status ParseKvEncoding(std::string_view text, KvEncoding* out) {
  KvEncoding e;
  std::string_view codec = text, mode;
  if (const size_t slash = text.find('/'); slash != std::string_view::npos) {
    codec = text.substr(0, slash);
    mode = text.substr(slash + 1);
  }
  if (codec.empty() || codec == "none") {
    *out = KvEncoding{};
    return absl::OkStatus();
  }
  if (codec == "int8")
    e.codec = KvCodec::kInt8;
  else if (codec == "fp8")
    e.codec = KvCodec::kFp8E4M3;
  else
    return absl::InvalidArgumentError(absl::StrCat("unknown KV codec ", Quote(codec), " (int8, fp8, none)"));
  if (mode.empty() || mode == "per-head")
    e.scales = ScaleMode::kPerHead;
  else if (mode == "per-token")
    e.scales = ScaleMode::kPerToken;
  else if (mode == "kivi")
    e.scales = ScaleMode::kKChannelVToken;
  else
    return absl::InvalidArgumentError(absl::StrCat("unknown scale mode ", Quote(mode), " (per-head, per-token, kivi)"));
  *out = e;
  return absl::OkStatus();
}

std::string KvEncodingName(KvEncoding e) {
  if (!e.quantized()) return "bf16/plain";
  const char* c = e.codec == KvCodec::kInt8 ? "int8" : "fp8";
  const char* m = e.scales == ScaleMode::kPerHead    ? "per-head"
                  : e.scales == ScaleMode::kPerToken ? "per-token"
                                                     : "kivi";
  return absl::StrCat(c, "/", m);
}

}  // namespace kvring
