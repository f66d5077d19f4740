// The files load_pretrained reads (include/tdist/pretrained.h): a path
// resolved to its files, every tensor they hold by its key, read whole or
// by rows.
//
//   PretrainedSources s("gpt2-dir");   // files opened, headers checked
//   const SourceTensor* t = s.find("transformer.wte.weight");
//   at::Tensor rows = s.read_rows(*t, 4, 2);
//
// A directory resolves to model.safetensors.index.json, model.safetensors,
// pytorch_model.bin.index.json or pytorch_model.bin (the first there); a
// file is an index (*.index.json), a torch.save zip (it starts with "PK")
// or a safetensors file. An index is {"metadata": ..., "weight_map":
// {key: file}}: read with at most kMaxIndexBytes, every file a plain name
// in the index's directory (no '/', not "." or ".."), every key there in
// the file it names. The keys of all files are the tensors; a key in two
// files is an error. Every file is opened (and its header or zip
// directory checked) at construction: what is missing, truncated or not a
// regular file is refused before anything is read. Errors:
// CheckpointError naming the file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace tdist {
class SafetensorsReader;
}

namespace tdist::checkpoint {

class PtReader;
struct PtTensorRef;

struct SourceTensor {
  std::string key;
  size_t file = 0;                    // in PretrainedSources::files()
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;  // Undefined: a dtype tdist cannot read (F8_*, ...)
  std::string dtype_name;             // for messages: "F32", "BFloat16", ...
  const PtTensorRef* pt = nullptr;    // in a .pt file: its view
};

class PretrainedSources {
 public:
  explicit PretrainedSources(const std::string& path);
  ~PretrainedSources();
  PretrainedSources(const PretrainedSources&) = delete;
  PretrainedSources& operator=(const PretrainedSources&) = delete;

  // The file that names the keys (the index, or the one file).
  const std::string& where() const { return where_; }
  const std::vector<std::string>& files() const { return paths_; }
  // Every tensor, in the order of the files and in each file's order.
  const std::vector<SourceTensor>& tensors() const { return tensors_; }
  const SourceTensor* find(const std::string& key) const;
  // Values of a .pt state dict that are not tensors (skipped), by key.
  const std::vector<std::string>& non_tensors() const { return non_tensors_; }

  // CheckpointError unless the tensor can be read (its record exists and
  // has its size; a .pt view stays inside its storage).
  void check(const SourceTensor& t) const;
  // The whole tensor, and rows [first_row, first_row + rows) of one of one
  // dimension or more (memory: those rows; a .pt view: its storage).
  at::Tensor read(const SourceTensor& t) const;
  at::Tensor read_rows(const SourceTensor& t, int64_t first_row, int64_t rows) const;

 private:
  void add_safetensors(const std::string& path);
  void add_pt(const std::string& path);
  void add_file(const std::string& path);
  void add_index(const std::string& path);
  void add(SourceTensor t);

  std::string where_;
  std::vector<std::string> paths_;
  std::vector<std::unique_ptr<SafetensorsReader>> st_;  // per file: one of st_, pt_ set
  std::vector<std::unique_ptr<PtReader>> pt_;
  std::vector<SourceTensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::vector<std::string> non_tensors_;
};

}  // namespace tdist::checkpoint
