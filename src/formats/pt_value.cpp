// PtValue, the tree of values a .pt file holds: constructors, checked
// accessors and equality. The contract is in pt_file.h, the bodies in
// pt_value_body.h.
#include <cstring>

#include "formats/pt_file.h"
#include "formats/pt_value_body.h"
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

// ---- bodies -------------------------------------------------------------------

PtValue::PtValue(const PtValue& o) : kind_(o.kind_), i_(o.i_) {
  if (kind_ >= Kind::String) body_->refs.fetch_add(1, std::memory_order_relaxed);
}

PtValue::PtValue(PtValue&& o) noexcept : kind_(o.kind_), i_(o.i_) {
  o.kind_ = Kind::None;
  o.i_ = 0;
}

PtValue& PtValue::operator=(const PtValue& o) {
  if (this != &o) {
    PtValue copy(o);
    *this = std::move(copy);
  }
  return *this;
}

PtValue& PtValue::operator=(PtValue&& o) noexcept {
  if (this != &o) {
    release();
    kind_ = o.kind_;
    i_ = o.i_;
    o.kind_ = Kind::None;
    o.i_ = 0;
  }
  return *this;
}

PtValue::~PtValue() { release(); }

void PtValue::release() noexcept {
  if (kind_ < Kind::String || body_->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  switch (kind_) {
    case Kind::String: delete static_cast<pt_body::String*>(body_); break;
    case Kind::List:
    case Kind::Tuple: delete static_cast<pt_body::Seq*>(body_); break;
    case Kind::Dict: delete static_cast<pt_body::Dict*>(body_); break;
    case Kind::Tensor: delete static_cast<pt_body::Tensor*>(body_); break;
    default: break;
  }
  kind_ = Kind::None;
  i_ = 0;
}

// A body of our own, copied from a shared one.
void PtValue::unshare() {
  if (body_->refs.load(std::memory_order_acquire) == 1) return;
  Body* b = nullptr;
  switch (kind_) {
    case Kind::List:
    case Kind::Tuple: {
      auto* seq = new pt_body::Seq();
      seq->items = items();
      b = seq;
      break;
    }
    case Kind::Dict: {
      auto* dict = new pt_body::Dict();
      dict->entries = entries();
      dict->int_keys = int_keys();
      b = dict;
      break;
    }
    default: return;  // strings and tensors are never mutated
  }
  b->weight = body_->weight;
  b->depth = body_->depth;
  PtValue copy;
  copy.kind_ = kind_;
  copy.body_ = b;
  *this = std::move(copy);
}

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
  auto* b = new pt_body::String();
  b->s = std::move(s);
  PtValue v;
  v.kind_ = Kind::String;
  v.body_ = b;
  return v;
}

PtValue PtValue::list(std::vector<PtValue> items) {
  auto* b = new pt_body::Seq();
  b->items = std::move(items);
  PtValue v;
  v.kind_ = Kind::List;
  v.body_ = b;
  return v;
}

PtValue PtValue::tuple(std::vector<PtValue> items) {
  PtValue v = list(std::move(items));
  v.kind_ = Kind::Tuple;
  return v;
}

PtValue PtValue::dict(std::vector<std::pair<std::string, PtValue>> items) {
  auto* b = new pt_body::Dict();
  b->entries = std::move(items);
  PtValue v;
  v.kind_ = Kind::Dict;
  v.body_ = b;
  return v;
}

PtValue PtValue::int_keyed_dict(std::vector<std::pair<int64_t, PtValue>> items) {
  std::vector<std::pair<std::string, PtValue>> entries;
  entries.reserve(items.size());
  for (auto& [k, v] : items) entries.emplace_back(std::to_string(k), std::move(v));
  PtValue d = dict(std::move(entries));
  static_cast<pt_body::Dict*>(d.body_)->int_keys = true;
  return d;
}

bool PtValue::int_keys() const {
  return kind_ == Kind::Dict && static_cast<const pt_body::Dict*>(body_)->int_keys;
}

PtValue PtValue::tensor(PtTensorRef ref) {
  auto* b = new pt_body::Tensor();
  b->ref = std::move(ref);
  PtValue v;
  v.kind_ = Kind::Tensor;
  v.body_ = b;
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
  return static_cast<const pt_body::String*>(body_)->s;
}

const std::vector<PtValue>& PtValue::items() const {
  if (kind_ != Kind::List && kind_ != Kind::Tuple) wrong_kind("a list or tuple", kind_);
  return static_cast<const pt_body::Seq*>(body_)->items;
}

const std::vector<std::pair<std::string, PtValue>>& PtValue::entries() const {
  if (kind_ != Kind::Dict) wrong_kind("a dict", kind_);
  return static_cast<const pt_body::Dict*>(body_)->entries;
}

const PtTensorRef& PtValue::as_tensor() const {
  if (kind_ != Kind::Tensor) wrong_kind("a tensor", kind_);
  return static_cast<const pt_body::Tensor*>(body_)->ref;
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
  unshare();
  return static_cast<pt_body::Seq*>(body_)->items;
}

std::vector<std::pair<std::string, PtValue>>& PtValue::mutable_entries() {
  if (kind_ != Kind::Dict) wrong_kind("a dict", kind_);
  unshare();
  return static_cast<pt_body::Dict*>(body_)->entries;
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
    case PtValue::Kind::Dict: return a.int_keys() == b.int_keys() && a.entries() == b.entries();
    case PtValue::Kind::Tensor: return same_ref(a.as_tensor(), b.as_tensor());
  }
  return false;
}

}  // namespace tdist::checkpoint
