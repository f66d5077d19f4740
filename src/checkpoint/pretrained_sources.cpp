// The files of load_pretrained. The contract is in pretrained_sources.h.
#include "checkpoint/pretrained_sources.h"

#include <ATen/ATen.h>
#include <sys/stat.h>

#include "formats/file_io.h"
#include "formats/hf_index.h"
#include "formats/pt_file.h"
#include "tdist/safetensors.h"
#include "tdist/errors.h"
#include "util/open_file.h"
#include "util/printable.h"

namespace tdist::checkpoint {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
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
  const WeightMap map = read_weight_map(path);
  const std::string dir = directory_of(path);
  std::unordered_map<std::string, size_t> file_of;  // name -> in paths_
  for (const auto& [key, name] : map.file_of) {
    if (!file_of.count(name)) {
      file_of.emplace(name, paths_.size());
      if (ends_with(name, ".safetensors")) {
        add_safetensors(dir + "/" + name);
      } else {
        add_pt(dir + "/" + name);
      }
    }
  }
  for (const auto& [key, name] : map.file_of) {
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
