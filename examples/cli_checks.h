// The examples' checks of numeric options: one short message naming the
// value (CLI11's PositiveNumber prints DBL_MAX in full).
#pragma once

#include <CLI/CLI.hpp>

#include <cmath>
#include <string>

namespace examples {

// A finite number above zero.
inline CLI::Validator positive() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v) || !std::isfinite(v) || v <= 0) return "'" + s + "' is not a positive number";
        return {};
      },
      "POSITIVE");
}

}  // namespace examples
