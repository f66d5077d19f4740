// A name read from a file or a peer, made safe to put in a message: control
// bytes (NUL, ESC, CR, ...) and DEL are shown as \xNN, so a hostile key can
// neither cut a message short nor drive the reader's terminal; past `max`
// bytes the rest is "...". Bytes from 0x80 up pass, so UTF-8 names stay
// readable.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

namespace tdist::detail {

inline std::string printable(std::string_view s, size_t max = 256) {
  std::string out;
  out.reserve(s.size() < max ? s.size() : max);
  for (size_t i = 0; i < s.size(); ++i) {
    if (i == max) return out + "...";
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

}  // namespace tdist::detail
