#include "util/env.h"

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>

namespace tdist::detail {

std::optional<int64_t> parse_int(std::string_view s) {
  if (s.empty()) return std::nullopt;
  const char* begin = s.data();
  const char* end = s.data() + s.size();
  if (*begin == '+') ++begin;  // from_chars accepts '-' but not '+'
  if (begin == end) return std::nullopt;
  int64_t value = 0;
  auto [ptr, ec] = std::from_chars(begin, end, value);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

std::string errno_string(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

std::string format_duration_ms(int64_t ms) {
  if (ms < 1000) return std::to_string(ms) + " ms";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(ms) / 1000.0);
  return buf;
}

}  // namespace tdist::detail
