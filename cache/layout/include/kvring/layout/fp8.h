// fp8 e4m3 (OCP "E4M3FN": bias 7, no infinities, S.1111.111 is NaN, max 448)
// encode/decode, constexpr so host and device code agree bit for bit.
#pragma once

#include <cstdint>

namespace kvring {

inline constexpr float kFp8E4M3Max = 448.0f;

constexpr float Fp8E4M3ToFloat(uint8_t v) {
  const bool neg = (v & 0x80) != 0;
  const int exp = (v >> 3) & 0xf;
  const int man = v & 0x7;
  float mag = 0;
  if (exp == 0xf && man == 0x7) return neg ? -__builtin_nanf("") : __builtin_nanf("");
  if (exp == 0) {
    mag = static_cast<float>(man) * (1.0f / 512.0f);  // man/8 * 2^-6
  } else {
    float scale = 1.0f;
    for (int i = 7; i < exp; ++i) scale *= 2.0f;
    for (int i = exp; i < 7; ++i) scale *= 0.5f;
    mag = (1.0f + static_cast<float>(man) / 8.0f) * scale;
  }
  return neg ? -mag : mag;
}

// Round to nearest even, saturating at +-448. NaN input is the caller's to
// reject (kvring's quantizer refuses non-finite values before encoding).
constexpr uint8_t FloatToFp8E4M3(float f) {
  const bool neg = f < 0;
  float a = neg ? -f : f;
  if (a > kFp8E4M3Max) a = kFp8E4M3Max;
  // Search the 127 non-negative finite codes: monotone in the code value.
  uint8_t lo = 0, hi = 0x7e;
  while (lo < hi) {  // first code with value >= a
    const uint8_t mid = static_cast<uint8_t>((lo + hi) / 2);
    if (Fp8E4M3ToFloat(mid) < a)
      lo = static_cast<uint8_t>(mid + 1);
    else
      hi = mid;
  }
  uint8_t code = lo;
  if (code > 0) {
    const float up = Fp8E4M3ToFloat(code), down = Fp8E4M3ToFloat(static_cast<uint8_t>(code - 1));
    if (a - down < up - a || (a - down == up - a && ((code - 1) & 1) == 0)) code = static_cast<uint8_t>(code - 1);
  }
  return static_cast<uint8_t>(code | (neg && code != 0 ? 0x80 : 0));
}

}  // namespace kvring
