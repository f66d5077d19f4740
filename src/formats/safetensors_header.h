// The safetensors header: parsing and checking it, and making one. No
// LibTorch here (the fuzzer builds this file alone).
//
// The format (https://github.com/huggingface/safetensors, SPEC.md §6): an
// 8-byte little-endian header length N; N bytes of UTF-8 JSON, an object
// {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
// "__metadata__": {str: str}}, starting with '{' and padded with spaces;
// then the data, little-endian, C order, each tensor's bytes at
// [begin, end) of the data, the tensors contiguous from 0 to the end of
// the file with no holes and no overlaps. N is at most 100,000,000.
//
// parse_header rejects everything the format forbids or leaves undefined:
// a header that is not a JSON object or does not start with '{', a key
// given twice, a tensor entry with a missing, extra or ill-typed field, an
// unknown dtype, a negative or overflowing shape, offsets whose length is
// not the shape's bytes, holes, overlaps, data that does not end where the
// file does, metadata values that are not strings (a null __metadata__
// counts as none). Dtypes tdist cannot hold in a tensor (F8_*, F4, C64,
// U16, ...) parse; reading such a tensor is the caller's error. It never allocates
// from a length it has not checked against the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace tdist::safetensors {

// What is wrong with a file (the caller adds the file's name).
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct TensorEntry {
  std::string name;
  std::string dtype;           // "F32", "BF16", ...
  std::vector<int64_t> shape;  // empty: a scalar
  uint64_t begin = 0;          // bytes into the data
  uint64_t end = 0;
};

struct Header {
  std::vector<TensorEntry> tensors;  // in data order (by begin)
  std::map<std::string, std::string> metadata;
};

// Bits per element of a dtype the format names (F4 4, F6_* 6, ...); 0 for
// a name it does not know.
size_t dtype_bits(const std::string& dtype);
// Bytes per element; 0 for an unknown or sub-byte dtype.
size_t dtype_size(const std::string& dtype);

// The header length from the file's first 8 bytes, checked against the
// file size (FormatError if it cannot be a valid file of that size).
uint64_t header_length(const uint8_t first8[8], uint64_t file_size);

// Parses and checks the header (`json`: the N bytes after the length),
// for a data section of `data_bytes` (the file size - 8 - N).
Header parse_header(const char* json, size_t n, uint64_t data_bytes);

// The 8-byte length and the header for `tensors` laid out in the given
// order (begin/end are computed here; those given are ignored), padded
// with spaces to a multiple of 8 bytes. Tensors' names must be distinct
// and not "__metadata__".
std::string make_header(std::vector<TensorEntry>& tensors, const std::map<std::string, std::string>& metadata);

}  // namespace tdist::safetensors
