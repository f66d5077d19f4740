// memcpy/memmove that accept empty copies: an empty tensor's data pointer
// may be null, and passing null to memcpy is undefined even for 0 bytes.
#pragma once

#include <cstddef>
#include <cstring>

namespace tdist::detail {

inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n) std::memcpy(dst, src, n);
}

inline void move_bytes(void* dst, const void* src, size_t n) {
  if (n) std::memmove(dst, src, n);
}

}  // namespace tdist::detail
