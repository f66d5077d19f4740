// safetensors files of LibTorch tensors: SafetensorsWriter::write,
// SafetensorsReader and the whole-file helpers (the rest of the writer,
// which needs c10 only, is in safetensors_writer.cpp). The contract is in include/tdist/safetensors.h;
// the header's format and checks are in safetensors_header.h.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
#include <string_view>
#include <unordered_map>

#include "checkpoint/checkpoint_tree.h"
#include "formats/file_io.h"
#include "formats/safetensors_header.h"
#include "formats/safetensors_names.h"
#include "tdist/safetensors.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian, as this host must be");

namespace tdist {

namespace st = safetensors;

void SafetensorsWriter::write(const std::string& name, const at::Tensor& tensor) {
  const SafetensorsTensorInfo* want = next_tensor();
  if (!want || want->name != name) begin_tensor(name);  // throws the right error
  if (!tensor.defined() || tensor.scalar_type() != want->dtype || tensor.sizes() != at::IntArrayRef(want->shape) ||
      !tensor.device().is_cpu() || tensor.layout() != at::kStrided) {
    throw UsageError("SafetensorsWriter: tensor '" + name + "' is not the dense CPU " +
                     std::string(c10::toString(want->dtype)) + " tensor of the declared shape");
  }
  const at::Tensor t = tensor.contiguous();
  begin_tensor(name);
  append(t.data_ptr(), static_cast<size_t>(st::nbytes_of(*want)));
  end_tensor();
}

// ---- reader ---------------------------------------------------------------------

struct SafetensorsReader::Impl {
  checkpoint::FileReader file;
  uint64_t data_start = 0;
  std::vector<SafetensorsTensorInfo> tensors;
  std::vector<std::pair<uint64_t, uint64_t>> spans;         // [begin, end) of tensors[i]'s data
  std::unordered_map<std::string_view, size_t> index;     // name (in tensors) -> position
  std::map<std::string, std::string> metadata;
  std::map<std::string, std::string> crcs;

  explicit Impl(const std::string& path) : file(path) {}
};

SafetensorsReader::SafetensorsReader(const std::string& path) : impl_(std::make_unique<Impl>(path)) {
  Impl& r = *impl_;
  st::Header h;
  try {
    uint8_t first8[8] = {};
    if (r.file.size() >= 8) r.file.read_at(0, first8, 8);
    const uint64_t n = st::header_length(first8, r.file.size());
    std::string json(static_cast<size_t>(n), '\0');  // n is checked against the file size
    r.file.read_at(8, json.data(), json.size());
    r.data_start = 8 + n;
    h = st::parse_header(json.data(), json.size(), r.file.size() - r.data_start);
  } catch (const st::FormatError& e) {
    throw CheckpointError(path + ": not a valid safetensors file: " + e.what());
  }
  // Handed over node by node, never held twice (a header may hold millions
  // of metadata entries): user entries move as they are, checksum entries
  // lose their prefix and leave the header's map as they go.
  while (!h.metadata.empty()) {
    auto node = h.metadata.extract(h.metadata.begin());
    if (node.key().rfind(st::kCrcPrefix, 0) == 0) {
      r.crcs.emplace(node.key().substr(std::strlen(st::kCrcPrefix)), std::move(node.mapped()));
    } else {
      r.metadata.insert(std::move(node));
    }
  }
  // Moved, not copied: one copy of each name and shape (the header may be
  // 100 MB). tensors is not resized after, so the index's views stay valid.
  r.tensors.reserve(h.tensors.size());
  r.spans.reserve(h.tensors.size());
  for (auto& e : h.tensors) {
    const c10::ScalarType dtype = st::dtype_or_undefined(e.dtype);
    r.tensors.push_back({std::move(e.name), dtype, std::move(e.shape), std::move(e.dtype)});
    r.spans.emplace_back(e.begin, e.end);
  }
  h.tensors.clear();
  h.tensors.shrink_to_fit();
  r.index.reserve(r.tensors.size());
  for (size_t i = 0; i < r.tensors.size(); ++i) r.index.emplace(r.tensors[i].name, i);
}

SafetensorsReader::~SafetensorsReader() = default;

const std::vector<SafetensorsTensorInfo>& SafetensorsReader::tensors() const { return impl_->tensors; }
const std::map<std::string, std::string>& SafetensorsReader::metadata() const { return impl_->metadata; }
const std::string& SafetensorsReader::path() const { return impl_->file.path(); }
bool SafetensorsReader::contains(const std::string& name) const { return impl_->index.count(name) > 0; }

at::Tensor SafetensorsReader::read(const std::string& name) const { return read_range(name, 0, -1); }

at::Tensor SafetensorsReader::read_rows(const std::string& name, int64_t first_row, int64_t rows) const {
  if (rows < 0) throw UsageError("SafetensorsReader::read_rows: a negative number of rows");
  return read_range(name, first_row, rows);
}

// rows < 0: the whole tensor (a 0-d one too). A part of a tensor whose
// header carries a checksum is checked too: the bytes around the rows pass
// through a small buffer into the CRC (memory: the rows and 1 MiB; time:
// the whole tensor's bytes).
at::Tensor SafetensorsReader::read_range(const std::string& name, int64_t first_row, int64_t rows) const {
  const Impl& r = *impl_;
  const auto it = r.index.find(name);
  if (it == r.index.end()) throw CheckpointError(path() + ": no tensor '" + name + "'");
  const SafetensorsTensorInfo& e = r.tensors[it->second];
  const auto [whole_begin, whole_end] = r.spans[it->second];
  uint64_t begin = whole_begin, end = whole_end;
  std::vector<int64_t> shape = e.shape;
  if (rows >= 0) {
    if (shape.empty() || first_row < 0 || first_row > shape[0] || rows > shape[0] - first_row) {
      throw CheckpointError(path() + ": tensor '" + name + "' (" + checkpoint::shape_string(shape) +
                            ") has no rows [" + std::to_string(first_row) + ", " + std::to_string(first_row + rows) +
                            ")");
    }
    // The header check made the whole tensor's byte count exact, so a
    // row's bytes divide it (a tensor of 0 rows has none to read).
    const uint64_t row_bytes = shape[0] == 0 ? 0 : (end - begin) / static_cast<uint64_t>(shape[0]);
    begin += row_bytes * static_cast<uint64_t>(first_row);
    end = begin + row_bytes * static_cast<uint64_t>(rows);
    shape[0] = rows;
  }
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(st::dtype_of(e.format_dtype, path(), name)));
  const size_t n = static_cast<size_t>(end - begin);
  r.file.read_at(r.data_start + begin, t.data_ptr(), n);
  const auto crc = r.crcs.find(name);
  if (crc != r.crcs.end()) {
    std::vector<char> buf;
    const auto crc_of_range = [&](uint32_t c, uint64_t from, uint64_t to) {
      buf.resize(static_cast<size_t>(std::min<uint64_t>(to - from, uint64_t{1} << 20)));
      for (uint64_t at = from; at < to; at += buf.size()) {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(buf.size(), to - at));
        r.file.read_at(r.data_start + at, buf.data(), k);
        c = checkpoint::crc32(c, buf.data(), k);
      }
      return c;
    };
    uint32_t c = crc_of_range(0, whole_begin, begin);
    c = checkpoint::crc32(c, t.data_ptr(), n);
    c = crc_of_range(c, end, whole_end);
    if (crc->second != st::hex32(c)) {
      throw CheckpointError(path() + ": tensor '" + name + "' is corrupt (its CRC-32 is " + st::hex32(c) +
                            ", the header says " + crc->second + ")");
    }
  }
  if (t.scalar_type() == at::kBool) {
    const auto* b = static_cast<const uint8_t*>(t.data_ptr());
    for (size_t i = 0; i < n; ++i) {
      if (b[i] > 1) throw CheckpointError(path() + ": tensor '" + name + "' is BOOL but holds a byte other than 0 or 1");
    }
  }
  return t;
}

// ---- whole files ------------------------------------------------------------------

void save_safetensors(const std::string& path, const torch::OrderedDict<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsTensorInfo> infos;
  for (const auto& item : tensors) {
    const at::Tensor& t = item.value();
    if (!t.defined()) throw UsageError("save_safetensors: tensor '" + item.key() + "' is undefined");
    infos.push_back({item.key(), t.scalar_type(), t.sizes().vec()});
  }
  SafetensorsWriter w(path, std::move(infos), metadata);
  for (const auto& item : tensors) w.write(item.key(), item.value().detach());
  w.finish();
}

torch::OrderedDict<std::string, at::Tensor> load_safetensors(const std::string& path) {
  SafetensorsReader r(path);
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& t : r.tensors()) out.insert(t.name, r.read(t.name));
  return out;
}

}  // namespace tdist
