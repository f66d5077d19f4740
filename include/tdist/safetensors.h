// safetensors files, written and read by streaming one tensor at a time,
// crash-safe and checked. The rest of the checkpoint API is in
// tdist/state_dict.h (full and sharded state dicts by the unwrapped model's
// names, optimizer state), tdist/sharded_checkpoint.h (per-rank .pt files in
// torch_xla's layout, loaded at any world size; consolidated .pt files read
// back) and tdist/checkpoint_tools.h (consolidation to pt, safetensors or
// libtorch, resharding, inspection; also the tdist-ckpt tool).
//
//   tdist::save_safetensors("model.safetensors", model->named_parameters());
//   auto tensors = tdist::load_safetensors("model.safetensors");     // name -> tensor
//   tdist::SafetensorsReader r("model.safetensors");                   // the header only
//   at::Tensor w = r.read("fc1.weight");                               // that tensor only
//
// The files follow the safetensors format exactly (SPEC.md §6) and load with
// Python's `safetensors` package. Each tensor's CRC-32 rides in the header's
// __metadata__ ("tdist.crc32:<name>"), which other readers ignore; tdist
// checks it on every read. A file is written to a temporary name, fsynced
// and renamed, so a crash during a save leaves the previous file whole.
// Anything wrong with a file (truncated, a checksum that does not match,
// anything the format forbids) is a CheckpointError naming the file.
//
// Dtypes: bool, uint8, int8, int16, int32, int64, float16, bfloat16,
// float32, float64 (the format's BOOL, U8, I8, I16, I32, I64, F16, BF16,
// F32, F64). A file may hold the format's other dtypes (F8_*, F4, C64,
// U16, ...): it opens and lists them; reading such a tensor is refused.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tdist/errors.h"

namespace tdist {

struct SafetensorsTensorInfo {
  std::string name;
  at::ScalarType dtype = at::kFloat;  // Undefined for a dtype tdist does not read (F8_*, C64, ...)
  std::vector<int64_t> shape;
  std::string format_dtype = {};      // the file's name for it ("F32"); set by the reader
};

// Writes a safetensors file one tensor at a time: the tensors' names,
// dtypes and shapes first, then each tensor in that order, then finish().
// Memory: one tensor at a time (a non-contiguous one is copied first).
// Without finish() (an exception, a crash) the file at `path` is untouched.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, std::vector<SafetensorsTensorInfo> tensors,
                    std::map<std::string, std::string> metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next tensor: its name, dtype and shape must be the next declared.
  void write(const std::string& name, const at::Tensor& tensor);
  // The same from raw bytes in pieces (how the checkpoint tools stream):
  // begin_tensor, then append exactly its byte size, then end_tensor.
  void begin_tensor(const std::string& name);
  void append(const void* data, size_t n);
  void end_tensor();
  // The tensor to be written next, or null when all are.
  const SafetensorsTensorInfo* next_tensor() const;
  // Every tensor written: the checksums go into the header, the file is
  // synced and renamed into place.
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Reads a safetensors file's header at construction (checking it whole)
// and each tensor on demand.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  // In the order of their data in the file.
  const std::vector<SafetensorsTensorInfo>& tensors() const;
  // The file's __metadata__, without tdist's checksums.
  const std::map<std::string, std::string>& metadata() const;
  bool contains(const std::string& name) const;
  // That tensor only, its checksum checked (when the file has one).
  at::Tensor read(const std::string& name) const;
  // Rows [first_row, first_row + rows) of a tensor of one dimension or
  // more (safetensors data is in C order: one byte range of the file), as
  // a tensor of `rows` rows. Memory: those rows (and 1 MiB). The checksum
  // covers the whole tensor: where the file has one (tdist wrote it; other
  // writers' files carry none), the bytes around the rows are read through
  // the CRC too, so a part is checked as a whole read is.
  // CheckpointError when the rows lie outside the tensor.
  at::Tensor read_rows(const std::string& name, int64_t first_row, int64_t rows) const;
  const std::string& path() const;

 private:
  at::Tensor read_range(const std::string& name, int64_t first_row, int64_t rows) const;  // rows < 0: whole
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The whole file at once, and back.
void save_safetensors(const std::string& path, const torch::OrderedDict<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
torch::OrderedDict<std::string, at::Tensor> load_safetensors(const std::string& path);

}  // namespace tdist
