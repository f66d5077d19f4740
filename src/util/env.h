// Small parsing helpers shared by the rendezvous, the launcher and tools.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tdist::detail {

// Parses a whole decimal integer (optional sign); nullopt on anything else,
// including overflow and trailing characters.
std::optional<int64_t> parse_int(std::string_view s);

// Describes errno as "<strerror> (errno N)".
std::string errno_string(int err);

// Milliseconds as a short human string: "250 ms", "12.5 s".
std::string format_duration_ms(int64_t ms);

}  // namespace tdist::detail
