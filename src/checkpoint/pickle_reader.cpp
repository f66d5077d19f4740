// unpickle_value: a restricted unpickler for the data.pkl of .pt files.
// It runs the pickle machine over objects of its own (an arena, so that
// memo references and even cycles are safe) for the opcodes torch.save
// emits, and knows four kinds of global: collections.OrderedDict,
// torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter and the
// storage classes torch.<T>Storage. Anything else is a CheckpointError
// naming the opcode or global and its byte. The result is converted to a
// PtValue under limits of depth, count and string bytes (memo references
// could otherwise blow a small pickle up).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <unordered_map>

#include "checkpoint/pickle_format.h"
#include "checkpoint/pt_file.h"
#include "tdist/errors.h"

namespace tdist::checkpoint {

namespace pickle {

namespace {

enum class Global { OrderedDict, RebuildTensor, RebuildParameter, Storage };

struct Obj {
  enum Kind { None, Bool, Int, Float, Str, List, Tuple, Dict, Tensor, Func, Storage } kind = None;
  bool b = false;
  int64_t i = 0;
  double d = 0;
  std::string s;                                    // Str
  std::vector<Obj*> items;                          // List, Tuple
  std::vector<std::pair<std::string, Obj*>> entries;  // Dict, in order
  std::unordered_map<std::string, size_t> index;    // Dict: key -> entries position
  bool ordered = false;                             // Dict made by OrderedDict()
  Global func = Global::OrderedDict;                // Func
  PtTensorRef ref;                                  // Tensor; Storage: key, dtype, numel
};

const char* kind_name(Obj::Kind k) {
  static const char* names[] = {"None", "a bool", "an int",  "a float",    "a string", "a list",
                                "a tuple", "a dict", "a tensor", "a global", "a storage"};
  return names[k];
}

class Unpickler {
 public:
  explicit Unpickler(const std::string& in) : in_(in) {}

  PtValue run() {
    while (true) {
      if (pos_ >= in_.size()) fail_at(pos_, "the pickle ends without STOP (truncated?)");
      op_at_ = pos_;
      const uint8_t op = byte();
      if (op == STOP) break;
      step(op);
    }
    Obj* root = pop();
    if (!stack_.empty() || !marks_.empty()) fail_at(op_at_, "STOP leaves values or a MARK on the stack");
    if (pos_ != in_.size()) fail_at(pos_, std::to_string(in_.size() - pos_) + " bytes after STOP");
    return convert(root, 0);
  }

 private:
  const std::string& in_;
  size_t pos_ = 0, op_at_ = 0;
  std::deque<Obj> arena_;
  std::vector<Obj*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint32_t, Obj*> memo_;
  size_t values_ = 0, string_bytes_ = 0;  // of the PtValue being built

  [[noreturn]] void fail_at(size_t at, const std::string& what) const {
    throw CheckpointError("pickle byte " + std::to_string(at) + ": " + what);
  }
  [[noreturn]] void fail(const std::string& what) const {
    char op[8];
    std::snprintf(op, sizeof op, "0x%02x", static_cast<uint8_t>(in_[op_at_]));
    fail_at(op_at_, std::string("opcode ") + op + ": " + what);
  }

  void need(uint64_t n) {
    if (n > in_.size() - pos_) fail("needs " + std::to_string(n) + " bytes, " + std::to_string(in_.size() - pos_) + " left (truncated?)");
  }
  uint8_t byte() {
    need(1);
    return static_cast<uint8_t>(in_[pos_++]);
  }
  uint64_t le(int bytes) {
    need(static_cast<uint64_t>(bytes));
    uint64_t v = 0;
    for (int k = bytes - 1; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(in_[pos_ + static_cast<size_t>(k)]);
    pos_ += static_cast<size_t>(bytes);
    return v;
  }
  std::string bytes(uint64_t n) {
    need(n);
    std::string s = in_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  std::string line() {
    const size_t nl = in_.find('\n', pos_);
    if (nl == std::string::npos) fail("a GLOBAL name without its newline (truncated?)");
    if (nl - pos_ > 256) fail("a GLOBAL name of more than 256 bytes");
    std::string s = in_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return s;
  }

  Obj* make(Obj::Kind k) {
    arena_.emplace_back();
    arena_.back().kind = k;
    return &arena_.back();
  }
  void push(Obj* o) { stack_.push_back(o); }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  Obj* top() {
    if (stack_.size() <= floor()) fail("the stack is empty");
    return stack_.back();
  }
  Obj* pop() {
    Obj* o = top();
    stack_.pop_back();
    return o;
  }
  std::vector<Obj*> pop_mark() {
    if (marks_.empty()) fail("no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Obj*> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  Obj* expect(Obj* o, Obj::Kind k, const char* what) {
    if (o->kind != k) fail(std::string(what) + " is " + kind_name(o->kind) + ", not " + kind_name(k));
    return o;
  }

  void push_string(uint64_t n) {
    Obj* o = make(Obj::Str);
    o->s = bytes(n);
    if (!valid_utf8(o->s)) fail("a string that is not valid UTF-8");
    push(o);
  }
  void push_int(int64_t v) {
    Obj* o = make(Obj::Int);
    o->i = v;
    push(o);
  }
  void push_tuple(std::vector<Obj*> items) {
    Obj* o = make(Obj::Tuple);
    o->items = std::move(items);
    push(o);
  }
  void set_item(Obj* dict, Obj* key, Obj* value) {
    if (key->kind != Obj::Str) fail(std::string("a dict key is ") + kind_name(key->kind) + ": .pt values have string keys");
    const auto [it, fresh] = dict->index.emplace(key->s, dict->entries.size());
    if (fresh) {
      dict->entries.emplace_back(key->s, value);
    } else {
      dict->entries[it->second].second = value;  // as Python: the later value, the first position
    }
  }

  void global() {
    const std::string module = line(), name = line();
    Obj* o = make(Obj::Func);
    c10::ScalarType t;
    if (module == "collections" && name == "OrderedDict") {
      o->func = Global::OrderedDict;
    } else if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
      o->func = Global::RebuildTensor;
    } else if (module == "torch._utils" && name == "_rebuild_parameter") {
      o->func = Global::RebuildParameter;
    } else if (module == "torch" && dtype_of_storage_class(name, &t)) {
      o->func = Global::Storage;
      o->ref.dtype = t;
    } else {
      fail("global '" + module + "." + name + "' is not one .pt files of tensors use");
    }
    push(o);
  }

  Obj* storage(Obj* pid) {
    expect(pid, Obj::Tuple, "the persistent id");
    const auto& p = pid->items;
    if (p.size() != 5 || p[0]->kind != Obj::Str || p[0]->s != "storage" || p[1]->kind != Obj::Func ||
        p[1]->func != Global::Storage || p[2]->kind != Obj::Str || p[3]->kind != Obj::Str || p[4]->kind != Obj::Int) {
      fail("the persistent id is not ('storage', torch.<T>Storage, key, location, numel)");
    }
    if (p[4]->i < 0) fail("storage '" + p[2]->s + "' has a negative size");
    Obj* s = make(Obj::Storage);
    s->ref.storage_key = p[2]->s;
    s->ref.dtype = p[1]->ref.dtype;
    s->ref.storage_numel = p[4]->i;
    return s;
  }

  std::vector<int64_t> int_tuple(Obj* o, const char* what) {
    expect(o, Obj::Tuple, what);
    std::vector<int64_t> v;
    for (Obj* x : o->items) v.push_back(expect(x, Obj::Int, what)->i);
    return v;
  }

  bool empty_hooks(Obj* o) { return o->kind == Obj::Dict && o->entries.empty(); }

  Obj* reduce(Obj* func, Obj* args) {
    expect(func, Obj::Func, "REDUCE's callable");
    expect(args, Obj::Tuple, "REDUCE's arguments");
    const auto& a = args->items;
    switch (func->func) {
      case Global::OrderedDict: {
        if (!a.empty()) fail("OrderedDict with arguments");
        Obj* d = make(Obj::Dict);
        d->ordered = true;
        return d;
      }
      case Global::RebuildTensor: {
        if (a.size() != 6 && a.size() != 7) fail("_rebuild_tensor_v2 with " + std::to_string(a.size()) + " arguments");
        Obj* t = make(Obj::Tensor);
        t->ref = expect(a[0], Obj::Storage, "the tensor's storage")->ref;
        t->ref.storage_offset = expect(a[1], Obj::Int, "the storage offset")->i;
        t->ref.sizes = int_tuple(a[2], "the tensor's size");
        t->ref.strides = int_tuple(a[3], "the tensor's stride");
        t->ref.requires_grad = expect(a[4], Obj::Bool, "requires_grad")->b;
        if (!empty_hooks(a[5]) || (a.size() == 7 && !empty_hooks(a[6]))) {
          fail("a tensor with backward hooks or metadata");
        }
        const std::string problem = tensor_ref_problem(t->ref);
        if (!problem.empty()) fail("tensor of storage '" + t->ref.storage_key + "': " + problem);
        return t;
      }
      case Global::RebuildParameter: {
        if (a.size() != 3) fail("_rebuild_parameter with " + std::to_string(a.size()) + " arguments");
        Obj* t = make(Obj::Tensor);
        t->ref = expect(a[0], Obj::Tensor, "the parameter's data")->ref;
        t->ref.requires_grad = expect(a[1], Obj::Bool, "requires_grad")->b;
        t->ref.parameter = true;
        if (!empty_hooks(a[2])) fail("a parameter with backward hooks");
        return t;
      }
      case Global::Storage: break;
    }
    fail("a storage class called as a function");
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
      case MARK: return marks_.push_back(stack_.size());
      case EMPTY_DICT: return push(make(Obj::Dict));
      case EMPTY_LIST: return push(make(Obj::List));
      case EMPTY_TUPLE: return push_tuple({});
      case TUPLE: return push_tuple(pop_mark());
      case TUPLE1: {
        Obj* a = pop();
        return push_tuple({a});
      }
      case TUPLE2: {
        Obj* b = pop();
        Obj* a = pop();
        return push_tuple({a, b});
      }
      case TUPLE3: {
        Obj* c = pop();
        Obj* b = pop();
        Obj* a = pop();
        return push_tuple({a, b, c});
      }
      case SETITEM: {
        Obj* v = pop();
        Obj* k = pop();
        return set_item(expect(top(), Obj::Dict, "SETITEM's target"), k, v);
      }
      case SETITEMS: {
        const std::vector<Obj*> kv = pop_mark();
        if (kv.size() % 2 != 0) fail("an odd number of keys and values");
        Obj* d = expect(top(), Obj::Dict, "SETITEMS' target");
        for (size_t k = 0; k < kv.size(); k += 2) set_item(d, kv[k], kv[k + 1]);
        return;
      }
      case APPEND: {
        Obj* v = pop();
        return expect(top(), Obj::List, "APPEND's target")->items.push_back(v);
      }
      case APPENDS: {
        const std::vector<Obj*> items = pop_mark();
        Obj* l = expect(top(), Obj::List, "APPENDS' target");
        l->items.insert(l->items.end(), items.begin(), items.end());
        return;
      }
      case BINUNICODE: return push_string(le(4));
      case SHORT_BINUNICODE: return push_string(le(1));
      case BINUNICODE8: return push_string(le(8));
      case BININT: return push_int(static_cast<int32_t>(static_cast<uint32_t>(le(4))));
      case BININT1: return push_int(static_cast<int64_t>(le(1)));
      case BININT2: return push_int(static_cast<int64_t>(le(2)));
      case LONG1: {
        const uint8_t n = byte();
        if (n > 8) fail("an integer of " + std::to_string(n) + " bytes, past int64");
        uint64_t u = n == 0 ? 0 : le(n);
        if (n > 0 && n < 8 && (u >> (8 * n - 1)) & 1) u |= ~uint64_t{0} << (8 * n);  // sign-extend
        return push_int(static_cast<int64_t>(u));
      }
      case NEWTRUE:
      case NEWFALSE: {
        Obj* o = make(Obj::Bool);
        o->b = op == NEWTRUE;
        return push(o);
      }
      case NONE: return push(make(Obj::None));
      case BINFLOAT: {
        need(8);
        uint64_t u = 0;
        for (int k = 0; k < 8; ++k) u = (u << 8) | static_cast<uint8_t>(in_[pos_ + static_cast<size_t>(k)]);
        pos_ += 8;
        Obj* o = make(Obj::Float);
        std::memcpy(&o->d, &u, sizeof u);
        return push(o);
      }
      case GLOBAL: return global();
      case REDUCE: {
        Obj* args = pop();
        Obj* func = pop();
        return push(reduce(func, args));
      }
      case BUILD: {
        Obj* state = pop();
        Obj* inst = top();
        if (inst->kind != Obj::Dict || !inst->ordered) fail(std::string("BUILD of ") + kind_name(inst->kind));
        // An OrderedDict's attributes (a state dict's _metadata): not kept.
        if (state->kind != Obj::Dict && state->kind != Obj::None) fail("an OrderedDict's state is not a dict");
        return;
      }
      case BINPERSID: return push(storage(pop()));
      case BINPUT: return put(static_cast<uint32_t>(le(1)));
      case LONG_BINPUT: return put(static_cast<uint32_t>(le(4)));
      case MEMOIZE: return put(static_cast<uint32_t>(memo_.size()));
      case BINGET:
      case LONG_BINGET: {
        const uint32_t k = static_cast<uint32_t>(le(op == BINGET ? 1 : 4));
        const auto it = memo_.find(k);
        if (it == memo_.end()) fail("memo entry " + std::to_string(k) + " was never put");
        return push(it->second);
      }
      default: {
        const char c = static_cast<char>(op);
        fail(std::string("not an opcode .pt files use") +
             (c >= 0x20 && c < 0x7f ? std::string(" ('") + c + "')" : std::string()));
      }
    }
  }

  void put(uint32_t k) { memo_[k] = top(); }

  PtValue convert(const Obj* o, int depth) {
    if (depth > kMaxDepth) throw CheckpointError("pickle: values nest deeper than " + std::to_string(kMaxDepth));
    if (++values_ > kMaxValues) throw CheckpointError("pickle: more than " + std::to_string(kMaxValues) + " values");
    switch (o->kind) {
      case Obj::None: return PtValue::none();
      case Obj::Bool: return PtValue::boolean(o->b);
      case Obj::Int: return PtValue::integer(o->i);
      case Obj::Float: return PtValue::floating(o->d);
      case Obj::Str: return PtValue::string(counted(o->s));
      case Obj::List:
      case Obj::Tuple: {
        std::vector<PtValue> items;
        items.reserve(std::min(o->items.size(), kMaxValues - values_ + 1));
        for (const Obj* x : o->items) items.push_back(convert(x, depth + 1));
        return o->kind == Obj::List ? PtValue::list(std::move(items)) : PtValue::tuple(std::move(items));
      }
      case Obj::Dict: {
        std::vector<std::pair<std::string, PtValue>> entries;
        entries.reserve(std::min(o->entries.size(), kMaxValues - values_ + 1));
        for (const auto& [k, v] : o->entries) entries.emplace_back(counted(k), convert(v, depth + 1));
        return PtValue::dict(std::move(entries));
      }
      case Obj::Tensor: return PtValue::tensor(counted_ref(o->ref));
      case Obj::Func: throw CheckpointError("pickle: a global (a function or class) as a value");
      case Obj::Storage: throw CheckpointError("pickle: a storage outside a tensor");
    }
    throw CheckpointError("pickle: an unknown value");
  }

  const std::string& counted(const std::string& s) {
    string_bytes_ += s.size();
    if (string_bytes_ > kMaxStringBytes) {
      throw CheckpointError("pickle: more than " + std::to_string(kMaxStringBytes) + " bytes of strings");
    }
    return s;
  }
  const PtTensorRef& counted_ref(const PtTensorRef& r) {
    counted(r.storage_key);
    string_bytes_ += 8 * (r.sizes.size() + r.strides.size());
    return r;
  }
};

}  // namespace

}  // namespace pickle

PtValue unpickle_value(const std::string& bytes) { return pickle::Unpickler(bytes).run(); }

}  // namespace tdist::checkpoint
