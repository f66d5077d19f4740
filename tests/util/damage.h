// Test helpers that damage a file or a buffer on purpose, and always do:
// a byte is changed by flipping bits (XOR with a non-zero mask), never by
// writing a constant over it, which changes nothing when the byte already
// held that constant (1 run in 256 with random data) and lets a test of
// "the damage is found" fail by chance.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>

namespace tdist::test {

// Flips the bits of `mask` in bytes[offset]. The mask must not be 0 and
// the offset must be inside: a test that damages nothing fails here.
inline void flip_byte(std::string& bytes, size_t offset, uint8_t mask = 0x01) {
  ASSERT_NE(mask, 0) << "a zero mask changes nothing";
  ASSERT_LT(offset, bytes.size()) << "damage past the end of " << bytes.size() << " bytes";
  const char before = bytes[offset];
  bytes[offset] = static_cast<char>(static_cast<uint8_t>(before) ^ mask);
  ASSERT_NE(bytes[offset], before);
}

// The same in the file at path, in place (the file keeps its size); the
// byte is read back to check that it changed.
inline void flip_byte_in_file(const std::string& path, size_t offset, uint8_t mask = 0x01) {
  ASSERT_NE(mask, 0) << "a zero mask changes nothing";
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.is_open()) << "cannot open " << path;
  f.seekg(static_cast<std::streamoff>(offset));
  char before = 0;
  ASSERT_TRUE(f.get(before)) << path << " has no byte at offset " << offset;
  f.seekp(static_cast<std::streamoff>(offset));
  ASSERT_TRUE(f.put(static_cast<char>(static_cast<uint8_t>(before) ^ mask))) << "cannot write " << path;
  f.flush();
  f.seekg(static_cast<std::streamoff>(offset));
  char after = 0;
  ASSERT_TRUE(f.get(after)) << "cannot read " << path << " back";
  ASSERT_NE(after, before) << path << ": the byte at " << offset << " did not change";
}

}  // namespace tdist::test
