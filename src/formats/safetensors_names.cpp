// safetensors dtype names and checksum keys: safetensors_names.h.
#include "formats/safetensors_names.h"

#include <cstdio>
#include <utility>
#include <vector>

namespace tdist::safetensors {

namespace {

const std::vector<std::pair<c10::ScalarType, const char*>>& dtype_names() {
  static const std::vector<std::pair<c10::ScalarType, const char*>> names = {
      {c10::kBool, "BOOL"}, {c10::kByte, "U8"},  {c10::kChar, "I8"},  {c10::kShort, "I16"},
      {c10::kInt, "I32"},   {c10::kLong, "I64"}, {c10::kHalf, "F16"}, {c10::kBFloat16, "BF16"},
      {c10::kFloat, "F32"}, {c10::kDouble, "F64"}};
  return names;
}

}  // namespace

const char* dtype_name(c10::ScalarType t, const std::string& path, const std::string& tensor) {
  for (const auto& [type, name] : dtype_names()) {
    if (type == t) return name;
  }
  throw CheckpointError(path + ": tensor '" + tensor + "' is " + c10::toString(t) +
                        ", which safetensors files of tdist do not hold");
}

c10::ScalarType dtype_or_undefined(const std::string& name) {
  for (const auto& [type, n] : dtype_names()) {
    if (name == n) return type;
  }
  return c10::ScalarType::Undefined;
}

c10::ScalarType dtype_of(const std::string& name, const std::string& path, const std::string& tensor) {
  const c10::ScalarType t = dtype_or_undefined(name);
  if (t == c10::ScalarType::Undefined) {
    throw CheckpointError(path + ": tensor '" + tensor + "' is " + name + ", which has no LibTorch type tdist reads");
  }
  return t;
}

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

uint64_t nbytes_of(const SafetensorsTensorInfo& t) {
  uint64_t n = c10::elementSize(t.dtype);
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace tdist::safetensors
