// What tdist's safetensors reader and writer share: the format's dtype
// names for c10's dtypes, the checksum keys of __metadata__, sizes.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

#include "tdist/safetensors.h"

namespace tdist::safetensors {

// __metadata__ key of a tensor's CRC-32 (8 lowercase hex digits): prefix + name.
constexpr const char* kCrcPrefix = "tdist.crc32:";

// The format's name ("F32") of a dtype tdist writes; CheckpointError
// naming the file and tensor for any other.
const char* dtype_name(c10::ScalarType t, const std::string& path, const std::string& tensor);
// The dtype of a format name tdist reads; CheckpointError for any other.
c10::ScalarType dtype_of(const std::string& name, const std::string& path, const std::string& tensor);
// Undefined for a name without one.
c10::ScalarType dtype_or_undefined(const std::string& name);
std::string hex32(uint32_t v);
uint64_t nbytes_of(const SafetensorsTensorInfo& t);

}  // namespace tdist::safetensors
