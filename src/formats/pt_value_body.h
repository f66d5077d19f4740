// The bodies behind PtValue (pt_file.h) and the unpickler's access to
// them. Internal to pt_value.cpp and pickle_reader.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "formats/pt_file.h"

namespace tdist::checkpoint {

// Shared by every copy of a PtValue; freed with the last. weight, depth
// and sealed are kept by the unpickler only (values built otherwise leave
// them at their defaults).
struct PtValue::Body {
  std::atomic<uint32_t> refs{1};
  uint16_t depth = 0;     // the greatest height of its children (PtValueBuilder::depth)
  bool sealed = false;    // unpickler: put into a container, not mutated again
  bool ordered = false;   // unpickler: a dict made by OrderedDict()
  bool special = false;   // unpickler: holds a global or a storage, not values
  uint64_t weight = 1;    // values in this subtree, shared ones once per reference
};

namespace pt_body {

struct String : PtValue::Body {
  std::string s;
};
struct Seq : PtValue::Body {  // List, Tuple
  std::vector<PtValue> items;
};
struct Dict : PtValue::Body {
  std::vector<std::pair<std::string, PtValue>> entries;
  bool int_keys = false;  // every key an int in the pickle (kept as its decimal string)
};
struct Tensor : PtValue::Body {
  PtTensorRef ref;
  // The unpickler's intermediate objects, held as Kind::Tensor with
  // `special` set (they never reach a finished tree): a global (which one
  // in `global`, a storage class's dtype in ref.dtype) or a storage
  // (ref's key, dtype and numel).
  enum Role : uint8_t { Value, Global, Storage } role = Value;
  uint8_t global = 0;
};

}  // namespace pt_body

// The unpickler's access: a value's body, mutated in place (shared by
// every copy, as Python's objects are by memo references).
struct PtValueBuilder {
  static PtValue::Body* body(const PtValue& v) {
    return v.kind_ >= PtValue::Kind::String ? v.body_ : nullptr;
  }
  static pt_body::Seq& seq(const PtValue& v) { return *static_cast<pt_body::Seq*>(v.body_); }
  static pt_body::Dict& dict(const PtValue& v) { return *static_cast<pt_body::Dict*>(v.body_); }
  // Values in v's subtree (1 for a leaf), and its height: 0 for a leaf or
  // an empty container, else 1 + its children's greatest.
  static uint64_t weight(const PtValue& v) { return body(v) ? v.body_->weight : 1; }
  static uint16_t depth(const PtValue& v) {
    const bool container =
        v.kind_ == PtValue::Kind::List || v.kind_ == PtValue::Kind::Tuple || v.kind_ == PtValue::Kind::Dict;
    return container && v.body_->weight > 1 ? static_cast<uint16_t>(v.body_->depth + 1) : 0;
  }
};

}  // namespace tdist::checkpoint
