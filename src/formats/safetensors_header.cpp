// The safetensors header: parse_header's checks, make_header. The contract
// is in safetensors_header.h.
#include "formats/safetensors_header.h"
#include "util/coding.h"

#include "util/json_reader.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

namespace tdist::safetensors {

namespace {

using Json = nlohmann::json;

// A valid header nests three deep ({name: {"shape": [...]}}); anything much
// deeper is refused before it is built.
constexpr int kMaxDepth = 8;

[[noreturn]] void fail(const std::string& what) { throw FormatError(what); }

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

constexpr size_t kMaxShapeDims = 1024;

// The header's JSON, event by event (util/json_reader.h): each tensor
// entry is checked and kept as a TensorEntry as soon as it closes, nothing
// else is built, so time and memory are linear in the header (kept: at
// most 64 MiB + 8 x its size). Nesting past kMaxDepth and keys given twice
// fail at once; any other problem is deferred (the first one), so that a
// header that is not JSON says so first.
class HeaderReader : public json::JsonReader {
 public:
  explicit HeaderReader(size_t json_bytes) : JsonReader(limits(json_bytes)) {}
  Header h;

 private:
  enum Tag { kRoot, kEntry, kShape, kOffsets, kMetadata };
  enum class Field : unsigned { Dtype, Shape, Offsets, Other };
  Field field_ = Field::Other;
  unsigned seen_ = 0;
  int offsets_ = 0;
  bool metadata_seen_ = false;
  TensorEntry entry_;

  static json::Limits limits(size_t json_bytes) {
    json::Limits l;
    l.max_depth = kMaxDepth;
    l.max_string = kMaxHeaderBytes;
    l.max_key = kMaxHeaderBytes;
    l.max_kept = (size_t{64} << 20) + 8 * json_bytes;
    return l;
  }
  std::string who() const { return "tensor '" + entry_.name + "': "; }
  [[noreturn]] void twice(const std::string& k) { fail("the key '" + k + "' is given twice"); }

  void on_key() override {
    const std::string& k = key();
    switch (top().tag) {
      case kRoot:
        if (k == "__metadata__" && std::exchange(metadata_seen_, true)) twice(k);
        return;
      case kMetadata:
        if (h.metadata.count(k)) twice(k);
        return;
      case kEntry: {
        field_ = k == "dtype" ? Field::Dtype : k == "shape" ? Field::Shape : k == "data_offsets" ? Field::Offsets : Field::Other;
        if (field_ == Field::Other) return defer(who() + "unknown field '" + k + "'");
        const unsigned bit = 1u << static_cast<unsigned>(field_);
        if (seen_ & bit) twice(k);
        seen_ |= bit;
        return;
      }
    }
  }
  int on_open(bool object) override {
    if (at_root()) return kRoot;
    const int at = top().tag;
    if (object && at == kRoot && key() == "__metadata__") return kMetadata;
    if (object && at == kRoot) {
      entry_ = TensorEntry();
      entry_.name = key();
      seen_ = 0;
      return kEntry;
    }
    if (!object && at == kEntry && field_ == Field::Shape) return kShape;
    if (!object && at == kEntry && field_ == Field::Offsets) {
      offsets_ = 0;
      return kOffsets;
    }
    if (!(at == kEntry && field_ == Field::Other) && !has_problem()) defer(misplaced(object ? "an object" : "an array"));
    return kSkip;
  }
  void on_close(const json::Frame& f) override {
    if (f.tag == kEntry && !has_problem()) finish_entry();
    if (f.tag == kOffsets && offsets_ != 2 && !has_problem()) defer(who() + "data_offsets is not [begin, end]");
  }
  void on_scalar(const json::Scalar& v) override {
    const int at = top().tag;
    if (at == kShape && v.type == json::Scalar::Int && !v.negative()) {
      if (v.too_big) {
        if (!has_problem()) defer(who() + "a shape entry is too large");
        return;
      }
      if (entry_.shape.size() >= kMaxShapeDims) {
        return defer(who() + "a shape of more than " + std::to_string(kMaxShapeDims) + " dimensions");
      }
      entry_.shape.push_back(v.i);  // at most 8 KiB, counted when the entry is kept
      return;
    }
    if (at == kOffsets && v.type == json::Scalar::Int && !v.negative()) {
      if (offsets_ >= 2) return defer(who() + "data_offsets is not [begin, end]");
      (offsets_ == 0 ? entry_.begin : entry_.end) = v.u;
      ++offsets_;
      return;
    }
    if (at == kEntry && field_ == Field::Dtype && v.type == json::Scalar::String) {
      entry_.dtype = *v.s;
      return;
    }
    if (at == kMetadata && v.type == json::Scalar::String) {
      charge(sizeof(std::pair<const std::string, std::string>) + 48 + heap(key().size()) + heap(v.s->size()));
      h.metadata.emplace(key(), *v.s);
      return;
    }
    if (at == kRoot && key() == "__metadata__" && v.type == json::Scalar::Null) return;  // none
    if (at == kEntry && field_ == Field::Other) return;  // an unknown field: already deferred
    // Only the first problem is kept: no message is built once there is one
    // (a message names the entry, which may be long).
    if (!has_problem()) defer(misplaced(json::type_name(v.type)));
    if (at == kOffsets) ++offsets_;
  }
  // What a value of that kind is wrong for, where it stands.
  std::string misplaced(const char* what) const {
    switch (top().tag) {
      case kRoot:
        return key() == "__metadata__" ? "__metadata__ is not an object" : "tensor '" + key() + "': its entry is not an object";
      case kEntry:
        return field_ == Field::Dtype  ? who() + "dtype is not a string"
               : field_ == Field::Shape ? who() + "shape is not an array"
                                        : who() + "data_offsets is not [begin, end]";
      case kShape: return who() + "a shape entry is not a non-negative integer";
      case kOffsets: return who() + "data_offsets[" + std::to_string(offsets_) + "] is not a non-negative integer";
      case kMetadata: return "__metadata__ '" + key() + "' is not a string";
    }
    return std::string("the header has ") + what + " where it cannot";
  }
  void finish_entry() {
    for (const Field f : {Field::Dtype, Field::Shape, Field::Offsets}) {
      if (!(seen_ & (1u << static_cast<unsigned>(f)))) {
        static const char* names[] = {"dtype", "shape", "data_offsets"};
        defer(who() + "no '" + names[static_cast<unsigned>(f)] + "'");
        return;
      }
    }
    TensorEntry& e = entry_;
    try {
      const uint64_t bytes = data_bytes(e.name, e.dtype, e.shape);
      if (e.end < e.begin) fail("tensor '" + e.name + "': data_offsets end before they begin");
      if (e.end - e.begin != bytes) {
        fail("tensor '" + e.name + "': data_offsets span " + std::to_string(e.end - e.begin) + " bytes, but " +
             e.dtype + " of that shape is " + std::to_string(bytes));
      }
    } catch (const FormatError& err) {
      defer(err.what());
      return;
    }
    e.shape.shrink_to_fit();
    charge(heap(e.name.size()) + heap(e.dtype.size()) + heap(8 * e.shape.size()));
    const size_t cap = h.tensors.capacity();
    h.tensors.push_back(std::move(e));
    if (h.tensors.capacity() != cap) charge((h.tensors.capacity() - cap) * sizeof(TensorEntry));
  }
};

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
  const uint64_t n = coding::decode_fixed64(first8);
  if (n > kMaxHeaderBytes) fail("header length " + std::to_string(n) + " is over the format's 100,000,000 bytes");
  if (n > file_size - 8) {
    fail("header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(file_size) +
         " bytes: truncated?)");
  }
  return n;
}

Header parse_header(const char* json, size_t n, uint64_t data_bytes) {
  if (n == 0 || json[0] != '{') fail("the header does not start with '{'");
  HeaderReader reader(n);
  const std::string problem = reader.parse(json, n);
  if (!problem.empty()) fail("the header: " + problem);
  Header h = std::move(reader.h);
  // Tensor names given twice: one sort, not a lookup per key.
  {
    std::vector<const TensorEntry*> by_name;
    by_name.reserve(h.tensors.size());
    for (const TensorEntry& t : h.tensors) by_name.push_back(&t);
    std::sort(by_name.begin(), by_name.end(), [](const TensorEntry* a, const TensorEntry* b) { return a->name < b->name; });
    for (size_t i = 1; i < by_name.size(); ++i) {
      if (by_name[i]->name == by_name[i - 1]->name) fail("the header: the key '" + by_name[i]->name + "' is given twice");
    }
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
  std::string out;
  coding::put_fixed64(out, json.size());
  return out + json;
}

}  // namespace tdist::safetensors
