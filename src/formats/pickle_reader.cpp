// unpickle_value: a restricted unpickler for the data.pkl of .pt files.
// It runs the pickle machine for the opcodes torch.save emits, straight
// into PtValues, and knows four kinds of global: collections.OrderedDict,
// torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter and the
// storage classes torch.<T>Storage. Anything else is a CheckpointError
// naming the opcode or global and its byte. unpickle_dcp_metadata runs the
// same machine with DCP's allowlist (pt_file.h); no global is ever called,
// each is a known shape of data.
//
// Memory and work are bounded while parsing, not after:
//  - memo references share (a PtValue body, as Python's objects), never
//    copy; a container is sealed once it is put into another (or into a
//    tuple) and may not change after, so no cycle can form;
//  - every body, string, vector growth, stack and memo slot is charged to
//    a budget of kBudgetBase + kBudgetPerByte x the pickle's size as it is
//    created (what a REDUCE consumes is credited back);
//  - each container keeps its weight (values in its subtree, a shared one
//    once per reference: what a walk of the finished tree visits) and
//    depth, checked against kMaxValues and kMaxDepth at each insertion.
// Time is linear in the input (duplicate dict keys are merged by one sort
// when a dict is sealed).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string_view>
#include <unordered_map>

#include "formats/pickle_dcp.h"
#include "formats/pickle_format.h"
#include "formats/pt_file.h"
#include "formats/pt_value_body.h"
#include "tdist/errors.h"
#include "util/coding.h"

namespace tdist::checkpoint {

namespace pickle {

namespace {

using Kind = PtValue::Kind;
using B = PtValueBuilder;
using TensorBody = pt_body::Tensor;

// The globals of .pt files; DCP's (pickle_dcp.h) as 16 + their DcpGlobal
// (a class's name in ref.storage_key).
enum class Global : uint8_t { OrderedDict, RebuildTensor, RebuildParameter, Storage, Dcp = 16 };
constexpr uint8_t dcp_code(DcpGlobal g) { return static_cast<uint8_t>(Global::Dcp) + static_cast<uint8_t>(g); }

enum class Dialect : uint8_t { Pt, DcpMetadata };

// What the heap spends on an allocation of n bytes (glibc: 8 bytes of
// header, 16-byte granules, 32 at least).
size_t heap(size_t n) { return n == 0 ? 0 : std::max<size_t>(32, (n + 8 + 15) & ~size_t{15}); }
size_t string_heap(size_t n) { return n > 15 ? heap(n + 1) : 0; }
// A string (or dict key) of n bytes weighs 1 + n / kBytesPerValue values:
// kMaxValues then also bounds the bytes a walk of the tree (writing it
// out again) goes through, however often memo references repeat it.
constexpr size_t kBytesPerValue = 32;

class Unpickler {
 public:
  Unpickler(const std::string& in, Dialect dialect)
      : in_(in), dialect_(dialect), budget_(kBudgetBase + std::min<size_t>(in.size(), SIZE_MAX / 2 / kBudgetPerByte) * kBudgetPerByte) {}

  PtValue run() {
    while (true) {
      if (pos_ >= in_.size()) fail_at(pos_, "the pickle ends without STOP (truncated?)");
      op_at_ = pos_;
      const uint8_t op = byte();
      if (op == STOP) break;
      step(op);
    }
    PtValue root = pop();
    if (!stack_.empty() || !marks_.empty()) fail_at(op_at_, "STOP leaves values or a MARK on the stack");
    if (pos_ != in_.size()) fail_at(pos_, std::to_string(in_.size() - pos_) + " bytes after STOP");
    not_special(root, "the pickled value");
    seal(root);
    return root;
  }

 private:
  const std::string& in_;
  const Dialect dialect_;
  size_t pos_ = 0, op_at_ = 0;
  std::vector<PtValue> stack_;
  std::vector<size_t> marks_;
  std::vector<PtValue> memo_;                      // keys 0, 1, 2, ... (what picklers write)
  std::vector<bool> memo_set_;                     // which of memo_ were put
  std::unordered_map<uint32_t, PtValue> sparse_;  // any other key
  const size_t budget_;
  size_t used_ = 0;
  // The weight a finished tree may have: what walking or writing it out
  // again costs stays linear in the input.
  const uint64_t max_weight_ = std::min<uint64_t>(kMaxValues, kValuesPerByte * uint64_t{in_.size()} + 65536);

  [[noreturn]] void fail_at(size_t at, const std::string& what) const {
    throw CheckpointError("pickle byte " + std::to_string(at) + ": " + what);
  }
  [[noreturn]] void fail(const std::string& what) const {
    char op[8];
    std::snprintf(op, sizeof op, "0x%02x", static_cast<uint8_t>(in_[op_at_]));
    fail_at(op_at_, std::string("opcode ") + op + ": " + what);
  }

  // ---- the budget -------------------------------------------------------------
  void charge(size_t n) {
    used_ += n;
    if (used_ > budget_) {
      fail("unpickling needs more than " + std::to_string(budget_ >> 20) + " MiB for a pickle of " +
           std::to_string(in_.size()) + " bytes (memory bounded at " + std::to_string(kBudgetBase >> 20) + " MiB + " +
           std::to_string(kBudgetPerByte) + " x its size)");
    }
  }
  void credit(size_t n) { used_ -= std::min(used_, n); }
  // Appends to a vector, charging what its growth allocates.
  template <class V, class T>
  void grow(V& v, T&& x) {
    const size_t cap = v.capacity();
    v.push_back(std::forward<T>(x));
    if (v.capacity() != cap) charge((v.capacity() - cap) * sizeof(typename V::value_type));
  }
  // What the body of v alone holds on the heap (not its children).
  size_t shallow(const PtValue& v) const {
    switch (v.kind()) {
      case Kind::String: return heap(sizeof(pt_body::String)) + string_heap(v.as_string().size());
      case Kind::List:
      case Kind::Tuple: return heap(sizeof(pt_body::Seq)) + B::seq(v).items.capacity() * sizeof(PtValue);
      case Kind::Dict: {
        size_t n = heap(sizeof(pt_body::Dict)) + B::dict(v).entries.capacity() * sizeof(B::dict(v).entries[0]);
        for (const auto& [k, x] : B::dict(v).entries) n += string_heap(k.size());
        return n;
      }
      case Kind::Tensor: {
        const PtTensorRef& r = static_cast<const TensorBody*>(B::body(v))->ref;
        return heap(sizeof(TensorBody)) + string_heap(r.storage_key.size()) + heap(8 * r.sizes.capacity()) +
               heap(8 * r.strides.capacity());
      }
      default: return 0;
    }
  }
  // v is dropped: what only it held is credited back.
  void discard(const PtValue& v, int depth = 0) {
    const PtValue::Body* b = B::body(v);
    if (b == nullptr || b->refs.load() != 1 || depth > kMaxDepth) return;
    credit(shallow(v));
    if (v.kind() == Kind::List || v.kind() == Kind::Tuple) {
      for (const PtValue& x : B::seq(v).items) discard(x, depth + 1);
    } else if (v.kind() == Kind::Dict) {
      for (const auto& [k, x] : B::dict(v).entries) discard(x, depth + 1);
    }
  }

  // ---- input ---------------------------------------------------------------------
  void need(uint64_t n) {
    if (n > in_.size() - pos_) fail("needs " + std::to_string(n) + " bytes, " + std::to_string(in_.size() - pos_) + " left (truncated?)");
  }
  uint8_t byte() {
    need(1);
    return static_cast<uint8_t>(in_[pos_++]);
  }
  uint64_t le(int bytes) {
    need(static_cast<uint64_t>(bytes));
    const uint64_t v = coding::decode_le(in_.data() + pos_, bytes);
    pos_ += static_cast<size_t>(bytes);
    return v;
  }
  std::string line() {
    const size_t nl = in_.find('\n', pos_);
    if (nl == std::string::npos) fail("a GLOBAL name without its newline (truncated?)");
    if (nl - pos_ > 256) fail("a GLOBAL name of more than 256 bytes");
    std::string s = in_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return s;
  }

  // ---- values ----------------------------------------------------------------
  static const char* kind_name(const PtValue& v) {
    if (v.kind() == Kind::Tensor) {
      switch (static_cast<const TensorBody*>(B::body(v))->role) {
        case TensorBody::Global: return "a global";
        case TensorBody::Storage: return "a storage";
        case TensorBody::Value: return "a tensor";
      }
    }
    static const char* names[] = {"None", "a bool", "an int", "a float", "a string", "a list", "a tuple", "a dict"};
    return names[static_cast<int>(v.kind())];
  }
  static const TensorBody* special(const PtValue& v, TensorBody::Role role) {
    if (v.kind() != Kind::Tensor) return nullptr;
    const auto* t = static_cast<const TensorBody*>(B::body(v));
    return t->role == role ? t : nullptr;
  }
  void not_special(const PtValue& v, const char* where) {
    const PtValue::Body* b = B::body(v);
    if (b == nullptr || !b->special) return;
    fail(std::string(where) + " is or holds a global (a function or class) or a storage, not a value");
  }

  void push(PtValue v) { grow(stack_, std::move(v)); }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  const PtValue& top() {
    if (stack_.size() <= floor()) fail("the stack is empty");
    return stack_.back();
  }
  PtValue pop() {
    top();
    PtValue v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  size_t pop_mark() {
    if (marks_.empty()) fail("no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  const PtValue& expect(const PtValue& v, Kind k, const char* what) {
    if (v.kind() != k || special(v, TensorBody::Global) || special(v, TensorBody::Storage)) {
      fail(std::string(what) + " is " + kind_name(v) + ", not " + kind_name_of(k));
    }
    return v;
  }
  static const char* kind_name_of(Kind k) {
    static const char* names[] = {"None",   "a bool",  "an int", "a float", "a string",
                                  "a list", "a tuple", "a dict", "a tensor"};
    return names[static_cast<int>(k)];
  }

  PtValue make_seq(Kind k) {
    charge(heap(sizeof(pt_body::Seq)));
    return k == Kind::Tuple ? PtValue::tuple({}) : PtValue::list({});
  }
  PtValue make_dict(bool ordered) {
    charge(heap(sizeof(pt_body::Dict)));
    PtValue v = PtValue::dict({});
    B::body(v)->ordered = ordered;
    return v;
  }
  PtValue make_special(TensorBody::Role role) {
    charge(heap(sizeof(TensorBody)));
    PtValue v = PtValue::tensor({});
    auto* t = static_cast<TensorBody*>(B::body(v));
    t->role = role;
    t->special = role != TensorBody::Value;
    return v;
  }

  // v goes into a container: it is final from now on (a dict's repeated
  // keys merged, its vector trimmed).
  void seal(const PtValue& v) {
    PtValue::Body* b = B::body(v);
    if (b == nullptr || b->sealed) return;
    b->sealed = true;
    if (v.kind() == Kind::Dict) merge_keys(B::dict(v));
    if (v.kind() == Kind::List || v.kind() == Kind::Tuple) trim(B::seq(v).items);
    if (v.kind() == Kind::Dict) trim(B::dict(v).entries);
  }
  template <class V>
  void trim(V& v) {
    const size_t cap = v.capacity();
    if (cap == v.size()) return;
    v.shrink_to_fit();
    credit((cap - v.capacity()) * sizeof(typename V::value_type));
  }
  // As Python: a key set twice keeps its first position and its last value.
  void merge_keys(pt_body::Dict& d) {
    auto& e = d.entries;
    if (e.size() < 2) return;
    std::vector<uint32_t> order(e.size());
    charge(heap(order.size() * sizeof(uint32_t)));
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(), [&e](uint32_t a, uint32_t b) { return e[a].first < e[b].first; });
    std::vector<bool> drop(e.size(), false);
    bool any = false;
    for (size_t i = 0; i < order.size();) {
      size_t j = i + 1;
      while (j < order.size() && e[order[j]].first == e[order[i]].first) ++j;
      if (j - i > 1) {
        e[order[i]].second = e[order[j - 1]].second;
        for (size_t k = i + 1; k < j; ++k) drop[order[k]] = true;
        any = true;
      }
      i = j;
    }
    credit(heap(order.size() * sizeof(uint32_t)));
    if (!any) return;
    size_t out = 0;
    uint64_t weight = 1;
    for (size_t i = 0; i < e.size(); ++i) {
      if (drop[i]) continue;
      if (out != i) e[out] = std::move(e[i]);
      weight += B::weight(e[out].second) + e[out].first.size() / kBytesPerValue;
      ++out;
    }
    e.resize(out);
    d.weight = weight;
  }

  // x is put into container c (whose body is not yet sealed).
  void adopt(PtValue::Body& c, const PtValue& x, bool value_only) {
    const PtValue::Body* xb = B::body(x);
    if (xb == &c) fail("a container put into itself (a cycle)");
    if (value_only) not_special(x, "a list item or dict value");
    seal(x);
    c.weight += B::weight(x);
    if (c.weight > max_weight_) {
      fail("more than " + std::to_string(max_weight_) + " values for a pickle of " + std::to_string(in_.size()) +
           " bytes (memo references count each time; a string as 1 per " + std::to_string(kBytesPerValue) + " bytes)");
    }
    c.depth = std::max(c.depth, B::depth(x));
    if (c.depth + 1 > kMaxDepth) fail("values nest deeper than " + std::to_string(kMaxDepth));
    if (xb != nullptr && xb->special) c.special = true;
  }
  PtValue::Body& open_container(const PtValue& v, Kind k, const char* what) {
    expect(v, k, what);
    PtValue::Body& b = *B::body(v);
    if (b.sealed) fail(std::string(what) + " was already put into another container or tuple (a cycle?)");
    return b;
  }

  // The stack's top n items, as a tuple in their place.
  void push_tuple(size_t n) {
    if (stack_.size() - floor() < n) fail("the stack is empty");
    const size_t from = stack_.size() - n;
    PtValue t = make_seq(Kind::Tuple);
    auto& items = B::seq(t).items;
    charge((stack_.size() - from) * sizeof(PtValue));
    items.reserve(stack_.size() - from);
    for (size_t k = from; k < stack_.size(); ++k) {
      adopt(*B::body(t), stack_[k], false);
      items.push_back(std::move(stack_[k]));
    }
    stack_.resize(from);
    push(std::move(t));
  }
  void set_item(const PtValue& dict, PtValue key, PtValue value) {
    PtValue::Body& d = open_container(dict, Kind::Dict, "SETITEM's target");
    auto& int_keys = static_cast<pt_body::Dict&>(d).int_keys;
    int_keys = (B::dict(dict).entries.empty() || int_keys) && key.kind() == Kind::Int;
    if (key.kind() == Kind::Int) {  // an optimizer's state by parameter index
      key = PtValue::string(std::to_string(key.as_int()));
      charge(heap(sizeof(pt_body::String)));
    } else if (key.kind() != Kind::String && dialect_ == Dialect::DcpMetadata) {
      // storage_data's MetadataIndex keys: the pair as the value.
      // (Not through the stack: SETITEMS holds a reference into it.)
      not_special(key, "a dict key");
      const size_t index = B::dict(dict).entries.size();
      PtValue pair = make_seq(Kind::Tuple);
      auto& items = B::seq(pair).items;
      charge(2 * sizeof(PtValue));
      items.reserve(2);
      for (PtValue* x : {&key, &value}) {
        // The pair goes into d: d itself inside it would be a cycle (d is
        // open, so nothing else can hold it yet).
        if (B::body(*x) == &d) fail("a container put into itself (a cycle)");
        adopt(*B::body(pair), *x, false);
        items.push_back(std::move(*x));
      }
      value = std::move(pair);
      key = PtValue::string("\x01" + std::to_string(index));
      charge(heap(sizeof(pt_body::String)));
    }
    if (key.kind() != Kind::String) fail(std::string("a dict key is ") + kind_name(key) + ": .pt values have string or int keys");
    adopt(d, value, true);
    d.weight += key.as_string().size() / kBytesPerValue;
    auto& e = B::dict(dict).entries;
    charge(string_heap(key.as_string().size()));
    grow(e, std::pair<std::string, PtValue>(key.as_string(), std::move(value)));
    discard(key);
  }
  void append(const PtValue& list, PtValue value) {
    PtValue::Body& l = open_container(list, Kind::List, "APPEND's target");
    adopt(l, value, true);
    grow(B::seq(list).items, std::move(value));
  }

  void push_string(uint64_t n) {
    need(n);
    std::string s = in_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    if (!valid_utf8(s)) fail("a string that is not valid UTF-8");
    charge(heap(sizeof(pt_body::String)) + string_heap(s.size()));
    PtValue v = PtValue::string(std::move(s));
    B::body(v)->weight = 1 + n / kBytesPerValue;  // what writing it out again costs
    push(std::move(v));
  }

  void global() {
    const std::string module = line(), name = line();
    push_global(module, name);
  }
  void stack_global() {
    PtValue name = pop();
    PtValue module = pop();
    if (module.kind() != Kind::String || name.kind() != Kind::String) fail("STACK_GLOBAL of something not two strings");
    if (module.as_string().size() > 256 || name.as_string().size() > 256) fail("a global name of more than 256 bytes");
    push_global(module.as_string(), name.as_string());
    discard(module);
    discard(name);
  }
  void push_global(const std::string& module, const std::string& name) {
    if (dialect_ == Dialect::DcpMetadata) return dcp_global(module, name);
    PtValue v = make_special(TensorBody::Global);
    auto* t = static_cast<TensorBody*>(B::body(v));
    c10::ScalarType dtype;
    if (module == "collections" && name == "OrderedDict") {
      t->global = static_cast<uint8_t>(Global::OrderedDict);
    } else if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
      t->global = static_cast<uint8_t>(Global::RebuildTensor);
    } else if (module == "torch._utils" && name == "_rebuild_parameter") {
      t->global = static_cast<uint8_t>(Global::RebuildParameter);
    } else if (module == "torch" && dtype_of_storage_class(name, &dtype)) {
      t->global = static_cast<uint8_t>(Global::Storage);
      t->ref.dtype = dtype;
    } else {
      fail("global '" + module + "." + name + "' is not one .pt files of tensors use");
    }
    push(std::move(v));
  }
  void dcp_global(const std::string& module, const std::string& name) {
    std::string as;
    const DcpGlobal g = pickle::dcp_global(module, name, &as);
    if (g == DcpGlobal::Unknown) fail("global '" + module + "." + name + "' is not a class DCP's .metadata holds");
    if (g == DcpGlobal::Dtype) {  // a value, not called
      charge(heap(sizeof(pt_body::String)) + string_heap(as.size()));
      return push(PtValue::string(std::move(as)));
    }
    PtValue v = make_special(TensorBody::Global);
    auto* t = static_cast<TensorBody*>(B::body(v));
    t->global = g == DcpGlobal::OrderedDict ? static_cast<uint8_t>(Global::OrderedDict) : dcp_code(g);
    charge(string_heap(as.size()));
    t->ref.storage_key = std::move(as);
    push(std::move(v));
  }

  // ---- DCP's objects (dialect DcpMetadata) ---------------------------------------
  PtValue new_object(const PtValue& cls, const PtValue& args) {
    const TensorBody* c = special(cls, TensorBody::Global);
    if (c == nullptr || c->global != dcp_code(DcpGlobal::Class)) fail("NEWOBJ of something not a DCP class");
    if (args.kind() != Kind::Tuple || !args.items().empty()) fail("NEWOBJ of " + c->ref.storage_key + " with arguments");
    PtValue o = make_dict(false);
    charge(string_heap(c->ref.storage_key.size()) + heap(sizeof(pt_body::String)));
    set_item(o, PtValue::string("__class__"), PtValue::string(c->ref.storage_key));
    return o;
  }
  // A DCP object's attributes come from BUILD alone (Python's objects take
  // no SETITEM), and no dict of the pickle's may pose as one.
  void not_an_object(const PtValue& d, const PtValue& key) {
    if (dialect_ != Dialect::DcpMetadata) return;
    if (is_object(d)) fail("SETITEM on an object");
    if (key.kind() == Kind::String && key.as_string() == "__class__") fail("a dict key '__class__'");
  }
  static bool is_object(const PtValue& v) {
    return v.kind() == Kind::Dict && !B::dict(v).entries.empty() && B::dict(v).entries[0].first == "__class__";
  }
  // BUILD: an object's attributes (a dict state), or its __setstate__
  // tuple (TensorProperties) kept as "__state__".
  void build_object(const PtValue& inst, PtValue state) {
    if (state.kind() == Kind::Dict) {
      expect(state, Kind::Dict, "BUILD's state");
      for (const auto& [k, x] : state.entries()) {
        if (k == "__class__" || k == "__state__") fail("an object's attribute named " + k);
        set_item(inst, PtValue::string(k), x);
      }
      discard(state);
      return;
    }
    if (state.kind() != Kind::Tuple) fail(std::string("BUILD of an object with ") + kind_name(state));
    set_item(inst, PtValue::string("__state__"), std::move(state));
  }
  PtValue dcp_reduce(DcpGlobal g, const std::vector<PtValue>& a) {
    if (g == DcpGlobal::TorchSize) {
      if (a.size() != 1) fail("torch.Size with " + std::to_string(a.size()) + " arguments");
      int_tuple(a[0], "a torch.Size");
      return a[0];
    }
    if (g == DcpGlobal::GetAttr) {
      const TensorBody* e = a.size() == 2 ? special(a[0], TensorBody::Global) : nullptr;
      if (e == nullptr || e->global != dcp_code(DcpGlobal::MemFormat)) fail("getattr of something not DCP's memory-format enum");
    }
    std::string s;
    try {
      s = dcp_reduce_string(g, a);
    } catch (const CheckpointError& e) {
      fail(e.what());
    }
    charge(heap(sizeof(pt_body::String)) + string_heap(s.size()));
    return PtValue::string(std::move(s));
  }

  PtValue storage(const PtValue& pid) {
    expect(pid, Kind::Tuple, "the persistent id");
    const auto& p = B::seq(pid).items;
    const TensorBody* cls = p.size() == 5 ? special(p[1], TensorBody::Global) : nullptr;
    if (p.size() != 5 || p[0].kind() != Kind::String || p[0].as_string() != "storage" || cls == nullptr ||
        cls->global != static_cast<uint8_t>(Global::Storage) || p[2].kind() != Kind::String ||
        p[3].kind() != Kind::String || p[4].kind() != Kind::Int) {
      fail("the persistent id is not ('storage', torch.<T>Storage, key, location, numel)");
    }
    if (p[4].as_int() < 0) fail("storage '" + p[2].as_string() + "' has a negative size");
    PtValue s = make_special(TensorBody::Storage);
    PtTensorRef& ref = static_cast<TensorBody*>(B::body(s))->ref;
    charge(string_heap(p[2].as_string().size()));
    ref.storage_key = p[2].as_string();
    ref.dtype = cls->ref.dtype;
    ref.storage_numel = p[4].as_int();
    return s;
  }

  std::vector<int64_t> int_tuple(const PtValue& v, const char* what) {
    expect(v, Kind::Tuple, what);
    const auto& items = B::seq(v).items;
    if (items.size() > kMaxDims) fail(std::string(what) + " has more than " + std::to_string(kMaxDims) + " dimensions");
    std::vector<int64_t> out;
    out.reserve(items.size());
    for (const PtValue& x : items) out.push_back(expect(x, Kind::Int, what).as_int());
    charge(heap(8 * out.capacity()));
    return out;
  }

  static bool empty_hooks(const PtValue& v) { return v.kind() == Kind::Dict && v.entries().empty(); }

  PtValue reduce(const PtValue& func, const PtValue& args) {
    const TensorBody* f = special(func, TensorBody::Global);
    if (f == nullptr) fail(std::string("REDUCE's callable is ") + kind_name(func) + ", not a global");
    expect(args, Kind::Tuple, "REDUCE's arguments");
    const auto& a = B::seq(args).items;
    if (dialect_ == Dialect::DcpMetadata && f->global != static_cast<uint8_t>(Global::OrderedDict)) {
      return dcp_reduce(static_cast<DcpGlobal>(f->global - static_cast<uint8_t>(Global::Dcp)), a);
    }
    switch (static_cast<Global>(f->global)) {
      case Global::OrderedDict:
        if (!a.empty()) fail("OrderedDict with arguments");
        return make_dict(true);
      case Global::RebuildTensor: {
        if (a.size() != 6 && a.size() != 7) fail("_rebuild_tensor_v2 with " + std::to_string(a.size()) + " arguments");
        const TensorBody* st = special(a[0], TensorBody::Storage);
        if (st == nullptr) fail(std::string("the tensor's storage is ") + kind_name(a[0]) + ", not a storage");
        PtValue t = make_special(TensorBody::Value);
        PtTensorRef& ref = static_cast<TensorBody*>(B::body(t))->ref;
        charge(string_heap(st->ref.storage_key.size()));
        ref = st->ref;
        ref.storage_offset = expect(a[1], Kind::Int, "the storage offset").as_int();
        ref.sizes = int_tuple(a[2], "the tensor's size");
        ref.strides = int_tuple(a[3], "the tensor's stride");
        ref.requires_grad = expect(a[4], Kind::Bool, "requires_grad").as_bool();
        if (!empty_hooks(a[5]) || (a.size() == 7 && !empty_hooks(a[6]))) {
          fail("a tensor with backward hooks or metadata");
        }
        const std::string problem = tensor_ref_problem(ref);
        if (!problem.empty()) fail("tensor of storage '" + ref.storage_key + "': " + problem);
        return t;
      }
      case Global::RebuildParameter: {
        if (a.size() != 3) fail("_rebuild_parameter with " + std::to_string(a.size()) + " arguments");
        const PtTensorRef& data = expect(a[0], Kind::Tensor, "the parameter's data").as_tensor();
        PtValue t = make_special(TensorBody::Value);
        PtTensorRef& ref = static_cast<TensorBody*>(B::body(t))->ref;
        charge(string_heap(data.storage_key.size()) + heap(8 * data.sizes.size()) + heap(8 * data.strides.size()));
        ref = data;
        ref.requires_grad = expect(a[1], Kind::Bool, "requires_grad").as_bool();
        ref.parameter = true;
        if (!empty_hooks(a[2])) fail("a parameter with backward hooks");
        return t;
      }
      case Global::Storage: break;
      default: break;
    }
    fail("a storage class called as a function");
  }

  const PtValue& memo_get(uint32_t k) {
    if (k < memo_.size() && memo_set_[k]) return memo_[k];
    const auto it = sparse_.find(k);
    if (it == sparse_.end()) fail("memo entry " + std::to_string(k) + " was never put");
    return it->second;
  }
  void put(uint32_t k) {
    const PtValue& v = top();
    if (k == memo_.size()) {
      grow(memo_, PtValue());
      const size_t cap = memo_set_.capacity();
      memo_set_.push_back(false);
      if (memo_set_.capacity() != cap) charge((memo_set_.capacity() - cap) / 8);
      if (!sparse_.empty()) sparse_.erase(k);
    }
    if (k < memo_.size()) {
      memo_[k] = v;
      memo_set_[k] = true;
      return;
    }
    const auto [it, fresh] = sparse_.emplace(k, v);
    if (!fresh) {
      it->second = v;
    } else {
      charge(heap(sizeof(std::pair<const uint32_t, PtValue>) + 8) + sizeof(void*));
    }
  }

  void step(uint8_t op) {
    switch (op) {
      case PROTO: {
        const uint8_t p = byte();
        if (p < 2 || p > 5) fail("pickle protocol " + std::to_string(p));
        return;
      }
      case FRAME: {
        const uint64_t n = le(8);
        if (n > in_.size() - pos_) fail("a frame past the end (truncated?)");
        return;
      }
      case MARK: return grow(marks_, stack_.size());
      case EMPTY_DICT: return push(make_dict(false));
      case EMPTY_LIST: return push(make_seq(Kind::List));
      case EMPTY_TUPLE: return push(make_seq(Kind::Tuple));
      case TUPLE: {
        const size_t m = pop_mark();
        return push_tuple(stack_.size() - m);
      }
      case TUPLE1: return push_tuple(1);
      case TUPLE2: return push_tuple(2);
      case TUPLE3: return push_tuple(3);
      case SETITEM: {
        PtValue v = pop();
        PtValue k = pop();
        not_an_object(top(), k);
        return set_item(top(), std::move(k), std::move(v));
      }
      case SETITEMS: {
        const size_t m = pop_mark();
        if ((stack_.size() - m) % 2 != 0) fail("an odd number of keys and values");
        if (m <= floor() || m == 0) fail("SETITEMS without a dict below its MARK");
        const PtValue& d = stack_[m - 1];
        open_container(d, Kind::Dict, "SETITEMS' target");
        for (size_t k = m; k < stack_.size(); k += 2) {
          not_an_object(d, stack_[k]);
          set_item(d, std::move(stack_[k]), std::move(stack_[k + 1]));
        }
        stack_.resize(m);
        return;
      }
      case APPEND: {
        PtValue v = pop();
        return append(top(), std::move(v));
      }
      case APPENDS: {
        const size_t m = pop_mark();
        if (m <= floor() || m == 0) fail("APPENDS without a list below its MARK");
        const PtValue& l = stack_[m - 1];
        open_container(l, Kind::List, "APPENDS' target");
        for (size_t k = m; k < stack_.size(); ++k) append(l, std::move(stack_[k]));
        stack_.resize(m);
        return;
      }
      case BINUNICODE: return push_string(le(4));
      case SHORT_BINUNICODE: return push_string(le(1));
      case BINUNICODE8: return push_string(le(8));
      case BININT: return push(PtValue::integer(static_cast<int32_t>(static_cast<uint32_t>(le(4)))));
      case BININT1: return push(PtValue::integer(static_cast<int64_t>(le(1))));
      case BININT2: return push(PtValue::integer(static_cast<int64_t>(le(2))));
      case LONG1: {
        const uint8_t n = byte();
        if (n > 8) fail("an integer of " + std::to_string(n) + " bytes, past int64");
        uint64_t u = n == 0 ? 0 : le(n);
        if (n > 0 && n < 8 && (u >> (8 * n - 1)) & 1) u |= ~uint64_t{0} << (8 * n);  // sign-extend
        return push(PtValue::integer(static_cast<int64_t>(u)));
      }
      case NEWTRUE:
      case NEWFALSE: return push(PtValue::boolean(op == NEWTRUE));
      case NONE: return push(PtValue::none());
      case BINFLOAT: {
        need(8);
        const uint64_t u = coding::decode_be64(in_.data() + pos_);
        pos_ += 8;
        double d;
        std::memcpy(&d, &u, sizeof u);
        return push(PtValue::floating(d));
      }
      case GLOBAL: return global();
      case STACK_GLOBAL: return stack_global();
      case NEWOBJ: {
        if (dialect_ != Dialect::DcpMetadata) break;
        PtValue args = pop();
        PtValue cls = pop();
        PtValue o = new_object(cls, args);
        discard(args);
        return push(std::move(o));
      }
      case REDUCE: {
        PtValue args = pop();
        PtValue func = pop();
        PtValue out = reduce(func, args);
        discard(args);
        return push(std::move(out));
      }
      case BUILD: {
        PtValue state = pop();
        const PtValue& inst = top();
        if (dialect_ == Dialect::DcpMetadata && is_object(inst)) return build_object(inst, std::move(state));
        if (inst.kind() != Kind::Dict || !B::body(inst)->ordered) fail(std::string("BUILD of ") + kind_name(inst));
        // An OrderedDict's attributes (a state dict's _metadata): not kept.
        if (state.kind() != Kind::Dict && !state.is_none()) fail("an OrderedDict's state is not a dict");
        discard(state);
        return;
      }
      case BINPERSID: {
        PtValue pid = pop();
        PtValue s = storage(pid);
        discard(pid);
        return push(std::move(s));
      }
      case BINPUT: return put(static_cast<uint32_t>(le(1)));
      case LONG_BINPUT: return put(static_cast<uint32_t>(le(4)));
      case MEMOIZE: return put(static_cast<uint32_t>(memo_.size() + sparse_.size()));
      case BINGET:
      case LONG_BINGET: return push(memo_get(static_cast<uint32_t>(le(op == BINGET ? 1 : 4))));
      default: break;
    }
    const char c = static_cast<char>(op);
    fail(std::string("not an opcode ") + (dialect_ == Dialect::Pt ? ".pt files" : "DCP's .metadata") + " use" +
         (c >= 0x20 && c < 0x7f ? std::string(" ('") + c + "')" : std::string()));
  }
};

}  // namespace

}  // namespace pickle

PtValue unpickle_value(const std::string& bytes) { return pickle::Unpickler(bytes, pickle::Dialect::Pt).run(); }

PtValue unpickle_dcp_metadata(const std::string& bytes) {
  return pickle::Unpickler(bytes, pickle::Dialect::DcpMetadata).run();
}

}  // namespace tdist::checkpoint
