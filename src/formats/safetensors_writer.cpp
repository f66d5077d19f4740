// SafetensorsWriter (include/tdist/safetensors.h): needs c10 only, so the
// checkpoint tools stream safetensors files without LibTorch;
// write(at::Tensor) is in safetensors.cpp.
#include <c10/core/ScalarType.h>

#include "formats/file_io.h"
#include "formats/safetensors_header.h"
#include "formats/safetensors_names.h"
#include "tdist/safetensors.h"

namespace tdist {

namespace st = safetensors;

// ---- writer ---------------------------------------------------------------------

struct SafetensorsWriter::Impl {
  checkpoint::AtomicFileWriter file;
  std::vector<SafetensorsTensorInfo> tensors;
  std::vector<st::TensorEntry> entries;
  std::map<std::string, std::string> metadata;  // the user's and, at finish, the checksums
  size_t next = 0;
  bool in_tensor = false;
  uint64_t written = 0;  // of the open tensor
  uint32_t crc = 0;      // of the same
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
    if (key.rfind(st::kCrcPrefix, 0) == 0) throw UsageError("save_safetensors: metadata key '" + key + "' is tdist's own");
  }
  w.metadata = std::move(metadata);
  w.tensors = std::move(tensors);
  for (const auto& t : w.tensors) {
    for (int64_t d : t.shape) {
      if (d < 0) throw UsageError("save_safetensors: tensor '" + t.name + "' has a negative size");
    }
    w.entries.push_back({t.name, st::dtype_name(t.dtype, path, t.name), t.shape, 0, 0});
    w.metadata[st::kCrcPrefix + t.name] = "00000000";  // the header's size does not change when they are set
  }
  const std::string h = w.header();
  w.header_bytes = h.size();
  w.file.write(h.data(), h.size());
}

SafetensorsWriter::~SafetensorsWriter() = default;

const SafetensorsTensorInfo* SafetensorsWriter::next_tensor() const {
  const Impl& w = *impl_;
  return w.next < w.tensors.size() ? &w.tensors[w.next] : nullptr;
}

void SafetensorsWriter::begin_tensor(const std::string& name) {
  Impl& w = *impl_;
  if (w.finished) throw UsageError("SafetensorsWriter: tensor '" + name + "' written after finish()");
  if (w.in_tensor) throw UsageError("SafetensorsWriter: tensor '" + name + "' begun before the last one ended");
  if (w.next >= w.tensors.size()) {
    throw UsageError("SafetensorsWriter: tensor '" + name + "' was not declared (all " +
                     std::to_string(w.tensors.size()) + " are written)");
  }
  const SafetensorsTensorInfo& want = w.tensors[w.next];
  if (name != want.name) {
    throw UsageError("SafetensorsWriter: tensor '" + name + "' written where '" + want.name + "' comes next");
  }
  w.in_tensor = true;
  w.written = 0;
  w.crc = 0;
}

void SafetensorsWriter::append(const void* data, size_t n) {
  Impl& w = *impl_;
  if (!w.in_tensor) throw UsageError("SafetensorsWriter::append outside begin_tensor/end_tensor");
  const SafetensorsTensorInfo& want = w.tensors[w.next];
  if (n > st::nbytes_of(want) - w.written) {
    throw UsageError("SafetensorsWriter: more than the " + std::to_string(st::nbytes_of(want)) + " bytes of tensor '" +
                     want.name + "'");
  }
  w.file.write(data, n);
  w.crc = checkpoint::crc32(w.crc, data, n);
  w.written += n;
}

void SafetensorsWriter::end_tensor() {
  Impl& w = *impl_;
  if (!w.in_tensor) throw UsageError("SafetensorsWriter::end_tensor without begin_tensor");
  const SafetensorsTensorInfo& want = w.tensors[w.next];
  if (w.written != st::nbytes_of(want)) {
    throw UsageError("SafetensorsWriter: tensor '" + want.name + "' got " + std::to_string(w.written) + " of its " +
                     std::to_string(st::nbytes_of(want)) + " bytes");
  }
  w.metadata[st::kCrcPrefix + want.name] = st::hex32(w.crc);
  w.in_tensor = false;
  ++w.next;
}

void SafetensorsWriter::finish() {
  Impl& w = *impl_;
  if (w.finished) return;
  if (w.in_tensor) throw UsageError("SafetensorsWriter::finish inside a tensor");
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

}  // namespace tdist
