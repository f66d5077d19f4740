// The pieces of Python's pickle format that .pt files use, shared by
// pickle_writer.cpp and pickle_reader.cpp: opcode bytes, the storage
// classes per dtype, the limits the reader keeps. Internal to libtdist.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "formats/pt_file.h"
#include "tdist/errors.h"
#include "util/coding.h"

namespace tdist::checkpoint::pickle {

// Opcodes (Lib/pickletools.py names them).
enum Op : uint8_t {
  MARK = '(',
  STOP = '.',
  BINFLOAT = 'G',
  BININT = 'J',
  BININT1 = 'K',
  BININT2 = 'M',
  NONE = 'N',
  BINPERSID = 'Q',
  REDUCE = 'R',
  BINUNICODE = 'X',
  APPEND = 'a',
  BUILD = 'b',
  GLOBAL = 'c',
  APPENDS = 'e',
  BINGET = 'h',
  LONG_BINGET = 'j',
  EMPTY_LIST = ']',
  BINPUT = 'q',
  LONG_BINPUT = 'r',
  SETITEM = 's',
  TUPLE = 't',
  SETITEMS = 'u',
  EMPTY_DICT = '}',
  EMPTY_TUPLE = ')',
  PROTO = 0x80,
  TUPLE1 = 0x85,
  TUPLE2 = 0x86,
  TUPLE3 = 0x87,
  NEWTRUE = 0x88,
  NEWFALSE = 0x89,
  LONG1 = 0x8a,
  SHORT_BINUNICODE = 0x8c,  // protocol 4
  BINUNICODE8 = 0x8d,       // protocol 4
  NEWOBJ = 0x81,            // protocol 2: cls.__new__(cls, *args)
  STACK_GLOBAL = 0x93,      // protocol 4
  MEMOIZE = 0x94,           // protocol 4
  FRAME = 0x95,             // protocol 4
};

// The protocol torch.save writes (and the only one torch.load's
// weights_only unpickler takes without a warning).
constexpr int kProtocol = 2;

// Reader limits, checked as each value is made: nesting deeper than
// kMaxDepth; more than kMaxValues values, and more than kValuesPerByte per
// byte of the pickle (+ 65536) (what a walk of the result visits: a memo
// reference counts its subtree again); more memory than
// kBudgetBase + kBudgetPerByte x the pickle's size (every value, string,
// container slot, stack and memo entry counted as it is allocated).
constexpr int kMaxDepth = 100;
constexpr size_t kMaxValues = size_t{1} << 22;
constexpr size_t kValuesPerByte = 16;
constexpr size_t kBudgetBase = size_t{48} << 20;
constexpr size_t kBudgetPerByte = 16;
constexpr size_t kMaxDims = 64;

// The dtype torch.<name> names ("float32", "float", "bfloat16", ...);
// false when unknown or one .pt files of tdist do not hold.
bool dtype_of_name(const std::string& name, c10::ScalarType* out);

// torch.<name> for a dtype's storage class ("FloatStorage"); null for a
// dtype .pt files of tdist do not hold.
const char* storage_class(c10::ScalarType t);
// The dtype of a storage class name; false when unknown.
bool dtype_of_storage_class(const std::string& name, c10::ScalarType* out);

// What is wrong with a tensor's view of its storage ("" when nothing): a
// dtype without a storage class, negative or overflowing sizes, strides or
// offset, more than kMaxDims dimensions, elements past the storage's end.
std::string tensor_ref_problem(const PtTensorRef& ref);

// Whether s is UTF-8 as Python's pickle reads it (surrogates allowed, as
// its "surrogatepass" writes them).
bool valid_utf8(const std::string& s);

// The pickle's primitives, written: what pickle_value (pickle_writer.cpp)
// and DCP's .metadata writer (dcp_metadata_writer.cpp) emit values with.
// string() refuses what is not UTF-8 (UsageError).
class Emitter {
 public:
  std::string out;

  void op(Op o) { out.push_back(static_cast<char>(o)); }

  void le(uint64_t v, int bytes) { coding::put_le(out, v, bytes); }

  void integer(int64_t i) {
    if (i >= 0 && i < 256) {
      op(BININT1);
      le(static_cast<uint64_t>(i), 1);
    } else if (i >= 0 && i < 65536) {
      op(BININT2);
      le(static_cast<uint64_t>(i), 2);
    } else if (i >= INT32_MIN && i <= INT32_MAX) {
      op(BININT);
      le(static_cast<uint64_t>(i), 4);
    } else {
      // LONG1: the fewest little-endian two's-complement bytes.
      uint8_t b[8];
      coding::encode_le(reinterpret_cast<char*>(b), static_cast<uint64_t>(i), 8);
      int n = 8;
      while (n > 1 && ((b[n - 1] == 0 && !(b[n - 2] & 0x80)) || (b[n - 1] == 0xff && (b[n - 2] & 0x80)))) --n;
      op(LONG1);
      le(static_cast<uint64_t>(n), 1);
      out.append(reinterpret_cast<const char*>(b), static_cast<size_t>(n));
    }
  }

  void floating(double d) {
    uint64_t u;
    std::memcpy(&u, &d, sizeof u);
    op(BINFLOAT);
    coding::put_be64(out, u);
  }

  void string(const std::string& s) {
    if (!valid_utf8(s)) throw UsageError("pickle: a string is not valid UTF-8");
    if (s.size() > UINT32_MAX) throw UsageError("pickle: a string of 4 GiB or more");
    op(BINUNICODE);
    le(s.size(), 4);
    out += s;
  }

  void global(const char* module, const char* name) {
    op(GLOBAL);
    out += module;
    out += '\n';
    out += name;
    out += '\n';
  }

  void int_tuple(const std::vector<int64_t>& v) {
    if (v.empty()) return op(EMPTY_TUPLE);
    if (v.size() > 3) op(MARK);
    for (int64_t x : v) integer(x);
    op(v.size() == 1 ? TUPLE1 : v.size() == 2 ? TUPLE2 : v.size() == 3 ? TUPLE3 : TUPLE);
  }
};

}  // namespace tdist::checkpoint::pickle
