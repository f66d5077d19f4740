// pickle_value: a PtValue as the protocol-2 pickle torch.save writes
// (tensors through torch._utils._rebuild_tensor_v2 and persistent storage
// ids, parameters through _rebuild_parameter), using only the opcodes and
// globals torch.load's weights_only unpickler accepts. Also the checks
// shared with the reader: storage classes, tensor views, UTF-8.
#include <cstring>

#include "formats/pickle_format.h"
#include "formats/pt_file.h"
#include "tdist/errors.h"

namespace tdist::checkpoint {

namespace pickle {

namespace {

const std::pair<c10::ScalarType, const char*> kStorageClasses[] = {
    {c10::kFloat, "FloatStorage"}, {c10::kDouble, "DoubleStorage"}, {c10::kHalf, "HalfStorage"},
    {c10::kBFloat16, "BFloat16Storage"}, {c10::kLong, "LongStorage"}, {c10::kInt, "IntStorage"},
    {c10::kShort, "ShortStorage"}, {c10::kChar, "CharStorage"}, {c10::kByte, "ByteStorage"},
    {c10::kBool, "BoolStorage"}};

constexpr size_t kBatch = 1000;  // items per APPENDS / SETITEMS, as Python's pickler

class Writer : public Emitter {
 public:
  void empty_ordered_dict() {
    global("collections", "OrderedDict");
    op(EMPTY_TUPLE);
    op(REDUCE);
  }

  void tensor(const PtTensorRef& t, bool requires_grad) {
    global("torch._utils", "_rebuild_tensor_v2");
    op(MARK);
    op(MARK);  // the persistent id ('storage', torch.<T>Storage, key, 'cpu', numel)
    string("storage");
    global("torch", storage_class(t.dtype));
    string(t.storage_key);
    string("cpu");
    integer(t.storage_numel);
    op(TUPLE);
    op(BINPERSID);
    integer(t.storage_offset);
    int_tuple(t.sizes);
    int_tuple(t.strides);
    op(requires_grad ? NEWTRUE : NEWFALSE);
    empty_ordered_dict();  // backward hooks
    op(TUPLE);
    op(REDUCE);
  }

  void value(const PtValue& v, int depth) {
    if (depth > kMaxDepth) throw UsageError("pickle_value: values nest deeper than " + std::to_string(kMaxDepth));
    switch (v.kind()) {
      case PtValue::Kind::None: return op(NONE);
      case PtValue::Kind::Bool: return op(v.as_bool() ? NEWTRUE : NEWFALSE);
      case PtValue::Kind::Int: return integer(v.as_int());
      case PtValue::Kind::Float: return floating(v.as_float());
      case PtValue::Kind::String: return string(v.as_string());
      case PtValue::Kind::List: {
        op(EMPTY_LIST);
        const auto& items = v.items();
        for (size_t at = 0; at < items.size(); at += kBatch) {
          const size_t n = std::min(kBatch, items.size() - at);
          if (n > 1) op(MARK);
          for (size_t k = at; k < at + n; ++k) value(items[k], depth + 1);
          op(n > 1 ? APPENDS : APPEND);
        }
        return;
      }
      case PtValue::Kind::Tuple: {
        const auto& items = v.items();
        if (items.empty()) return op(EMPTY_TUPLE);
        if (items.size() > 3) op(MARK);
        for (const PtValue& item : items) value(item, depth + 1);
        const size_t n = items.size();
        return op(n == 1 ? TUPLE1 : n == 2 ? TUPLE2 : n == 3 ? TUPLE3 : TUPLE);
      }
      case PtValue::Kind::Dict: {
        op(EMPTY_DICT);
        const auto& entries = v.entries();
        for (size_t at = 0; at < entries.size(); at += kBatch) {
          const size_t n = std::min(kBatch, entries.size() - at);
          if (n > 1) op(MARK);
          for (size_t k = at; k < at + n; ++k) {
            if (v.int_keys()) {
              integer(std::stoll(entries[k].first));
            } else {
              string(entries[k].first);
            }
            value(entries[k].second, depth + 1);
          }
          op(n > 1 ? SETITEMS : SETITEM);
        }
        return;
      }
      case PtValue::Kind::Tensor: {
        const PtTensorRef& t = v.as_tensor();
        const std::string problem = tensor_ref_problem(t);
        if (!problem.empty()) throw UsageError("pickle_value: tensor of storage '" + t.storage_key + "': " + problem);
        if (!t.parameter) return tensor(t, t.requires_grad);
        global("torch._utils", "_rebuild_parameter");
        tensor(t, false);
        op(t.requires_grad ? NEWTRUE : NEWFALSE);
        empty_ordered_dict();  // backward hooks
        op(TUPLE3);
        return op(REDUCE);
      }
    }
  }
};

}  // namespace

const char* storage_class(c10::ScalarType t) {
  for (const auto& [type, name] : kStorageClasses) {
    if (type == t) return name;
  }
  return nullptr;
}

bool dtype_of_storage_class(const std::string& name, c10::ScalarType* out) {
  for (const auto& [type, n] : kStorageClasses) {
    if (name == n) {
      *out = type;
      return true;
    }
  }
  return false;
}

bool dtype_of_name(const std::string& name, c10::ScalarType* out) {
  static const std::pair<const char*, c10::ScalarType> kNames[] = {
      {"float32", c10::kFloat}, {"float", c10::kFloat},   {"float64", c10::kDouble}, {"double", c10::kDouble},
      {"float16", c10::kHalf},  {"half", c10::kHalf},     {"bfloat16", c10::kBFloat16}, {"int64", c10::kLong},
      {"long", c10::kLong},     {"int32", c10::kInt},     {"int", c10::kInt},        {"int16", c10::kShort},
      {"short", c10::kShort},   {"int8", c10::kChar},     {"uint8", c10::kByte},     {"bool", c10::kBool}};
  for (const auto& [n, t] : kNames) {
    if (name == n) {
      *out = t;
      return true;
    }
  }
  return false;
}

std::string tensor_ref_problem(const PtTensorRef& r) {
  if (storage_class(r.dtype) == nullptr) return std::string("dtype ") + c10::toString(r.dtype) + " has no storage class";
  if (r.storage_numel < 0) return "negative storage size";
  int64_t bytes = 0;
  if (__builtin_mul_overflow(r.storage_numel, static_cast<int64_t>(c10::elementSize(r.dtype)), &bytes)) {
    return "storage size overflows";
  }
  if (r.storage_offset < 0) return "negative storage offset";
  if (r.sizes.size() != r.strides.size()) return "sizes and strides differ in length";
  if (r.sizes.size() > kMaxDims) return "more than " + std::to_string(kMaxDims) + " dimensions";
  bool empty = false;
  int64_t numel = 1;
  for (size_t d = 0; d < r.sizes.size(); ++d) {
    if (r.sizes[d] < 0) return "negative size";
    if (r.strides[d] < 0) return "negative stride";
    if (__builtin_mul_overflow(numel, r.sizes[d], &numel)) return "element count overflows";
    empty = empty || r.sizes[d] == 0;
  }
  if (empty) {
    if (r.storage_offset > r.storage_numel) return "storage offset past the storage's end";
    return "";
  }
  int64_t last = r.storage_offset;
  for (size_t d = 0; d < r.sizes.size(); ++d) {
    int64_t span = 0;
    if (__builtin_mul_overflow(r.sizes[d] - 1, r.strides[d], &span) || __builtin_add_overflow(last, span, &last)) {
      return "view overflows";
    }
  }
  if (last >= r.storage_numel) {
    return "view reaches element " + std::to_string(last) + " of a storage of " + std::to_string(r.storage_numel);
  }
  return "";
}

bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    size_t len = 0;
    uint32_t cp = 0, min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      len = 2, cp = c & 0x1f, min = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, cp = c & 0x0f, min = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff) return false;
    i += len;
  }
  return true;
}

}  // namespace pickle

std::string pickle_value(const PtValue& root) {
  pickle::Writer w;
  w.op(pickle::PROTO);
  w.le(pickle::kProtocol, 1);
  w.value(root, 0);
  w.op(pickle::STOP);
  return std::move(w.out);
}

}  // namespace tdist::checkpoint
