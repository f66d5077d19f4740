// The files of load_pretrained. The contract is in pretrained_sources.h.
#include "checkpoint/pretrained_sources.h"

#include <ATen/ATen.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>
#include <map>

#include "formats/file_io.h"
#include "formats/pt_file.h"
#include "tdist/safetensors.h"
#include "tdist/errors.h"
#include "util/open_file.h"
#include "util/printable.h"

namespace tdist::checkpoint {

namespace {

using Json = nlohmann::json;

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The index's weight_map, event by event: nothing but the map's pairs is
// kept (metadata and other fields are skipped), nesting is bounded, so
// memory is linear in the text (itself bounded by kMaxIndexBytes).
class IndexSax : public nlohmann::json_sax<Json> {
 public:
  std::map<std::string, std::string> weight_map;  // each name once: no second set of keys to check against
  bool has_map = false;
  std::string problem;  // the first

  bool null() override { return value("null"); }
  bool boolean(bool) override { return value("a bool"); }
  bool number_integer(number_integer_t) override { return value("a number"); }
  bool number_unsigned(number_unsigned_t) override { return value("a number"); }
  bool number_float(number_float_t, const string_t&) override { return value("a number"); }
  bool binary(binary_t&) override { return value("binary"); }
  bool string(string_t& v) override {
    if (in_map_ && depth_ == 2) {
      // try_emplace moves neither argument when the key is there already.
      if (!weight_map.try_emplace(std::move(key_), std::move(v)).second) {
        return fail("the key '" + detail::printable(key_) + "' is in weight_map twice");
      }
      return true;
    }
    return value("a string");
  }
  bool start_object(std::size_t) override {
    if (!value("an object")) return false;
    if (++depth_ > kMaxDepth) return fail("values nest deeper than " + std::to_string(kMaxDepth));
    if (depth_ == 2 && top_key_ == "weight_map") {
      if (has_map) return fail("two weight_map fields");
      in_map_ = has_map = true;
    }
    return true;
  }
  bool key(string_t& k) override {
    if (depth_ == 1) top_key_ = k;
    if (in_map_ && depth_ == 2) key_ = k;
    return true;
  }
  bool end_object() override {
    if (depth_-- == 2) in_map_ = false;
    return true;
  }
  bool start_array(std::size_t) override {
    if (!value("an array")) return false;
    if (++depth_ > kMaxDepth) return fail("values nest deeper than " + std::to_string(kMaxDepth));
    return true;
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    return fail(std::string("not valid JSON: ") + e.what());
  }

 private:
  static constexpr int kMaxDepth = 64;
  // A value at the current place: the root must be an object, the map's
  // values strings.
  bool value(const char* what) {
    if (depth_ == 0 && std::string(what) != "an object") return fail(std::string("the root is ") + what + ", not an object");
    if (in_map_ && depth_ == 2) return fail("weight_map's '" + detail::printable(key_) + "' is " + what + ", not a file name");
    return true;
  }
  bool fail(std::string why) {
    if (problem.empty()) problem = std::move(why);
    return false;
  }
  int depth_ = 0;
  bool in_map_ = false;
  std::string top_key_, key_;
};

// Why a file name of an index cannot be used ("" when it can): it must
// name a file in the index's own directory.
std::string bad_file_name(const std::string& name) {
  if (name.empty()) return "is empty";
  if (name.find('/') != std::string::npos) return "has a '/' (only files beside the index are read)";
  if (name == "." || name == "..") return "is '" + name + "'";
  if (name.find('\0') != std::string::npos) return "has a NUL byte";
  return "";
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

PretrainedSources::PretrainedSources(const std::string& path) {
  std::string file = path;
  if (is_directory(path)) {
    file.clear();
    for (const char* name : {"model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                             "pytorch_model.bin"}) {
      const std::string p = path + "/" + name;
      if (exists(p)) {
        file = p;
        break;
      }
    }
    if (file.empty()) {
      throw CheckpointError(path + ": no model.safetensors.index.json, model.safetensors, "
                            "pytorch_model.bin.index.json or pytorch_model.bin in this directory");
    }
  }
  where_ = file;
  if (ends_with(file, ".index.json")) {
    add_index(file);
  } else {
    add_file(file);
  }
}

PretrainedSources::~PretrainedSources() = default;

void PretrainedSources::add_file(const std::string& path) {
  char magic[2] = {};
  {
    FileReader f(path);  // refuses what is not a regular file
    if (f.size() >= 2) f.read_at(0, magic, 2);
  }
  if (magic[0] == 'P' && magic[1] == 'K') {
    add_pt(path);
  } else {
    add_safetensors(path);
  }
}

void PretrainedSources::add_index(const std::string& path) {
  std::string text, error;
  if (!tdist::detail::read_regular_file(path, kMaxIndexBytes + 1, text, error)) throw CheckpointError(error);
  if (text.size() > kMaxIndexBytes) {
    throw CheckpointError(path + ": the index is larger than " + std::to_string(kMaxIndexBytes >> 20) + " MiB");
  }
  IndexSax sax;
  Json::sax_parse(text.data(), text.data() + text.size(), &sax);
  if (!sax.problem.empty()) throw CheckpointError(path + ": not a valid index: " + sax.problem);
  if (!sax.has_map) throw CheckpointError(path + ": not a valid index: no weight_map");
  text.clear();
  text.shrink_to_fit();
  const std::string dir = directory_of(path);
  std::unordered_map<std::string, size_t> file_of;  // name -> in paths_
  for (const auto& [key, name] : sax.weight_map) {
    const std::string why = bad_file_name(name);
    if (!why.empty()) throw CheckpointError(path + ": the file '" + detail::printable(name) + "' of '" + detail::printable(key) + "' " + why + ": refused");
    if (!file_of.count(name)) {
      file_of.emplace(name, paths_.size());
      if (ends_with(name, ".safetensors")) {
        add_safetensors(dir + "/" + name);
      } else {
        add_pt(dir + "/" + name);
      }
    }
  }
  for (const auto& [key, name] : sax.weight_map) {
    const SourceTensor* t = find(key);
    if (!t || t->file != file_of.at(name)) {
      throw CheckpointError(path + ": the index puts '" + detail::printable(key) + "' in " + detail::printable(name) +
                            ", but " + dir + "/" + detail::printable(name) + " has no such tensor");
    }
  }
}

void PretrainedSources::add(SourceTensor t) {
  const auto [it, fresh] = index_.emplace(t.key, tensors_.size());
  if (!fresh) {
    throw CheckpointError(paths_[t.file] + ": '" + detail::printable(t.key) + "' is also in " + paths_[tensors_[it->second].file]);
  }
  tensors_.push_back(std::move(t));
}

void PretrainedSources::add_safetensors(const std::string& path) {
  const size_t file = paths_.size();
  st_.push_back(std::make_unique<SafetensorsReader>(path));
  pt_.push_back(nullptr);
  paths_.push_back(path);
  for (const auto& info : st_.back()->tensors()) add({info.name, file, info.shape, info.dtype, info.format_dtype});
}

void PretrainedSources::add_pt(const std::string& path) {
  const size_t file = paths_.size();
  pt_.push_back(std::make_unique<PtReader>(path));
  st_.push_back(nullptr);
  paths_.push_back(path);
  const PtValue* dict = &pt_.back()->root();
  if (dict->kind() != PtValue::Kind::Dict) throw CheckpointError(path + ": the saved object is not a dict of tensors");
  for (const char* wrapper : {"state_dict", "model"}) {
    const PtValue* inner = dict->find(wrapper);
    if (inner && inner->kind() == PtValue::Kind::Dict) {
      dict = inner;
      break;
    }
  }
  for (const auto& [key, value] : dict->entries()) {
    if (value.kind() != PtValue::Kind::Tensor) {
      non_tensors_.push_back(key);
      continue;
    }
    const PtTensorRef& ref = value.as_tensor();
    add({key, file, ref.sizes, ref.dtype, c10::toString(ref.dtype), &ref});
  }
}

const SourceTensor* PretrainedSources::find(const std::string& key) const {
  const auto it = index_.find(key);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void PretrainedSources::check(const SourceTensor& t) const {
  if (t.pt) pt_[t.file]->check_tensor(*t.pt);
}

at::Tensor PretrainedSources::read(const SourceTensor& t) const {
  if (t.pt) return pt_[t.file]->read_tensor(*t.pt);
  return st_[t.file]->read(t.key);
}

at::Tensor PretrainedSources::read_rows(const SourceTensor& t, int64_t first_row, int64_t rows) const {
  if (t.pt) return pt_[t.file]->read_tensor(*t.pt).narrow(0, first_row, rows);
  return st_[t.file]->read_rows(t.key, first_row, rows);
}

}  // namespace tdist::checkpoint
