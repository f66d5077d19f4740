// PtValue, the tree of values a .pt file holds: constructors, checked
// accessors and equality. The contract is in pt_file.h.
#include <cstring>

#include "checkpoint/pt_file.h"
#include "tdist/errors.h"

namespace tdist::checkpoint {

namespace {

const char* kind_name(PtValue::Kind k) {
  switch (k) {
    case PtValue::Kind::None: return "None";
    case PtValue::Kind::Bool: return "a bool";
    case PtValue::Kind::Int: return "an int";
    case PtValue::Kind::Float: return "a float";
    case PtValue::Kind::String: return "a string";
    case PtValue::Kind::List: return "a list";
    case PtValue::Kind::Tuple: return "a tuple";
    case PtValue::Kind::Dict: return "a dict";
    case PtValue::Kind::Tensor: return "a tensor";
  }
  return "an unknown kind";
}

[[noreturn]] void wrong_kind(const char* expected, PtValue::Kind found) {
  throw CheckpointError(std::string("expected ") + expected + ", found " + kind_name(found));
}

bool same_ref(const PtTensorRef& a, const PtTensorRef& b) {
  return a.storage_key == b.storage_key && a.dtype == b.dtype && a.storage_numel == b.storage_numel &&
         a.storage_offset == b.storage_offset && a.sizes == b.sizes && a.strides == b.strides &&
         a.requires_grad == b.requires_grad && a.parameter == b.parameter;
}

}  // namespace

PtValue PtValue::boolean(bool b) {
  PtValue v;
  v.kind_ = Kind::Bool;
  v.b_ = b;
  return v;
}

PtValue PtValue::integer(int64_t i) {
  PtValue v;
  v.kind_ = Kind::Int;
  v.i_ = i;
  return v;
}

PtValue PtValue::floating(double d) {
  PtValue v;
  v.kind_ = Kind::Float;
  v.d_ = d;
  return v;
}

PtValue PtValue::string(std::string s) {
  PtValue v;
  v.kind_ = Kind::String;
  v.s_ = std::move(s);
  return v;
}

PtValue PtValue::list(std::vector<PtValue> items) {
  PtValue v;
  v.kind_ = Kind::List;
  v.items_ = std::move(items);
  return v;
}

PtValue PtValue::tuple(std::vector<PtValue> items) {
  PtValue v;
  v.kind_ = Kind::Tuple;
  v.items_ = std::move(items);
  return v;
}

PtValue PtValue::dict(std::vector<std::pair<std::string, PtValue>> items) {
  PtValue v;
  v.kind_ = Kind::Dict;
  v.entries_ = std::move(items);
  return v;
}

PtValue PtValue::tensor(PtTensorRef ref) {
  PtValue v;
  v.kind_ = Kind::Tensor;
  v.tensor_ = std::make_shared<PtTensorRef>(std::move(ref));
  return v;
}

bool PtValue::as_bool() const {
  if (kind_ != Kind::Bool) wrong_kind("a bool", kind_);
  return b_;
}

int64_t PtValue::as_int() const {
  if (kind_ != Kind::Int) wrong_kind("an int", kind_);
  return i_;
}

double PtValue::as_float() const {
  if (kind_ == Kind::Int) return static_cast<double>(i_);
  if (kind_ != Kind::Float) wrong_kind("a float", kind_);
  return d_;
}

const std::string& PtValue::as_string() const {
  if (kind_ != Kind::String) wrong_kind("a string", kind_);
  return s_;
}

const std::vector<PtValue>& PtValue::items() const {
  if (kind_ != Kind::List && kind_ != Kind::Tuple) wrong_kind("a list or tuple", kind_);
  return items_;
}

const std::vector<std::pair<std::string, PtValue>>& PtValue::entries() const {
  if (kind_ != Kind::Dict) wrong_kind("a dict", kind_);
  return entries_;
}

const PtTensorRef& PtValue::as_tensor() const {
  if (kind_ != Kind::Tensor) wrong_kind("a tensor", kind_);
  return *tensor_;
}

const PtValue* PtValue::find(const std::string& key) const {
  for (const auto& [k, v] : entries()) {
    if (k == key) return &v;
  }
  return nullptr;
}

const PtValue& PtValue::at(const std::string& key) const {
  const PtValue* v = find(key);
  if (v == nullptr) throw CheckpointError("no key '" + key + "' in the dict");
  return *v;
}

std::vector<PtValue>& PtValue::mutable_items() {
  if (kind_ != Kind::List && kind_ != Kind::Tuple) wrong_kind("a list or tuple", kind_);
  return items_;
}

std::vector<std::pair<std::string, PtValue>>& PtValue::mutable_entries() {
  if (kind_ != Kind::Dict) wrong_kind("a dict", kind_);
  return entries_;
}

bool operator==(const PtValue& a, const PtValue& b) {
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case PtValue::Kind::None: return true;
    case PtValue::Kind::Bool: return a.as_bool() == b.as_bool();
    case PtValue::Kind::Int: return a.as_int() == b.as_int();
    case PtValue::Kind::Float: {
      const double x = a.as_float(), y = b.as_float();
      return std::memcmp(&x, &y, sizeof x) == 0;
    }
    case PtValue::Kind::String: return a.as_string() == b.as_string();
    case PtValue::Kind::List:
    case PtValue::Kind::Tuple: return a.items() == b.items();
    case PtValue::Kind::Dict: return a.entries() == b.entries();
    case PtValue::Kind::Tensor: return same_ref(a.as_tensor(), b.as_tensor());
  }
  return false;
}

}  // namespace tdist::checkpoint
