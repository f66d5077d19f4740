// .pt files: the zip-of-records format that Python's torch.save writes and
// torch.load reads (also with weights_only=True), written and read by
// streaming, one tensor record at a time.
//
// A file is a zip archive (stored, no compression; zip64 when needed) of
//   <archive>/data.pkl      the pickled object (protocol 2), tensors as
//                           persistent ids ("storage", torch.<T>Storage,
//                           key, "cpu", numel) rebuilt by
//                           torch._utils._rebuild_tensor_v2
//   <archive>/data/<key>    each storage's bytes (little-endian), aligned to 64
//   <archive>/version       "3"
//   <archive>/byteorder     "little"
// Each record carries the zip's CRC-32, which the reader checks on every
// read.
//
//   PtValue root = PtValue::dict({{"model", PtValue::dict({{"w", PtValue::tensor(ref)}})}});
//   PtWriter w(path, "archive");
//   w.begin(root);                // data.pkl: names, shapes, dtypes
//   w.write_storage("0", tensor); // every storage key of root, in the order of root's tensors
//   w.finish();                   // synced and renamed into place (AtomicFileWriter)
//
//   PtReader r(path);             // the zip's directory and data.pkl, checked
//   const PtValue& v = r.root();
//   at::Tensor t = r.read_tensor(v.at("model").at("w").as_tensor());
//
// Errors: CheckpointError naming the file and the problem (truncated, a CRC
// that does not match, a pickle opcode or global it does not know, a length
// past the end). Nothing is allocated from a length before it is checked
// against the file's size.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tdist::checkpoint {

class AtomicFileWriter;

// A tensor in a .pt file: a view of one storage record.
struct PtTensorRef {
  std::string storage_key;     // the record is <archive>/data/<storage_key>
  at::ScalarType dtype = at::kFloat;
  int64_t storage_numel = 0;   // elements in the storage record
  int64_t storage_offset = 0;  // in elements
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  bool requires_grad = false;
  bool parameter = false;      // rebuilt as torch.nn.Parameter
};

// The values a .pt file holds: what torch.save of nested dicts, lists,
// tuples, strings, numbers and tensors pickles.
//
// Compact (16 bytes): None, bools, ints and floats inline; strings,
// containers and tensors in a reference-counted body that copies share
// (copying a PtValue is O(1)). Values behave as values: mutable_items and
// mutable_entries copy a shared body first. Only the unpickler
// (PtValueBuilder, pickle_reader.cpp) mutates a shared body in place, to
// give memo references Python's sharing; it also keeps each body's weight
// (values in its subtree, shared ones counted each time) and depth, which
// bound what a walk of the tree costs.
class PtValue {
 public:
  enum class Kind : uint8_t { None, Bool, Int, Float, String, List, Tuple, Dict, Tensor };

  PtValue() : i_(0) {}  // None
  PtValue(const PtValue& o);
  PtValue(PtValue&& o) noexcept;
  PtValue& operator=(const PtValue& o);
  PtValue& operator=(PtValue&& o) noexcept;
  ~PtValue();

  static PtValue none() { return PtValue(); }
  static PtValue boolean(bool b);
  static PtValue integer(int64_t i);
  static PtValue floating(double d);
  static PtValue string(std::string s);
  static PtValue list(std::vector<PtValue> items);
  static PtValue tuple(std::vector<PtValue> items);
  // Keys are strings (what state dicts use); the order is kept.
  static PtValue dict(std::vector<std::pair<std::string, PtValue>> items);
  static PtValue tensor(PtTensorRef ref);
  // A dict keyed by ints (an optimizer's state_dict: its parameters by
  // index), pickled with int keys; its keys read as decimal strings.
  static PtValue int_keyed_dict(std::vector<std::pair<int64_t, PtValue>> items);
  // Whether a dict's keys are ints (int_keyed_dict, or a pickle's dict
  // whose every key was one).
  bool int_keys() const;

  Kind kind() const { return kind_; }
  bool is_none() const { return kind_ == Kind::None; }
  // The accessors throw CheckpointError ("expected a dict, found a list")
  // when the kind differs; the message carries no file name, so callers
  // that know it wrap the error.
  bool as_bool() const;
  int64_t as_int() const;
  double as_float() const;  // an Int converts
  const std::string& as_string() const;
  const std::vector<PtValue>& items() const;  // List or Tuple
  const std::vector<std::pair<std::string, PtValue>>& entries() const;  // Dict
  const PtTensorRef& as_tensor() const;
  // Dict lookup: null when absent; at() throws CheckpointError naming the key.
  const PtValue* find(const std::string& key) const;
  const PtValue& at(const std::string& key) const;

  // Mutable access for building trees (a body shared with a copy is copied
  // first).
  std::vector<PtValue>& mutable_items();
  std::vector<std::pair<std::string, PtValue>>& mutable_entries();

  struct Body;  // defined in pt_value.cpp

 private:
  friend struct PtValueBuilder;
  void release() noexcept;
  void unshare();
  Kind kind_ = Kind::None;
  union {
    bool b_;
    int64_t i_;
    double d_;
    Body* body_;  // String, List, Tuple, Dict, Tensor: never null
  };
};

// The pickle of a value (protocol 2, what torch.load reads with
// weights_only=True), and back. unpickle accepts what Python's torch.save
// writes for such values (memo opcodes, OrderedDict, _rebuild_tensor_v2,
// _rebuild_parameter) and refuses any other global or opcode.
//
// Dict keys that are ints (an optimizer's state_dict keys its parameters
// by index) read as their decimal strings.
std::string pickle_value(const PtValue& root);
PtValue unpickle_value(const std::string& bytes);

// The pickle of a DCP checkpoint's .metadata (dcp_metadata.h reads what it
// means): the same machine with another allowlist, exactly the classes DCP
// pickles (its dataclasses, old `torch.distributed._shard` names too,
// torch.Size, dtypes, layouts, the memory-format enum, paths). An object
// (NEWOBJ of an allowed class, then BUILD) reads as a dict whose first
// entry is "__class__" -> the class's name, then its attributes (a tuple
// state, TensorProperties', as "__state__"); torch.Size as a tuple of
// ints; a dtype, layout, enum member or path as a string ("torch.float32",
// "torch.strided", "_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT"). A dict
// key that is neither a string nor an int (storage_data's MetadataIndex)
// makes the entry "\x01<n>" -> (key, value). Any other global is a
// CheckpointError naming it; nothing is ever called.
PtValue unpickle_dcp_metadata(const std::string& bytes);

// Whether a tensor's view holds its elements in row-major order from its
// storage offset (a contiguous tensor's strides; any stride for a dim of
// size 1).
bool view_is_contiguous(const PtTensorRef& ref);
// The view's elements, row-major, from its storage held whole
// (`storage`: storage_numel elements; `out`: the view's numel).
void gather_view(const PtTensorRef& ref, const void* storage, void* out);

// Added: the same tree (kinds, order, values; floats bit for bit, so a NaN
// equals itself; tensors by every field of their PtTensorRef).
bool operator==(const PtValue& a, const PtValue& b);
inline bool operator!=(const PtValue& a, const PtValue& b) { return !(a == b); }

class PtWriter {
 public:
  // `archive` names the records' top folder (torch.save uses the file's
  // stem; torch.load accepts any).
  PtWriter(const std::string& path, std::string archive = "archive");
  // An archive appended to a file another writes (a DCP rank file holds
  // one per tensor): its offsets count from where it starts; finish()
  // ends it, and the file's owner syncs and commits.
  PtWriter(AtomicFileWriter& into, std::string archive);
  ~PtWriter();
  PtWriter(const PtWriter&) = delete;
  PtWriter& operator=(const PtWriter&) = delete;

  // Writes data.pkl. Every tensor of root must name a distinct storage key
  // with storage_offset 0, contiguous strides and storage_numel = its numel.
  void begin(const PtValue& root);
  // The next storage, in the order root's tensors appear (depth first, as
  // pickled): key, dtype and numel must match; contiguous (or copied).
  // (Defined in pt_tensor.cpp, with LibTorch; the rest needs c10 only.)
  void write_storage(const std::string& key, const at::Tensor& tensor);
  // The storage to be written next, or null when all are.
  const PtTensorRef* next_storage() const;
  // Raw bytes of the next storage, in pieces: begin_storage, then append
  // exactly its byte size, then end_storage.
  void begin_storage(const std::string& key);
  void append(const void* data, size_t n);
  void end_storage();
  // Every storage written: version, byteorder, the central directory;
  // fsync and rename into place. Without it the target path is untouched.
  void finish();
  // finish() in two steps, for saves that rename several files together:
  // sync() completes and fsyncs the temporary file, commit() renames it.
  void sync();
  void commit();
  const std::string& path() const;
  // The archive's bytes so far.
  uint64_t bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class PtReader {
 public:
  explicit PtReader(const std::string& path);
  // A .pt file inside another, at bytes [base, base + length) (a DCP
  // item: one torch.save at its offset in a rank's file).
  PtReader(const std::string& path, uint64_t base, uint64_t length);
  ~PtReader();
  PtReader(const PtReader&) = delete;
  PtReader& operator=(const PtReader&) = delete;

  const PtValue& root() const;
  // The tensor (a fresh CPU tensor, requires_grad false), its record's
  // CRC checked. (Defined in pt_tensor.cpp, with LibTorch.)
  at::Tensor read_tensor(const PtTensorRef& ref) const;
  // CheckpointError unless the record of `ref` exists and holds exactly
  // its storage (ref's numel is checked against the file before anything
  // is allocated from it).
  void check_storage(const PtTensorRef& ref) const;
  // check_storage, and the view of `ref` stays inside its storage and
  // names no element twice: what read_tensor checks before it reads.
  // (Defined in pt_tensor.cpp.)
  void check_tensor(const PtTensorRef& ref) const;
  // The whole storage record of `ref` (checked against it: size, and bools
  // 0 or 1) into `out`, which holds its storage_numel elements.
  void read_storage(const PtTensorRef& ref, void* out) const;
  // The same handed to `sink` in order, 1 MiB at a time. The CRC is
  // checked after the last piece: until the call returns, what the sink
  // got is unverified (keep nothing of it on an exception).
  using ByteSink = std::function<void(const char* data, size_t n)>;
  void stream_storage(const PtTensorRef& ref, const ByteSink& sink) const;
  // The first `n` bytes of the storage record into `out` (n at most its
  // size); the rest of the record is read through a small buffer so that
  // the CRC covers all of it. Memory: `out` and a few MiB.
  void read_storage_into(const std::string& key, void* out, uint64_t n) const;
  uint64_t storage_bytes(const std::string& key) const;
  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tdist::checkpoint
