// A DCP .metadata written (dcp_metadata.h): the pickle PyTorch's
// FileSystemReader loads. Globals are memoized (each class's name once).
#include <map>

#include "formats/dcp_metadata.h"
#include "formats/pickle_format.h"
#include "tdist/errors.h"

namespace tdist::checkpoint::dcp {

namespace {

using namespace pickle;

constexpr const char* kMeta = "torch.distributed.checkpoint.metadata";

class MetadataPickler : public Emitter {
 public:
  std::string run(const Metadata& m) {
    op(PROTO);
    le(2, 1);
    object(kMeta, "Metadata");
    op(EMPTY_DICT);
    op(MARK);
    string("state_dict_metadata");
    dict(m.items, [&](const Item& it) {
      string(it.fqn);
      it.tensor ? tensor_metadata(it) : object(kMeta, "BytesStorageMetadata");
    });
    string("planner_data");
    dict(m.items, [&](const Item& it) {
      string(it.fqn);
      op(MARK);
      for (const auto& p : it.path) p.index ? integer(std::stoll(p.key)) : string(p.key);
      op(TUPLE);
    });
    string("storage_data");
    op(EMPTY_DICT);
    for (const Item& it : m.items) {
      if (!it.tensor) {
        op(MARK);
        index(it.fqn, nullptr);
        storage_info(it.bytes);
        op(SETITEMS);
      }
      for (size_t i = 0; i < it.chunks.size(); ++i) {
        op(MARK);
        index(it.fqn, &it.chunks[i].offsets, static_cast<int64_t>(i));
        storage_info(it.chunks[i].storage);
        op(SETITEMS);
      }
    }
    string("storage_meta");
    op(NONE);
    string("version");
    string("1.0.0");
    op(SETITEMS);
    op(BUILD);
    op(STOP);
    return std::move(out);
  }

 private:
  std::map<std::string, uint32_t> memo_;

  void cached_global(const char* module, const char* name) {
    const std::string key = std::string(module) + "\n" + name;
    const auto it = memo_.find(key);
    if (it != memo_.end()) {
      op(LONG_BINGET);
      return le(it->second, 4);
    }
    global(module, name);
    const uint32_t k = static_cast<uint32_t>(memo_.size());
    op(LONG_BINPUT);
    le(k, 4);
    memo_.emplace(key, k);
  }
  // cls.__new__(cls): BUILD with its state follows.
  void object(const char* module, const char* name) {
    cached_global(module, name);
    op(EMPTY_TUPLE);
    op(NEWOBJ);
  }
  template <class F>
  void dict(const std::vector<Item>& items, F&& each) {
    op(EMPTY_DICT);
    for (size_t i = 0; i < items.size(); i += 1000) {  // in batches, as Python's pickler
      op(MARK);
      for (size_t k = i; k < std::min(items.size(), i + 1000); ++k) each(items[k]);
      op(SETITEMS);
    }
  }
  void size(const std::vector<int64_t>& v) {
    cached_global("torch", "Size");
    int_tuple(v);
    op(TUPLE1);
    op(REDUCE);
  }
  void tensor_metadata(const Item& it) {
    object(kMeta, "TensorStorageMetadata");
    op(EMPTY_DICT);
    op(MARK);
    string("properties");
    object(kMeta, "TensorProperties");
    op(MARK);  // (dtype, layout, requires_grad, memory format, pin_memory)
    cached_global("torch", dtype_name(it.dtype));
    cached_global("torch.serialization", "_get_layout");
    string("torch.strided");
    op(TUPLE1);
    op(REDUCE);
    op(NEWFALSE);
    cached_global("builtins", "getattr");
    cached_global(kMeta, "_MEM_FORMAT_ENCODING");
    string("TORCH_CONTIGUOUS_FORMAT");
    op(TUPLE2);
    op(REDUCE);
    op(NEWFALSE);
    op(TUPLE);
    op(BUILD);
    string("size");
    size(it.size);
    string("chunks");
    op(EMPTY_LIST);
    if (!it.chunks.empty()) {
      op(MARK);
      for (const Chunk& c : it.chunks) {
        object(kMeta, "ChunkStorageMetadata");
        op(EMPTY_DICT);
        op(MARK);
        string("offsets");
        size(c.offsets);
        string("sizes");
        size(c.sizes);
        op(SETITEMS);
        op(BUILD);
      }
      op(APPENDS);
    }
    op(SETITEMS);
    op(BUILD);
  }
  void index(const std::string& fqn, const std::vector<int64_t>* offsets, int64_t i = 0) {
    object(kMeta, "MetadataIndex");
    op(EMPTY_DICT);
    op(MARK);
    string("fqn");
    string(fqn);
    string("offset");
    offsets ? size(*offsets) : op(NONE);
    string("index");
    offsets ? integer(i) : op(NONE);
    op(SETITEMS);
    op(BUILD);
  }
  void storage_info(const Storage& s) {
    if (s.file.empty()) throw UsageError("pickle_metadata: an item without its storage");
    object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
    op(EMPTY_DICT);
    op(MARK);
    string("relative_path");
    string(s.file);
    string("offset");
    integer(static_cast<int64_t>(s.offset));
    string("length");
    integer(static_cast<int64_t>(s.length));
    op(SETITEMS);
    op(BUILD);
  }
  static const char* dtype_name(c10::ScalarType t) {
    switch (t) {
      case c10::kFloat: return "float32";
      case c10::kDouble: return "float64";
      case c10::kHalf: return "float16";
      case c10::kBFloat16: return "bfloat16";
      case c10::kLong: return "int64";
      case c10::kInt: return "int32";
      case c10::kShort: return "int16";
      case c10::kChar: return "int8";
      case c10::kByte: return "uint8";
      case c10::kBool: return "bool";
      default: throw UsageError(std::string("pickle_metadata: dtype ") + c10::toString(t) + " has no DCP name");
    }
  }
};

}  // namespace

std::string pickle_metadata(const Metadata& m) { return MetadataPickler().run(m); }

}  // namespace tdist::checkpoint::dcp
