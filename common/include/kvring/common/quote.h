// Quoting caller input inside error messages, bounded: an error answer never
// echoes more than a short prefix of what it was sent (a 100 KB field must
// not come back in a 100 KB message, nor fill a log).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"

namespace kvring {

// 's' in single quotes when it has at most `max` bytes; else its first `max`
// bytes, "..." and the full length: 'abcd...' (100000 bytes). Non-printable
// bytes are written as '?'.
inline std::string Quote(std::string_view s, size_t max = 64) {
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    out.push_back(c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?');
  }
  if (s.size() <= max) return out + "'";
  return absl::StrCat(out, "...' (", s.size(), " bytes)");
}

}  // namespace kvring
