// The safetensors header: parse_header's checks, make_header. The contract
// is in safetensors_header.h.
#include "checkpoint/safetensors_header.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <set>

namespace tdist::safetensors {

namespace {

using Json = nlohmann::json;

// A valid header nests three deep ({name: {"shape": [...]}}); anything much
// deeper is refused before it is built.
constexpr int kMaxDepth = 8;

[[noreturn]] void fail(const std::string& what) { throw FormatError(what); }

uint64_t get_u64(const Json& v, const std::string& what) {
  if (!v.is_number_unsigned()) fail(what + " is not a non-negative integer");
  return v.get<uint64_t>();
}

// The bytes of a tensor of that dtype and shape: elements x bits / 8,
// checked for overflow (FormatError), whole bytes only.
uint64_t data_bytes(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape) {
  const size_t bits = dtype_bits(dtype);
  if (bits == 0) fail("tensor '" + name + "': unknown dtype '" + dtype + "'");
  uint64_t numel = 1;
  for (const int64_t d : shape) {
    if (d < 0) fail("tensor '" + name + "': negative shape");
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) fail("tensor '" + name + "': its size overflows");
  }
  uint64_t total_bits = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(bits), &total_bits)) {
    fail("tensor '" + name + "': its size overflows");
  }
  if (total_bits % 8 != 0) fail("tensor '" + name + "': " + dtype + " of that shape is not a whole number of bytes");
  return total_bits / 8;
}

TensorEntry parse_entry(const std::string& name, const Json& info) {
  if (!info.is_object()) fail("tensor '" + name + "': its entry is not an object");
  for (const auto& [key, value] : info.items()) {
    (void)value;
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      fail("tensor '" + name + "': unknown field '" + key + "'");
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!info.contains(field)) fail("tensor '" + name + "': no '" + field + "'");
  }
  TensorEntry e;
  e.name = name;
  if (!info["dtype"].is_string()) fail("tensor '" + name + "': dtype is not a string");
  e.dtype = info["dtype"].get<std::string>();
  const Json& shape = info["shape"];
  if (!shape.is_array()) fail("tensor '" + name + "': shape is not an array");
  for (const Json& d : shape) {
    const uint64_t n = get_u64(d, "tensor '" + name + "': a shape entry");
    if (n > static_cast<uint64_t>(INT64_MAX)) fail("tensor '" + name + "': a shape entry is too large");
    e.shape.push_back(static_cast<int64_t>(n));
  }
  const uint64_t bytes = data_bytes(name, e.dtype, e.shape);
  const Json& off = info["data_offsets"];
  if (!off.is_array() || off.size() != 2) fail("tensor '" + name + "': data_offsets is not [begin, end]");
  e.begin = get_u64(off[0], "tensor '" + name + "': data_offsets[0]");
  e.end = get_u64(off[1], "tensor '" + name + "': data_offsets[1]");
  if (e.end < e.begin) fail("tensor '" + name + "': data_offsets end before they begin");
  if (e.end - e.begin != bytes) {
    fail("tensor '" + name + "': data_offsets span " + std::to_string(e.end - e.begin) + " bytes, but " + e.dtype +
         " of that shape is " + std::to_string(bytes));
  }
  return e;
}

}  // namespace

size_t dtype_bits(const std::string& d) {
  static const std::map<std::string, size_t> bits = {
      {"BOOL", 8},    {"F4", 4},       {"F6_E2M3", 6},  {"F6_E3M2", 6}, {"U8", 8},   {"I8", 8},   {"F8_E5M2", 8},
      {"F8_E4M3", 8}, {"F8_E8M0", 8},  {"I16", 16},     {"U16", 16},    {"F16", 16}, {"BF16", 16}, {"I32", 32},
      {"U32", 32},    {"F32", 32},     {"C64", 64},     {"I64", 64},    {"U64", 64}, {"F64", 64}};
  const auto it = bits.find(d);
  return it == bits.end() ? 0 : it->second;
}

size_t dtype_size(const std::string& d) {
  const size_t bits = dtype_bits(d);
  return bits % 8 == 0 ? bits / 8 : 0;
}

uint64_t header_length(const uint8_t first8[8], uint64_t file_size) {
  if (file_size < 8) fail("the file is " + std::to_string(file_size) + " bytes, shorter than the header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | first8[i];
  if (n > kMaxHeaderBytes) fail("header length " + std::to_string(n) + " is over the format's 100,000,000 bytes");
  if (n > file_size - 8) {
    fail("header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(file_size) +
         " bytes: truncated?)");
  }
  return n;
}

Header parse_header(const char* json, size_t n, uint64_t data_bytes) {
  if (n == 0 || json[0] != '{') fail("the header does not start with '{'");
  // Keys seen, per object being parsed: a key given twice is an error (a
  // JSON library would keep one of them silently).
  std::vector<std::set<std::string>> keys;
  const auto check = [&](int depth, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (depth >= kMaxDepth) fail("the header nests deeper than a safetensors header can");
        if (event == Json::parse_event_t::object_start) keys.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        keys.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!keys.back().insert(parsed.get<std::string>()).second) {
          fail("the header gives the key '" + parsed.get<std::string>() + "' twice");
        }
        break;
      default:
        break;
    }
    return true;
  };
  Json root;
  try {
    root = Json::parse(json, json + n, check);
  } catch (const Json::exception& e) {
    fail(std::string("the header is not valid JSON: ") + e.what());
  }
  if (!root.is_object()) fail("the header is not a JSON object");
  Header h;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;  // what some writers put for none
      if (!value.is_object()) fail("__metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) fail("__metadata__ '" + k + "' is not a string");
        h.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    h.tensors.push_back(parse_entry(key, value));
  }
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  for (const auto& t : h.tensors) {
    if (t.begin != at) {
      fail(std::string(t.begin > at ? "a hole" : "an overlap") + " in the data at byte " + std::to_string(at) +
           " (tensor '" + t.name + "' begins at " + std::to_string(t.begin) + ")");
    }
    at = t.end;
  }
  if (at != data_bytes) {
    fail("the tensors cover " + std::to_string(at) + " bytes of data but the file holds " + std::to_string(data_bytes) +
         (at > data_bytes ? " (truncated?)" : " (trailing bytes)"));
  }
  return h;
}

std::string make_header(std::vector<TensorEntry>& tensors, const std::map<std::string, std::string>& metadata) {
  // Built as text, entry by entry (a JSON object's lookups would make it
  // quadratic in the tensors); names and strings escaped by the library.
  std::string json = "{";
  const auto quoted = [](const std::string& s) {
    try {
      return Json(s).dump();
    } catch (const Json::exception& e) {
      fail(std::string("a tensor name or metadata string is not valid UTF-8: ") + e.what());
    }
  };
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      json += (first ? "" : ",") + quoted(k) + ":" + quoted(v);
      first = false;
    }
    json += "}";
  }
  std::set<std::string> names;
  uint64_t at = 0;
  for (auto& t : tensors) {
    if (t.name == "__metadata__") fail("a tensor cannot be named __metadata__");
    if (!names.insert(t.name).second) fail("two tensors are named '" + t.name + "'");
    const uint64_t bytes = data_bytes(t.name, t.dtype, t.shape);
    t.begin = at;
    if (__builtin_add_overflow(at, bytes, &t.end)) fail("tensor '" + t.name + "': the data's size overflows");
    at = t.end;
    std::string shape;
    for (const int64_t d : t.shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    json += (json.size() > 1 ? "," : "") + quoted(t.name) + ":{\"dtype\":" + quoted(t.dtype) + ",\"shape\":[" +
            shape + "],\"data_offsets\":[" + std::to_string(t.begin) + "," + std::to_string(t.end) + "]}";
    if (json.size() > kMaxHeaderBytes) fail("the header would be over 100,000,000 bytes");
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  if (json.size() > kMaxHeaderBytes) fail("the header would be over 100,000,000 bytes");
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out[static_cast<size_t>(i)] = static_cast<char>(n & 0xff);
  return out + json;
}

}  // namespace tdist::safetensors
