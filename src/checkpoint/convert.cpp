// tdist-ckpt convert (convert.h): each format read as named whole tensors
// (a Source), each written from one (a writer per format).
#include "checkpoint/convert.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>


#include "checkpoint/checkpoint_tree.h"
#include "checkpoint/dcp_layout.h"
#include "formats/dcp_reader.h"
#include "formats/dcp_writer.h"
#include "formats/file_io.h"
#include "formats/hf_index.h"
#include "formats/safetensors_header.h"
#include "formats/safetensors_names.h"
#include "checkpoint/sharded_files.h"
#include "checkpoint/tools.h"
#include "tdist/errors.h"
#include "tdist/safetensors.h"
#include "util/json_reader.h"

namespace tdist::checkpoint {

namespace {

// tdist's rank files under a prefix (ShardedCheckpointOptions' default).
constexpr const char* kRankSuffix = "_rank-*-of-*.pt";

// One whole tensor of the input: a model entry (field empty) or an
// optimizer state field of `param`.
struct Tensor {
  std::string param, field;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> shape;
  size_t handle = 0;  // the source's own index
  uint64_t bytes() const {
    uint64_t n = c10::elementSize(dtype);
    for (int64_t s : shape) n *= static_cast<uint64_t>(s);
    return n;
  }
};

class Source {
 public:
  virtual ~Source() = default;
  std::vector<Tensor> model, optimizer;
  // The optimizer's kind and groups in tdist's layout ({"optimizer": kind,
  // "param_groups": [{option: number, "params": [names]}]}); None without.
  PtValue optimizer_tree;
  std::vector<std::string> inputs;  // every file read
  // The whole tensor into out (t.bytes() of it), its dtype's bytes.
  virtual void read(const Tensor& t, void* out) const = 0;
};

bool is_directory(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// ---- sources ---------------------------------------------------------------------

class DcpSource : public Source {
 public:
  explicit DcpSource(const std::string& dir) : r_(dir) {
    const dcp::Layout l = dcp::classify(r_.metadata());
    std::set<std::string> names;
    for (const auto& [name, item] : l.model) {
      if (!names.insert(name).second) throw CheckpointError("the DCP checkpoint " + dir + " holds '" + name + "' twice");
      model.push_back(tensor(name, "", *item));
    }
    inputs.push_back(dir + "/" + dcp::kMetadataFile);
    std::set<std::string> files;
    for (const dcp::Item& it : r_.metadata().items) {
      if (!it.tensor) files.insert(it.bytes.file);
      for (const auto& c : it.chunks) files.insert(c.storage.file);
    }
    for (const auto& f : files) inputs.push_back(dir + "/" + f);
    if (!l.optimizer_root.empty()) read_optimizer(l, dir);
  }
  void read(const Tensor& t, void* out) const override {
    const dcp::Item& it = *items_[t.handle];
    r_.read_box(it, std::vector<int64_t>(it.size.size(), 0), it.size, out);
  }

 private:
  DcpReader r_;
  std::vector<const dcp::Item*> items_;

  Tensor tensor(const std::string& param, const std::string& field, const dcp::Item& it) {
    items_.push_back(&it);
    return {param, field, it.dtype, it.size, items_.size() - 1};
  }
  void read_optimizer(const dcp::Layout& l, const std::string& dir) {
    const std::string where = "the DCP checkpoint " + dir;
    std::vector<PtValue> groups;
    if (!l.param_options.empty()) groups = flattened_groups(l, where);
    std::vector<std::string> fields;
    bool decoupled = false;
    for (size_t g = 0; g < l.param_groups.size(); ++g) {
      std::map<std::string, double> options;
      std::vector<PtValue> params;
      for (const auto& [key, item] : l.param_groups[g].options) {
        const std::string what = where + ": param_groups[" + std::to_string(g) + "]['" + key + "']";
        if (item->tensor) continue;  // an option kept as a tensor: not one tdist has
        const PtValue v = r_.read_value(*item);
        if (key == "params") {
          if (v.kind() != PtValue::Kind::List && v.kind() != PtValue::Kind::Tuple) throw CheckpointError(what + " is not a list");
          for (const PtValue& p : v.items()) {
            if (p.kind() != PtValue::Kind::String) throw CheckpointError(what + " holds a parameter's index, not its name");
            params.push_back(PtValue::string(dcp::unwrapped_name(p.as_string())));
          }
        } else {
          dcp::add_tdist_option(key, v, options, what);
        }
      }
      std::vector<std::pair<std::string, PtValue>> entries;
      for (const auto& [k, x] : options) entries.emplace_back(k, PtValue::floating(x));
      entries.emplace_back("params", PtValue::list(std::move(params)));
      groups.push_back(PtValue::dict(std::move(entries)));
    }
    for (const dcp::OptimizerEntry& e : l.optimizer) {
      if (e.by_index) throw CheckpointError(where + ": its optimizer state is keyed by index, not by parameter name");
      if (!e.item->tensor) throw CheckpointError(where + ": optimizer state '" + e.item->fqn + "' is not a tensor");
      optimizer.push_back(tensor(dcp::unwrapped_name(e.param), e.field, *e.item));
      fields.push_back(e.field);
    }
    std::sort(optimizer.begin(), optimizer.end(), [](const Tensor& a, const Tensor& b) { return a.param < b.param; });
    std::stable_sort(optimizer.begin(), optimizer.end(), [&](const Tensor& a, const Tensor& b) {
      return order(a.param) < order(b.param);
    });
    for (const PtValue& g : groups) {  // AdamW is Adam with decoupled weight decay
      const PtValue* d = g.find("decoupled_weight_decay");
      decoupled = decoupled || (d != nullptr && d->as_float() != 0);
    }
    optimizer_tree = PtValue::dict({{"optimizer", PtValue::string(dcp::kind_of_state(fields, decoupled))},
                                    {"param_groups", PtValue::list(std::move(groups))}});
  }
  // A flattened state dict's per-parameter options: parameters with the
  // same options form a group, in the order first seen.
  std::vector<PtValue> flattened_groups(const dcp::Layout& l, const std::string& where) {
    std::vector<std::pair<std::map<std::string, double>, std::vector<PtValue>>> groups;
    std::vector<std::string> params;  // in the model's order
    for (const auto& [param, keys] : l.param_options) params.push_back(param);
    std::stable_sort(params.begin(), params.end(), [&](const std::string& a, const std::string& b) {
      return order(dcp::unwrapped_name(a)) < order(dcp::unwrapped_name(b));
    });
    for (const std::string& param : params) {
      const auto& keys = l.param_options.at(param);
      std::map<std::string, double> options;
      for (const auto& [key, item] : keys) {
        if (!item->tensor) dcp::add_tdist_option(key, r_.read_value(*item), options, where + ": param_groups." + param + "." + key);
      }
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == options; });
      if (g == groups.end()) g = groups.insert(groups.end(), {options, {}});
      g->second.push_back(PtValue::string(dcp::unwrapped_name(param)));
    }
    std::vector<PtValue> out;
    for (auto& [options, params] : groups) {
      std::vector<std::pair<std::string, PtValue>> entries;
      for (const auto& [k, x] : options) entries.emplace_back(k, PtValue::floating(x));
      entries.emplace_back("params", PtValue::list(std::move(params)));
      out.push_back(PtValue::dict(std::move(entries)));
    }
    return out;
  }
  // A parameter's place in the model's order (state follows it).
  std::map<std::string, size_t> order_;  // the model's names, in order (built once)
  size_t order(const std::string& param) {
    if (order_.empty()) {
      for (size_t i = 0; i < model.size(); ++i) order_.emplace(model[i].param, i);
    }
    const auto it = order_.find(param);
    return it == order_.end() ? model.size() : it->second;
  }
};

class TdistSource : public Source {
 public:
  explicit TdistSource(const std::string& prefix) : files_(prefix, kRankSuffix) {
    for (const auto& t : files_.model()) add(model, t);
    if (files_.has_optimizer()) {
      for (const auto& t : files_.optimizer()) add(optimizer, t);
      optimizer_tree = files_.optimizer_tree();
    }
    inputs = files_.paths();
  }
  void read(const Tensor& t, void* out) const override {
    char* p = static_cast<char*>(out);
    files_.stream_full(*tensors_[t.handle], [&p](const char* data, size_t n) {
      std::memcpy(p, data, n);
      p += n;
    });
  }

 private:
  ShardedCheckpointFiles files_;
  std::vector<const LogicalTensor*> tensors_;
  void add(std::vector<Tensor>& to, const LogicalTensor& t) {
    tensors_.push_back(&t);
    to.push_back({t.field.empty() ? t.name : t.param, t.field, t.dtype, t.shape, tensors_.size() - 1});
  }
};

class PtSource : public Source {
 public:
  explicit PtSource(const std::string& path) : r_(path) {
    const PtValue& root = r_.root();
    const PtValue* sd = &root;
    if (root.kind() == PtValue::Kind::Dict) {
      if (const PtValue* m = root.find("model"); m != nullptr && m->kind() == PtValue::Kind::Dict) sd = m;
      if (const PtValue* m = root.find("state_dict"); m != nullptr && m->kind() == PtValue::Kind::Dict) sd = m;
    }
    if (sd->kind() != PtValue::Kind::Dict) throw CheckpointError(path + ": not a state dict (a dict of tensors)");
    for (const auto& [name, v] : sd->entries()) {
      if (v.kind() != PtValue::Kind::Tensor) continue;  // a state dict's other values (an OrderedDict's _metadata)
      add(model, name, "", v.as_tensor());
    }
    const PtValue* o = root.kind() == PtValue::Kind::Dict ? root.find("optimizer") : nullptr;
    if (o != nullptr && !o->is_none()) {
      check_optimizer_tree(*o, path + ": optimizer");
      for (const auto& [param, fields] : o->at("state").entries()) {
        for (const auto& [field, v] : fields.entries()) add(optimizer, param, field, v.as_tensor());
      }
      optimizer_tree = *o;
    }
    inputs.push_back(path);
  }
  void read(const Tensor& t, void* out) const override {
    const PtTensorRef& ref = *refs_[t.handle];
    if (ref.storage_offset == 0 && static_cast<uint64_t>(ref.storage_numel) * c10::elementSize(ref.dtype) == t.bytes() &&
        view_is_contiguous(ref)) {
      return r_.read_storage(ref, out);
    }
    std::vector<char> storage(static_cast<size_t>(ref.storage_numel) * c10::elementSize(ref.dtype));
    r_.read_storage(ref, storage.data());
    gather_view(ref, storage.data(), out);
  }

 private:
  PtReader r_;
  std::vector<const PtTensorRef*> refs_;
  void add(std::vector<Tensor>& to, const std::string& param, const std::string& field, const PtTensorRef& ref) {
    r_.check_storage(ref);
    refs_.push_back(&ref);
    to.push_back({param, field, ref.dtype, ref.sizes, refs_.size() - 1});
  }
};

class SafetensorsSource : public Source {
 public:
  explicit SafetensorsSource(const std::string& path) {
    std::vector<std::string> files;
    if (is_directory(path)) {
      const std::string index = path + "/model.safetensors.index.json";
      struct stat st {};
      if (::stat(index.c_str(), &st) == 0) {
        for (const auto& f : read_weight_map(index).files) files.push_back(path + "/" + f);
        inputs.push_back(index);
      } else {
        files.push_back(path + "/model.safetensors");
      }
    } else {
      files.push_back(path);
    }
    for (const auto& f : files) open(f);
  }
  void read(const Tensor& t, void* out) const override {
    const Entry& e = entries_[t.handle];
    FileReader(e.file).read_at(e.offset, out, t.bytes());
  }

 private:
  struct Entry {
    std::string file;
    uint64_t offset;
  };
  std::vector<Entry> entries_;

  void open(const std::string& file) {
    FileReader f(file);
    safetensors::Header h;
    uint64_t n = 0;
    try {
      uint8_t first8[8];
      f.read_at(0, first8, 8);
      n = safetensors::header_length(first8, f.size());
      std::string json(static_cast<size_t>(n), '\0');
      f.read_at(8, json.data(), json.size());
      h = safetensors::parse_header(json.data(), json.size(), f.size() - 8 - n);
    } catch (const safetensors::FormatError& e) {
      throw CheckpointError(file + ": " + e.what());
    }
    for (const auto& t : h.tensors) {
      const c10::ScalarType dtype = safetensors::dtype_of(t.dtype, file, t.name);
      entries_.push_back({file, 8 + n + t.begin});
      const std::string opt = "optimizer/";
      if (t.name.rfind(opt, 0) == 0 && t.name.find('/', opt.size()) != std::string::npos) {
        const size_t slash = t.name.rfind('/');
        optimizer.push_back({t.name.substr(opt.size(), slash - opt.size()), t.name.substr(slash + 1), dtype, t.shape,
                             entries_.size() - 1});
      } else {
        model.push_back({t.name, "", dtype, t.shape, entries_.size() - 1});
      }
    }
    if (!optimizer.empty() && h.metadata.count("tdist.optimizer") && h.metadata.count("tdist.param_groups")) {
      optimizer_tree = groups_from_json(h.metadata.at("tdist.optimizer"), h.metadata.at("tdist.param_groups"), file);
    }
    inputs.push_back(file);
  }
  static PtValue groups_from_json(const std::string& kind, const std::string& text, const std::string& file) {
    json::Limits limits;
    limits.max_depth = 4;                  // [{"params": [name, ...], option: number}]
    limits.max_kept = (size_t{64} << 10) + 16 * text.size();  // the text is bounded by its header's
    limits.any_root = true;
    std::string error;
    const nlohmann::json j = json::parse_value(text, limits, error);
    if (!error.empty()) throw CheckpointError(file + ": tdist.param_groups: " + error);
    if (!j.is_array()) throw CheckpointError(file + ": tdist.param_groups is not a JSON list");
    std::vector<PtValue> groups;
    for (const auto& g : j) {
      if (!g.is_object()) throw CheckpointError(file + ": tdist.param_groups holds something not an object");
      std::vector<std::pair<std::string, PtValue>> entries;
      for (const auto& [k, v] : g.items()) {
        if (k == "params" && v.is_array()) {
          std::vector<PtValue> names;
          for (const auto& n : v) {
            if (!n.is_string()) throw CheckpointError(file + ": tdist.param_groups lists a parameter that is not a name");
            names.push_back(PtValue::string(n.get<std::string>()));
          }
          entries.emplace_back(k, PtValue::list(std::move(names)));
        } else if (v.is_number()) {
          entries.emplace_back(k, PtValue::floating(v.get<double>()));
        }
      }
      groups.push_back(PtValue::dict(std::move(entries)));
    }
    return PtValue::dict({{"optimizer", PtValue::string(kind)}, {"param_groups", PtValue::list(std::move(groups))}});
  }
};

// ---- writers ---------------------------------------------------------------------

// Each tensor read whole into one buffer, reused (the largest tensor's size).
class Buffer {
 public:
  const char* read(const Source& s, const Tensor& t) {
    if (buf_.size() < t.bytes()) buf_.resize(static_cast<size_t>(t.bytes()));
    s.read(t, buf_.data());
    return buf_.data();
  }

 private:
  std::vector<char> buf_;
};

std::string optimizer_name(const Tensor& t) { return "optimizer/" + t.param + "/" + t.field; }

void write_safetensors_file(const Source& s, const std::string& path, bool optimizer) {
  std::vector<SafetensorsTensorInfo> infos;
  std::vector<std::pair<std::string, const Tensor*>> order;
  for (const auto& t : s.model) order.emplace_back(t.param, &t);
  if (optimizer) {
    for (const auto& t : s.optimizer) order.emplace_back(optimizer_name(t), &t);
  }
  for (const auto& [name, t] : order) infos.push_back({name, t->dtype, t->shape});
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  if (optimizer && !s.optimizer_tree.is_none()) {
    for (auto& [k, v] : optimizer_metadata(s.optimizer_tree)) metadata[k] = v;
  }
  SafetensorsWriter w(path, infos, metadata);
  Buffer b;
  for (const auto& [name, t] : order) {
    const char* p = b.read(s, *t);
    w.begin_tensor(name);
    w.append(p, static_cast<size_t>(t->bytes()));
    w.end_tensor();
  }
  w.finish();
}

// Hugging Face's shards: model-0000i-of-0000N.safetensors of at most
// max_shard bytes each (a larger tensor alone), and the index.
void write_safetensors_dir(const Source& s, const std::string& dir, int64_t max_shard) {
  ::mkdir(dir.c_str(), 0755);
  std::vector<std::vector<const Tensor*>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const auto& t : s.model) {
    if (!shards.back().empty() && in_shard + t.bytes() > static_cast<uint64_t>(max_shard)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(&t);
    in_shard += t.bytes();
    total += t.bytes();
  }
  const auto name = [&](size_t i) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    return std::string(buf);
  };
  nlohmann::json map = nlohmann::json::object();
  Buffer b;
  for (size_t i = 0; i < shards.size(); ++i) {
    std::vector<SafetensorsTensorInfo> infos;
    for (const Tensor* t : shards[i]) {
      infos.push_back({t->param, t->dtype, t->shape});
      map[t->param] = name(i);
    }
    SafetensorsWriter w(dir + "/" + name(i), infos, {{"format", "pt"}});
    for (const Tensor* t : shards[i]) {
      const char* p = b.read(s, *t);
      w.begin_tensor(t->param);
      w.append(p, static_cast<size_t>(t->bytes()));
      w.end_tensor();
    }
    w.finish();
  }
  const std::string index = nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", map}}.dump(2);
  AtomicFileWriter f(dir + "/model.safetensors.index.json");
  f.write(index.data(), index.size());
  f.commit();
}

// The optimizer's value in tdist's layout (what consolidate writes), its
// tensors made by `value`.
template <typename Value>
PtValue optimizer_value_of(const Source& s, Value&& value) {
  std::vector<std::pair<std::string, PtValue>> state;
  for (const auto& t : s.optimizer) {
    if (state.empty() || state.back().first != t.param) state.emplace_back(t.param, PtValue::dict({}));
    state.back().second.mutable_entries().emplace_back(t.field, value(t));
  }
  PtValue like = s.optimizer_tree;
  return optimizer_tree(like, PtValue::dict(std::move(state)), 1, 0);
}

// `root` written as a torch.save file, each storage streamed from the tensor it was made for.
void write_pt_root(const Source& s, const std::string& path, const PtValue& root,
                   const std::map<std::string, const Tensor*>& by_key) {
  PtWriter w(path);
  w.begin(root);
  Buffer b;
  for (const auto& key : tensor_keys(root)) {
    const Tensor& t = *by_key.at(key);
    const char* p = b.read(s, t);
    w.begin_storage(key);
    w.append(p, static_cast<size_t>(t.bytes()));
    w.end_storage();
  }
  w.finish();
}

// The model and (when `optimizer`) the optimizer of `s` as tdist's values
// by name, and which tensor each storage key stands for.
struct PtTrees {
  PtValue model, optimizer;
  std::map<std::string, const Tensor*> by_key;
};
PtTrees pt_trees(const Source& s, bool optimizer) {
  PtTrees out;
  StorageKeys keys;
  const auto value = [&](const Tensor& t) {
    PtValue v = keys.add(t.dtype, t.shape);
    out.by_key[v.as_tensor().storage_key] = &t;
    return v;
  };
  std::vector<std::pair<std::string, PtValue>> model;
  for (const auto& t : s.model) model.emplace_back(t.param, value(t));
  out.model = PtValue::dict(std::move(model));
  if (optimizer) out.optimizer = optimizer_value_of(s, value);
  return out;
}

void write_pt_file(const Source& s, const std::string& path, bool optimizer) {
  PtTrees t = pt_trees(s, optimizer);
  const PtValue root = PtValue::dict({{"model", std::move(t.model)},
                                      {"optimizer", std::move(t.optimizer)},
                                      {"tdist", PtValue::dict({{"format", PtValue::integer(kFormatVersion)},
                                                               {"kind", PtValue::string("consolidated")}})}});
  write_pt_root(s, path, root, t.by_key);
}

// tdist's sharded files at world size 1 (what a plain model's
// save_sharded_checkpoint writes: no FSDP units, every tensor whole), which
// load_sharded_checkpoint reads into a plain, DDP or FSDP model at any
// world size and tdist-ckpt reads as its own. A file format cannot know
// which tensors are buffers or which modules hold none: "buffers" and
// "modules" are empty (only consolidate --format libtorch reads them).
void write_tdist_files(const Source& s, const std::string& prefix, bool optimizer) {
  const std::string path = rank_file_path(prefix, kRankSuffix, 0, 1);
  for (const RankFile& f : find_rank_files(prefix, kRankSuffix)) {
    if (std::find(s.inputs.begin(), s.inputs.end(), f.path) != s.inputs.end()) {
      throw UsageError("convert: the output prefix " + prefix + " holds the input's files (an input is never overwritten)");
    }
    if (f.path != path) {
      throw UsageError("convert: the output prefix " + prefix + " already holds another checkpoint (" + f.path +
                       "); two world sizes under one prefix load as neither: remove it or choose another prefix");
    }
  }
  PtTrees t = pt_trees(s, optimizer);
  const PtValue root = PtValue::dict(
      {{"model", std::move(t.model)},
       {"shard_metadata", metadata_value(ShardMetadata{})},
       {"optimizer", std::move(t.optimizer)},
       {"comm_hook", PtValue()},
       {"tdist", sharded_record(new_save_id(), 1, 0, PtValue::list({}), PtValue::list({}), PtValue())}});
  write_pt_root(s, path, root, t.by_key);
}

// One rank's DCP folder, as get_state_dict would key it for dcp.load.
void write_dcp(const Source& s, const std::string& dir, bool optimizer) {
  ::mkdir(dir.c_str(), 0755);
  if (!is_directory(dir)) throw CheckpointError(dir + ": not a directory");
  DcpRankFileWriter w(dir, "__0_" + std::to_string(fresh_file_index(dir)) + ".distcp");
  dcp::Metadata m;
  Buffer b;
  const auto add_tensor = [&](std::string fqn, std::vector<dcp::Item::Part> path, const Tensor& t) {
    dcp::Item it;
    it.fqn = std::move(fqn);
    it.path = std::move(path);
    it.tensor = true;
    it.dtype = t.dtype;
    it.size = t.shape;
    const char* p = b.read(s, t);
    std::vector<char> as_float;
    if (t.field == "step" && t.dtype != c10::kFloat && t.shape.empty()) {  // PyTorch's steps are float32
      as_float.resize(4);
      const float f = t.dtype == c10::kLong ? static_cast<float>(*reinterpret_cast<const int64_t*>(p))
                      : t.dtype == c10::kDouble ? static_cast<float>(*reinterpret_cast<const double*>(p))
                                                : throw CheckpointError("a step of dtype " + std::string(c10::toString(t.dtype)));
      std::memcpy(as_float.data(), &f, 4);
      it.dtype = c10::kFloat;
      p = as_float.data();
    }
    w.begin_tensor(it.dtype, t.shape);
    w.append(p, static_cast<size_t>(it.dtype == t.dtype ? t.bytes() : 4));
    dcp::Chunk c;
    c.offsets.assign(t.shape.size(), 0);
    c.sizes = t.shape;
    c.storage = w.end_tensor();
    it.chunks.push_back(std::move(c));
    m.by_fqn.emplace(it.fqn, m.items.size());
    m.items.push_back(std::move(it));
  };
  const auto add_value = [&](std::string fqn, std::vector<dcp::Item::Part> path, const PtValue& v) {
    dcp::Item it;
    it.fqn = std::move(fqn);
    it.path = std::move(path);
    it.bytes = w.add_value(v);
    m.by_fqn.emplace(it.fqn, m.items.size());
    m.items.push_back(std::move(it));
  };
  for (const auto& t : s.model) add_tensor("model." + t.param, {{"model", false}, {t.param, false}}, t);
  if (optimizer) {
    for (const auto& t : s.optimizer) {
      add_tensor("optim.state." + t.param + "." + t.field,
                 {{"optim", false}, {"state", false}, {t.param, false}, {t.field, false}}, t);
    }
    const std::string kind = s.optimizer_tree.at("optimizer").as_string();
    const auto& groups = s.optimizer_tree.at("param_groups").items();
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::string gi = std::to_string(g);
      std::map<std::string, double> options;
      for (const auto& [k, v] : groups[g].entries()) {
        if (k != "params") options[k] = v.as_float();
      }
      const auto path = [&](const std::string& key) {
        return std::vector<dcp::Item::Part>{{"optim", false}, {"param_groups", false}, {gi, true}, {key, false}};
      };
      for (const auto& [key, v] : dcp::python_options(kind, options)) {
        add_value("optim.param_groups." + gi + "." + key, path(key), v);
      }
      add_value("optim.param_groups." + gi + ".params", path("params"), groups[g].at("params"));
    }
  }
  const std::string bytes = dcp::pickle_metadata(m);
  dcp::parse_metadata(bytes, dir);
  w.sync();
  w.commit();
  AtomicFileWriter f(dir + "/" + dcp::kMetadataFile);
  f.write(bytes.data(), bytes.size());
  f.commit();
  remove_stale_files(dir, m);
}

// ---- the command ------------------------------------------------------------------

std::pair<std::string, std::string> split(const std::string& spec, const char* which) {
  const size_t colon = spec.find(':');
  const std::string fmt = colon == std::string::npos ? "" : spec.substr(0, colon);
  if (fmt != "dcp" && fmt != "tdist" && fmt != "pt" && fmt != "safetensors") {
    throw UsageError(std::string(which) + " '" + spec + "': FMT:PATH with FMT dcp, tdist, pt or safetensors");
  }
  std::string path = spec.substr(colon + 1);
  if (path.empty()) throw UsageError(std::string(which) + " '" + spec + "' has no path");
  return {fmt, path};
}

std::unique_ptr<Source> open_source(const std::string& fmt, const std::string& path) {
  if (fmt == "dcp") return std::make_unique<DcpSource>(path);
  if (fmt == "tdist") return std::make_unique<TdistSource>(path);
  if (fmt == "pt") return std::make_unique<PtSource>(path);
  return std::make_unique<SafetensorsSource>(path);
}

// UsageError when writing `out` (a file, or a folder's files) could
// touch one of the inputs.
void check_not_input(const Source& s, const std::string& fmt, const std::string& out_path) {
  const std::string out = fmt == "tdist" ? rank_file_path(out_path, kRankSuffix, 0, 1) : out_path;
  std::set<std::pair<dev_t, ino_t>> ids;
  std::set<std::string> names;
  for (const auto& p : s.inputs) {
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0) ids.emplace(st.st_dev, st.st_ino);
    names.insert(resolve_directory(p));
  }
  const auto refuse = [&](const std::string& why) {
    throw UsageError("convert: the output " + out + " " + why + " (an input is never overwritten)");
  };
  const bool folder = fmt == "dcp" || (fmt == "safetensors" && (out.back() == '/' || is_directory(out)));
  if (!folder) {
    struct stat st {};
    if (::stat(out.c_str(), &st) == 0 && ids.count({st.st_dev, st.st_ino})) refuse("is one of the input's files");
    if (names.count(resolve_directory(out))) refuse("is one of the input's files");
    return;
  }
  std::string dir = out;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  struct stat dst {};
  if (::stat(dir.c_str(), &dst) != 0) return;  // a new folder
  for (const auto& p : s.inputs) {
    struct stat st {};
    if (::stat(directory_of(p).c_str(), &st) == 0 && st.st_dev == dst.st_dev && st.st_ino == dst.st_ino) {
      refuse("is the folder the input's files are in");
    }
  }
}

}  // namespace

std::string convert_checkpoint(const std::string& from, const std::string& to, const ConvertOptions& options) {
  const auto [in_fmt, in_path] = split(from, "--from");
  const auto [out_fmt, out_path] = split(to, "--to");
  const std::unique_ptr<Source> s = open_source(in_fmt, in_path);
  if (options.optimizer && s->optimizer_tree.is_none()) throw UsageError("convert --optimizer: " + in_path + " holds no optimizer state");
  if (s->model.empty()) throw CheckpointError(in_path + " holds no model tensors");
  check_not_input(*s, out_fmt, out_path);
  const bool shards = out_fmt == "safetensors" && (out_path.back() == '/' || is_directory(out_path));
  if (shards && options.optimizer) throw UsageError("convert --optimizer: Hugging Face shards hold a model only; write one .safetensors file");
  if (out_fmt == "dcp") {
    write_dcp(*s, out_path, options.optimizer);
  } else if (out_fmt == "pt") {
    write_pt_file(*s, out_path, options.optimizer);
  } else if (out_fmt == "tdist") {
    write_tdist_files(*s, out_path, options.optimizer);
  } else if (shards) {
    write_safetensors_dir(*s, out_path, options.max_shard_size);
  } else {
    write_safetensors_file(*s, out_path, options.optimizer);
  }
  return std::to_string(s->model.size()) + " model tensors" +
         (options.optimizer ? ", " + std::to_string(s->optimizer.size()) + " optimizer tensors" : std::string()) +
         " -> " + out_fmt + ":" + out_path;
}

}  // namespace tdist::checkpoint
