// safetensors files of tensors: SafetensorsWriter, SafetensorsReader and
// the whole-file helpers. The contract is in include/tdist/checkpoint.h;
// the header's format and checks are in safetensors_header.h.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstring>
#include <set>

#include "checkpoint/file_io.h"
#include "checkpoint/safetensors_header.h"
#include "tdist/checkpoint.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian, as this host must be");

namespace tdist {

namespace {

namespace st = safetensors;

constexpr const char* kCrcPrefix = "tdist.crc32:";

const std::vector<std::pair<at::ScalarType, const char*>>& dtype_names() {
  static const std::vector<std::pair<at::ScalarType, const char*>> names = {
      {at::kBool, "BOOL"}, {at::kByte, "U8"},      {at::kChar, "I8"},     {at::kShort, "I16"},
      {at::kInt, "I32"},   {at::kLong, "I64"},     {at::kHalf, "F16"},    {at::kBFloat16, "BF16"},
      {at::kFloat, "F32"}, {at::kDouble, "F64"}};
  return names;
}

const char* dtype_name(at::ScalarType t, const std::string& path, const std::string& tensor) {
  for (const auto& [type, name] : dtype_names()) {
    if (type == t) return name;
  }
  throw CheckpointError(path + ": tensor '" + tensor + "' is " + c10::toString(t) +
                        ", which safetensors files of tdist do not hold");
}

at::ScalarType dtype_of(const std::string& name, const std::string& path, const std::string& tensor) {
  for (const auto& [type, n] : dtype_names()) {
    if (name == n) return type;
  }
  throw CheckpointError(path + ": tensor '" + tensor + "' is " + name + ", which has no LibTorch type tdist reads");
}

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

uint64_t nbytes_of(const SafetensorsTensorInfo& t) {
  uint64_t n = c10::elementSize(t.dtype);
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace

// ---- writer ---------------------------------------------------------------------

struct SafetensorsWriter::Impl {
  checkpoint::AtomicFileWriter file;
  std::vector<SafetensorsTensorInfo> tensors;
  std::vector<st::TensorEntry> entries;
  std::map<std::string, std::string> metadata;  // the user's and, at finish, the checksums
  size_t next = 0;
  size_t header_bytes = 0;  // the first header's; the last must be as long
  bool finished = false;

  explicit Impl(const std::string& path) : file(path) {}

  std::string header() {
    try {
      return st::make_header(entries, metadata);
    } catch (const st::FormatError& e) {
      throw CheckpointError(file.path() + ": " + e.what());
    }
  }
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<SafetensorsTensorInfo> tensors,
                                     std::map<std::string, std::string> metadata)
    : impl_(std::make_unique<Impl>(path)) {
  Impl& w = *impl_;
  for (const auto& [key, value] : metadata) {
    (void)value;
    if (key.rfind(kCrcPrefix, 0) == 0) throw UsageError("save_safetensors: metadata key '" + key + "' is tdist's own");
  }
  w.metadata = std::move(metadata);
  w.tensors = std::move(tensors);
  for (const auto& t : w.tensors) {
    for (int64_t d : t.shape) {
      if (d < 0) throw UsageError("save_safetensors: tensor '" + t.name + "' has a negative size");
    }
    w.entries.push_back({t.name, dtype_name(t.dtype, path, t.name), t.shape, 0, 0});
    w.metadata[kCrcPrefix + t.name] = "00000000";  // the header's size does not change when they are set
  }
  const std::string h = w.header();
  w.header_bytes = h.size();
  w.file.write(h.data(), h.size());
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const std::string& name, const at::Tensor& tensor) {
  Impl& w = *impl_;
  if (w.finished) throw UsageError("SafetensorsWriter::write after finish()");
  if (w.next >= w.tensors.size()) {
    throw UsageError("SafetensorsWriter: tensor '" + name + "' was not declared (all " +
                     std::to_string(w.tensors.size()) + " are written)");
  }
  const SafetensorsTensorInfo& want = w.tensors[w.next];
  if (name != want.name) {
    throw UsageError("SafetensorsWriter: tensor '" + name + "' written where '" + want.name + "' comes next");
  }
  if (!tensor.defined() || tensor.scalar_type() != want.dtype || tensor.sizes() != at::IntArrayRef(want.shape) ||
      !tensor.device().is_cpu() || tensor.layout() != at::kStrided) {
    throw UsageError("SafetensorsWriter: tensor '" + name + "' is not the dense CPU " +
                     std::string(c10::toString(want.dtype)) + " tensor of the declared shape");
  }
  const at::Tensor t = tensor.contiguous();
  const size_t n = static_cast<size_t>(nbytes_of(want));
  w.file.write(t.data_ptr(), n);
  w.metadata[kCrcPrefix + name] = hex32(checkpoint::crc32(0, t.data_ptr(), n));
  ++w.next;
}

void SafetensorsWriter::finish() {
  Impl& w = *impl_;
  if (w.finished) return;
  if (w.next != w.tensors.size()) {
    throw UsageError("SafetensorsWriter::finish: tensor '" + w.tensors[w.next].name + "' and " +
                     std::to_string(w.tensors.size() - w.next - 1) + " more were not written");
  }
  const std::string h = w.header();
  if (h.size() != w.header_bytes) {  // the checksums have a fixed width: this cannot happen
    throw std::logic_error("SafetensorsWriter: the header changed size (" + std::to_string(w.header_bytes) + " -> " +
                           std::to_string(h.size()) + ")");
  }
  w.file.write_at(0, h.data(), h.size());
  w.file.commit();
  w.finished = true;
}

// ---- reader ---------------------------------------------------------------------

struct SafetensorsReader::Impl {
  checkpoint::FileReader file;
  uint64_t data_start = 0;
  std::vector<SafetensorsTensorInfo> tensors;
  std::map<std::string, st::TensorEntry> entries;
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
  for (auto& [key, value] : h.metadata) {
    if (key.rfind(kCrcPrefix, 0) == 0) {
      r.crcs[key.substr(std::strlen(kCrcPrefix))] = value;
    } else {
      r.metadata[key] = value;
    }
  }
  for (auto& e : h.tensors) {
    at::ScalarType type = at::ScalarType::Undefined;
    for (const auto& [t, n] : dtype_names()) {
      if (e.dtype == n) type = t;
    }
    r.tensors.push_back({e.name, type, e.shape, e.dtype});
    r.entries[e.name] = e;
  }
}

SafetensorsReader::~SafetensorsReader() = default;

const std::vector<SafetensorsTensorInfo>& SafetensorsReader::tensors() const { return impl_->tensors; }
const std::map<std::string, std::string>& SafetensorsReader::metadata() const { return impl_->metadata; }
const std::string& SafetensorsReader::path() const { return impl_->file.path(); }
bool SafetensorsReader::contains(const std::string& name) const { return impl_->entries.count(name) > 0; }

at::Tensor SafetensorsReader::read(const std::string& name) const {
  const Impl& r = *impl_;
  const auto it = r.entries.find(name);
  if (it == r.entries.end()) throw CheckpointError(path() + ": no tensor '" + name + "'");
  const st::TensorEntry& e = it->second;
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(dtype_of(e.dtype, path(), name)));
  const size_t n = static_cast<size_t>(e.end - e.begin);
  r.file.read_at(r.data_start + e.begin, t.data_ptr(), n);
  const auto crc = r.crcs.find(name);
  if (crc != r.crcs.end() && crc->second != hex32(checkpoint::crc32(0, t.data_ptr(), n))) {
    throw CheckpointError(path() + ": tensor '" + name + "' is corrupt (its CRC-32 is " +
                          hex32(checkpoint::crc32(0, t.data_ptr(), n)) + ", the header says " + crc->second + ")");
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
