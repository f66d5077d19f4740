// A DCP folder's .metadata read and checked (dcp_metadata.h).
#include "formats/dcp_metadata.h"

#include <sys/stat.h>

#include <algorithm>
#include <set>

#include "formats/file_io.h"
#include "formats/pickle_format.h"
#include "formats/pt_file.h"
#include "tdist/errors.h"
#include "util/open_file.h"

namespace tdist::checkpoint::dcp {

namespace {

using Kind = PtValue::Kind;

// Chunks of a tensor split along several dimensions are checked pairwise
// for overlap; past this many, refused (a split along dim 0 alone, which
// FSDP's is, is checked by one sort whatever its count).
constexpr size_t kMaxPairwiseChunks = 2048;
constexpr int64_t kMaxNumel = int64_t{1} << 62;
// The fewest bytes of .metadata a key, or a chunk, takes in a file (their
// counts are bounded by it).
constexpr size_t kBytesPerItem = 16;

class Interpreter {
 public:
  Interpreter(std::string where, size_t bytes) : where_(std::move(where)), bytes_(bytes) {}

  Metadata run(const PtValue& root) {
    expect_class(root, "Metadata", "the root");
    const PtValue& sdm = attr(root, "state_dict_metadata", "Metadata");
    if (sdm.kind() != Kind::Dict) fail("state_dict_metadata is not a dict");
    // What the items take grows with their count, which memo references
    // can make large from few bytes: a real .metadata spends hundreds of
    // bytes on each (its class, chunk and storage entry).
    if (sdm.entries().size() > bytes_ / kBytesPerItem + 64) {
      fail(std::to_string(sdm.entries().size()) + " keys in a file of " + std::to_string(bytes_) +
           " bytes (at most one per " + std::to_string(kBytesPerItem) + ")");
    }
    for (const auto& [fqn, v] : sdm.entries()) {
      if (fqn.rfind('\x01', 0) == 0) fail("state_dict_metadata has a key that is not a string");
      m_.by_fqn.emplace(fqn, m_.items.size());
      m_.items.push_back(item(fqn, v));
    }
    if (const PtValue* pd = root.find("planner_data"); pd != nullptr && !pd->is_none()) planner_data(*pd);
    const PtValue& sd = attr(root, "storage_data", "Metadata");
    if (sd.kind() != Kind::Dict) fail("storage_data is not a dict");
    for (const auto& [k, v] : sd.entries()) storage_entry(k, v);
    for (const Item& it : m_.items) {
      if (it.tensor) {
        for (const Chunk& c : it.chunks) {
          if (c.storage.file.empty()) fail("'" + it.fqn + "': no storage entry for its chunk at " + dims(c.offsets));
        }
      } else if (it.bytes.file.empty()) {
        fail("'" + it.fqn + "': no storage entry");
      }
    }
    if (const PtValue* v = root.find("version"); v != nullptr && !v->is_none()) {
      if (v->kind() != Kind::String || v->as_string().size() > 64) fail("version is not a short string");
      m_.version = v->as_string();
    }
    return std::move(m_);
  }

 private:
  std::string where_;
  size_t bytes_;
  size_t chunks_ = 0;
  Metadata m_;
  std::set<std::pair<size_t, size_t>> stored_;  // (item, chunk) given a storage entry

  [[noreturn]] void fail(const std::string& what) const { throw CheckpointError(where_ + ": .metadata: " + what); }

  static std::string dims(const std::vector<int64_t>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  }
  static const std::string* class_of(const PtValue& v) {
    if (v.kind() != Kind::Dict || v.entries().empty() || v.entries()[0].first != "__class__") return nullptr;
    const PtValue& c = v.entries()[0].second;
    return c.kind() == Kind::String ? &c.as_string() : nullptr;
  }
  void expect_class(const PtValue& v, const char* cls, const std::string& what) const {
    const std::string* c = class_of(v);
    if (c == nullptr || *c != cls) fail(what + " is not a " + cls + (c ? " but a " + *c : std::string()));
  }
  const PtValue& attr(const PtValue& obj, const char* name, const char* cls) const {
    const PtValue* v = obj.find(name);
    if (v == nullptr) fail(std::string("a ") + cls + " without its " + name);
    return *v;
  }
  std::vector<int64_t> ints(const PtValue& v, const std::string& what) const {
    if (v.kind() != Kind::Tuple && v.kind() != Kind::List) fail(what + " is not a tuple of ints");
    if (v.items().size() > pickle::kMaxDims) fail(what + " has more than " + std::to_string(pickle::kMaxDims) + " dims");
    std::vector<int64_t> out;
    for (const PtValue& x : v.items()) {
      if (x.kind() != Kind::Int || x.as_int() < 0) fail(what + " holds something not an int >= 0");
      out.push_back(x.as_int());
    }
    return out;
  }

  Item item(const std::string& fqn, const PtValue& v) {
    Item it;
    it.fqn = fqn;
    it.path.push_back({fqn, false});
    const std::string* cls = class_of(v);
    if (cls != nullptr && *cls == "BytesStorageMetadata") return it;
    if (cls == nullptr || *cls != "TensorStorageMetadata") {
      fail("'" + fqn + "' is described by " + (cls ? "a " + *cls : std::string("something not an object")));
    }
    it.tensor = true;
    properties(it, attr(v, "properties", "TensorStorageMetadata"));
    it.size = ints(attr(v, "size", "TensorStorageMetadata"), "'" + fqn + "' size");
    int64_t numel = 1;
    for (int64_t d : it.size) {
      if (__builtin_mul_overflow(numel, d, &numel) || numel > kMaxNumel) fail("'" + fqn + "' has too many elements");
    }
    const PtValue& chunks = attr(v, "chunks", "TensorStorageMetadata");
    if (chunks.kind() != Kind::List) fail("'" + fqn + "' chunks is not a list");
    chunks_ += chunks.items().size();
    if (chunks_ > bytes_ / kBytesPerItem + 64) fail("more chunks than a file of " + std::to_string(bytes_) + " bytes holds");
    for (const PtValue& c : chunks.items()) {
      Chunk ch = chunk(it, c);
      if (ch.numel() > 0) it.chunks.push_back(std::move(ch));  // an empty one holds nothing
    }
    check_cover(it, numel);
    return it;
  }

  void properties(Item& it, const PtValue& p) {
    expect_class(p, "TensorProperties", "'" + it.fqn + "' properties");
    std::string dtype, layout;
    if (const PtValue* st = p.find("__state__")) {  // its __getstate__: (dtype, layout, requires_grad, memory format, pin_memory[, strides])
      if (st->kind() != Kind::Tuple || (st->items().size() != 5 && st->items().size() != 6)) {
        fail("'" + it.fqn + "' properties of an unknown shape");
      }
      const PtValue& d = st->items()[0];
      const PtValue& l = st->items()[1];
      if (d.kind() != Kind::String || l.kind() != Kind::String) fail("'" + it.fqn + "' dtype or layout is not a name");
      dtype = d.as_string();
      layout = l.as_string();
    } else {
      const PtValue* d = p.find("dtype");
      const PtValue* l = p.find("layout");
      if (d == nullptr || d->kind() != Kind::String) fail("'" + it.fqn + "' properties without a dtype");
      dtype = d->as_string();
      layout = l != nullptr && l->kind() == Kind::String ? l->as_string() : "torch.strided";
    }
    if (layout != "torch.strided") fail("'" + it.fqn + "' has layout " + layout + " (only dense tensors are read)");
    if (dtype.rfind("torch.", 0) != 0 || !pickle::dtype_of_name(dtype.substr(6), &it.dtype)) {
      fail("'" + it.fqn + "' has dtype " + dtype + ", not one tdist reads");
    }
  }

  Chunk chunk(const Item& it, const PtValue& c) {
    expect_class(c, "ChunkStorageMetadata", "a chunk of '" + it.fqn + "'");
    Chunk ch;
    ch.offsets = ints(attr(c, "offsets", "ChunkStorageMetadata"), "a chunk offset of '" + it.fqn + "'");
    ch.sizes = ints(attr(c, "sizes", "ChunkStorageMetadata"), "a chunk size of '" + it.fqn + "'");
    if (ch.offsets.size() != it.size.size() || ch.sizes.size() != it.size.size()) {
      fail("a chunk of '" + it.fqn + "' has " + std::to_string(ch.offsets.size()) + " dims, the tensor " +
           std::to_string(it.size.size()));
    }
    for (size_t d = 0; d < it.size.size(); ++d) {
      if (ch.offsets[d] > it.size[d] || ch.sizes[d] > it.size[d] - ch.offsets[d]) {
        fail("a chunk of '" + it.fqn + "' at " + dims(ch.offsets) + " of size " + dims(ch.sizes) +
             " lies outside its size " + dims(it.size));
      }
    }
    return ch;
  }

  // The chunks cover the tensor exactly: no two overlap, and their
  // elements add up to its.
  void check_cover(Item& it, int64_t numel) {
    auto& cs = it.chunks;
    std::sort(cs.begin(), cs.end(), [](const Chunk& a, const Chunk& b) { return a.offsets < b.offsets; });
    int64_t sum = 0;
    for (const Chunk& c : cs) sum += c.numel();  // each <= numel <= 2^62: no overflow for 2 at a time
    const auto overlap = [&](const Chunk& a, const Chunk& b) {
      for (size_t d = 0; d < a.offsets.size(); ++d) {
        if (a.offsets[d] + a.sizes[d] <= b.offsets[d] || b.offsets[d] + b.sizes[d] <= a.offsets[d]) return false;
      }
      return true;
    };
    const auto say = [&](const Chunk& a, const Chunk& b) {
      fail("chunks of '" + it.fqn + "' at " + dims(a.offsets) + " and " + dims(b.offsets) + " overlap");
    };
    const bool rows_only = std::all_of(cs.begin(), cs.end(), [&](const Chunk& c) {
      for (size_t d = 1; d < c.offsets.size(); ++d) {
        if (c.offsets[d] != 0 || c.sizes[d] != it.size[d]) return false;
      }
      return true;
    });
    if (rows_only || it.size.empty()) {
      for (size_t i = 1; i < cs.size(); ++i) {
        if (overlap(cs[i - 1], cs[i])) say(cs[i - 1], cs[i]);
      }
    } else if (cs.size() > kMaxPairwiseChunks) {
      fail("'" + it.fqn + "' has " + std::to_string(cs.size()) + " chunks split along several dims (at most " +
           std::to_string(kMaxPairwiseChunks) + " are read)");
    } else {
      for (size_t i = 0; i < cs.size(); ++i) {
        for (size_t j = i + 1; j < cs.size(); ++j) {
          if (overlap(cs[i], cs[j])) say(cs[i], cs[j]);
        }
      }
    }
    if (sum != numel) {
      fail("the chunks of '" + it.fqn + "' hold " + std::to_string(sum) + " elements, its size " + dims(it.size) +
           " " + std::to_string(numel) + " (a hole)");
    }
  }

  void planner_data(const PtValue& pd) {
    if (pd.kind() != Kind::Dict) return;  // another planner's data: the keys stand for themselves
    for (const auto& [fqn, path] : pd.entries()) {
      const Item* found = m_.find(fqn);
      if (found == nullptr) continue;
      if (path.kind() != Kind::Tuple && path.kind() != Kind::List) fail("planner_data of '" + fqn + "' is not a tuple");
      if (path.items().empty() || path.items().size() > 64) fail("planner_data of '" + fqn + "' has no parts or >64");
      std::vector<Item::Part> parts;
      for (const PtValue& p : path.items()) {
        if (p.kind() == Kind::String) {
          if (p.as_string().size() > fqn.size() + 64) fail("planner_data of '" + fqn + "' has a part longer than its key");
          parts.push_back({p.as_string(), false});
        } else if (p.kind() == Kind::Int) {
          parts.push_back({std::to_string(p.as_int()), true});
        } else {
          fail("planner_data of '" + fqn + "' holds a part that is not a string or int");
        }
      }
      m_.items[m_.by_fqn.at(fqn)].path = std::move(parts);
    }
  }

  void storage_entry(const std::string& key, const PtValue& pair) {
    if (key.rfind('\x01', 0) != 0 || pair.kind() != Kind::Tuple || pair.items().size() != 2) {
      fail("storage_data is not keyed by MetadataIndex");
    }
    const PtValue& index = pair.items()[0];
    const PtValue& info = pair.items()[1];
    expect_class(index, "MetadataIndex", "a storage_data key");
    expect_class(info, "_StorageInfo", "a storage_data value");
    const PtValue& fqn = attr(index, "fqn", "MetadataIndex");
    if (fqn.kind() != Kind::String) fail("a MetadataIndex whose fqn is not a string");
    const auto at = m_.by_fqn.find(fqn.as_string());
    if (at == m_.by_fqn.end()) fail("storage_data names '" + fqn.as_string() + "', which state_dict_metadata does not");
    Item& it = m_.items[at->second];
    const Storage s = storage(it, info);
    const PtValue* off = index.find("offset");
    if (!it.tensor) {
      if (!it.bytes.file.empty()) fail("'" + it.fqn + "' has two storage entries");
      it.bytes = s;
      return;
    }
    if (off == nullptr || off->is_none()) fail("'" + it.fqn + "' is a tensor but its storage entry has no offset");
    const std::vector<int64_t> o = ints(*off, "a MetadataIndex offset of '" + it.fqn + "'");
    const auto c = std::lower_bound(it.chunks.begin(), it.chunks.end(), o,
                                    [](const Chunk& ch, const std::vector<int64_t>& x) { return ch.offsets < x; });
    if (c == it.chunks.end() || c->offsets != o) return;  // an empty chunk's (dropped), or none: nothing to read
    if (!stored_.emplace(at->second, static_cast<size_t>(c - it.chunks.begin())).second) {
      fail("'" + it.fqn + "' has two storage entries for its chunk at " + dims(o));
    }
    // Its bytes must be there: a torch.save holds them (and more), a
    // safetensors blob exactly them.
    uint64_t need = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(c->numel()), c10::elementSize(it.dtype), &need) || s.length < need) {
      fail("'" + it.fqn + "': its chunk at " + dims(o) + " holds " + std::to_string(c->numel()) + " elements but is stored in " +
           std::to_string(s.length) + " bytes");
    }
    c->storage = s;
  }

  Storage storage(const Item& it, const PtValue& info) {
    Storage s;
    const PtValue& p = attr(info, "relative_path", "_StorageInfo");
    const PtValue& off = attr(info, "offset", "_StorageInfo");
    const PtValue& len = attr(info, "length", "_StorageInfo");
    if (p.kind() != Kind::String || off.kind() != Kind::Int || len.kind() != Kind::Int || off.as_int() < 0 ||
        len.as_int() < 0) {
      fail("'" + it.fqn + "': a _StorageInfo that is not (path, offset >= 0, length >= 0)");
    }
    const std::string& f = p.as_string();
    if (f.empty() || f.size() > 255 || f == "." || f == ".." || f == kMetadataFile ||
        f.find_first_of(std::string("/\\\0", 3)) != std::string::npos) {
      fail("'" + it.fqn + "' is stored in '" + f.substr(0, 64) + "', not a file name in the folder");
    }
    if (const PtValue* t = info.find("transform_descriptors"); t != nullptr && !t->is_none()) {
      if ((t->kind() != Kind::List && t->kind() != Kind::Tuple) || !t->items().empty()) {
        std::string names;
        if (t->kind() == Kind::List || t->kind() == Kind::Tuple) {
          for (const PtValue& x : t->items()) names += (names.empty() ? "" : ", ") + (x.kind() == Kind::String ? x.as_string().substr(0, 64) : "?");
        }
        fail("'" + it.fqn + "' is stored through stream transforms (" + names + ") that tdist does not read");
      }
    }
    s.file = f;
    s.offset = static_cast<uint64_t>(off.as_int());
    s.length = static_cast<uint64_t>(len.as_int());
    return s;
  }
};

}  // namespace

int64_t Chunk::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;  // checked against the tensor's numel when read
  return n;
}

const Item* Metadata::find(const std::string& fqn) const {
  const auto it = by_fqn.find(fqn);
  return it == by_fqn.end() ? nullptr : &items[it->second];
}

std::string joined(const std::vector<Item::Part>& path) {
  std::string s;
  for (const auto& p : path) s += (s.empty() ? "" : ".") + p.key;
  return s;
}

Metadata parse_metadata(const std::string& bytes, const std::string& where) {
  PtValue root;
  try {
    root = unpickle_dcp_metadata(bytes);
  } catch (const CheckpointError& e) {
    throw CheckpointError(where + ": .metadata: " + e.what());
  }
  return Interpreter(where, bytes.size()).run(root);
}

bool is_dcp_folder(const std::string& dir) {
  struct stat st {};
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
         ::stat((dir + "/" + kMetadataFile).c_str(), &st) == 0;
}

Metadata read_metadata(const std::string& dir) {
  const std::string path = dir + "/" + kMetadataFile;
  std::string bytes;
  {
    FileReader f(path);
    if (f.size() > kMaxMetadataBytes) {
      throw CheckpointError(path + ": " + std::to_string(f.size()) + " bytes, over the " +
                            std::to_string(kMaxMetadataBytes >> 20) + " MiB a DCP .metadata may have");
    }
    bytes.resize(static_cast<size_t>(f.size()));
    f.read_at(0, bytes.data(), bytes.size());
  }
  Metadata m = parse_metadata(bytes, dir);
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (const char c : bytes) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  m.fingerprint = h;
  std::map<std::string, uint64_t> sizes;
  const auto check = [&](const std::string& fqn, const Storage& s) {
    auto it = sizes.find(s.file);
    if (it == sizes.end()) it = sizes.emplace(s.file, FileReader(dir + "/" + s.file).size()).first;
    if (s.offset > it->second || s.length > it->second - s.offset) {
      throw CheckpointError(dir + "/" + s.file + ": '" + fqn + "' is stored at bytes [" + std::to_string(s.offset) +
                            ", +" + std::to_string(s.length) + ") of a " + std::to_string(it->second) +
                            "-byte file (truncated?)");
    }
  };
  for (const Item& it : m.items) {
    if (!it.tensor) check(it.fqn, it.bytes);
    for (const Chunk& c : it.chunks) check(it.fqn, c.storage);
  }
  return m;
}

}  // namespace tdist::checkpoint::dcp
