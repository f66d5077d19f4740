// TDIST_CHECK: for broken internal invariants only, never for user errors
// (those raise the typed errors of tdist/errors.h). Reports file:line, the
// failed expression and, for the comparison forms, both operand values.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace tdist::detail {

[[noreturn]] inline void check_failed(const char* file, int line, const char* expr,
                                      const std::string& detail) {
  std::ostringstream os;
  os << "tdist internal error at " << file << ":" << line << ": check failed: " << expr;
  if (!detail.empty()) os << " (" << detail << ")";
  os << ". This is a bug in tdist; please report it.";
  throw std::logic_error(os.str());
}

template <typename A, typename B>
std::string operands(const A& a, const B& b) {
  std::ostringstream os;
  os << a << " vs " << b;
  return os.str();
}

}  // namespace tdist::detail

#define TDIST_CHECK(cond)                                                    \
  do {                                                                       \
    if (!(cond)) ::tdist::detail::check_failed(__FILE__, __LINE__, #cond, ""); \
  } while (0)

#define TDIST_CHECK_OP(a, op, b)                                             \
  do {                                                                       \
    const auto& tdist_a_ = (a);                                              \
    const auto& tdist_b_ = (b);                                              \
    if (!(tdist_a_ op tdist_b_))                                             \
      ::tdist::detail::check_failed(__FILE__, __LINE__, #a " " #op " " #b,   \
                                    ::tdist::detail::operands(tdist_a_, tdist_b_)); \
  } while (0)

#define TDIST_CHECK_EQ(a, b) TDIST_CHECK_OP(a, ==, b)
#define TDIST_CHECK_NE(a, b) TDIST_CHECK_OP(a, !=, b)
#define TDIST_CHECK_LE(a, b) TDIST_CHECK_OP(a, <=, b)
#define TDIST_CHECK_LT(a, b) TDIST_CHECK_OP(a, <, b)
#define TDIST_CHECK_GE(a, b) TDIST_CHECK_OP(a, >=, b)
