// Little-endian fixed-width integers in bytes: the one place every format
// of tdist codes them (zip and .pt records, safetensors' header length,
// pickles' integers, the store's frames and FileStore's log; in the manner
// of LevelDB's util/coding.h). Header-only and LibTorch-free: the store
// and the formats link it without a library. Pickle's BINFLOAT, the one
// big-endian field, is here too (put_be64/get_be64).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tdist::coding {

// The low `bytes` bytes of v (1 to 8), least significant first.
inline void encode_le(char* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i, v >>= 8) out[i] = static_cast<char>(v & 0xff);
}
inline void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i, v >>= 8) out.push_back(static_cast<char>(v & 0xff));
}
inline void put_fixed32(std::string& out, uint32_t v) { put_le(out, v, 4); }
inline void put_fixed64(std::string& out, uint64_t v) { put_le(out, v, 8); }

// `bytes` bytes (1 to 8), least significant first.
inline uint64_t decode_le(const void* p, int bytes) {
  const auto* b = static_cast<const uint8_t*>(p);
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}
inline uint32_t decode_fixed32(const void* p) { return static_cast<uint32_t>(decode_le(p, 4)); }
inline uint64_t decode_fixed64(const void* p) { return decode_le(p, 8); }

// Big-endian, 8 bytes (pickle's BINFLOAT).
inline void put_be64(std::string& out, uint64_t v) {
  for (int k = 7; k >= 0; --k) out.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}
inline uint64_t decode_be64(const void* p) {
  const auto* b = static_cast<const uint8_t*>(p);
  uint64_t v = 0;
  for (int k = 0; k < 8; ++k) v = (v << 8) | b[k];
  return v;
}

}  // namespace tdist::coding
