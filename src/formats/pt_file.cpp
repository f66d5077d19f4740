// PtWriter and PtReader: .pt files written and read one record at a time,
// on the zip layer (zip_format.h), the pickle (pickle_value /
// unpickle_value) and the checkpoint files' atomic writer and checked
// reader (file_io.h). The contract is in pt_file.h.
#include "formats/pt_file.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "formats/file_io.h"
#include "formats/pickle_format.h"
#include "formats/zip_format.h"
#include "tdist/errors.h"
#include "util/coding.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, ".pt data is little-endian, as this host must be");

namespace tdist::checkpoint {

namespace {

constexpr uint64_t kMaxPickleBytes = uint64_t{1} << 30;
constexpr size_t kChunk = size_t{4} << 20;  // of the rest of a record read for its CRC
// What stream_storage reads at a time: small enough to stay in the CPU's
// cache between the read, the CRC and the consumer's write.
constexpr size_t kStreamChunk = size_t{1} << 20;
constexpr int kMinVersion = 1, kMaxVersion = 10;

uint64_t storage_nbytes(const PtTensorRef& t) {
  return static_cast<uint64_t>(t.storage_numel) * c10::elementSize(t.dtype);
}

// The tensors of v, depth first, in the order pickle_value writes them.
void collect_tensors(const PtValue& v, std::vector<const PtTensorRef*>& out) {
  switch (v.kind()) {
    case PtValue::Kind::List:
    case PtValue::Kind::Tuple:
      for (const PtValue& x : v.items()) collect_tensors(x, out);
      return;
    case PtValue::Kind::Dict:
      for (const auto& [k, x] : v.entries()) collect_tensors(x, out);
      return;
    case PtValue::Kind::Tensor: out.push_back(&v.as_tensor()); return;
    default: return;
  }
}

bool valid_key(const std::string& key) {
  if (key.empty() || key.size() > 255) return false;
  return std::all_of(key.begin(), key.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '.';
  });
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

}  // namespace

// ---- writer ---------------------------------------------------------------------

struct PtWriter::Impl {
  std::unique_ptr<AtomicFileWriter> own;  // null when writing into another's file
  AtomicFileWriter& file;
  const uint64_t base;  // where the archive starts in `file` (its offsets are from there)
  std::string archive;
  bool force_zip64 = zip::force_zip64_for_testing();
  std::vector<zip::Entry> entries;
  std::vector<PtTensorRef> storages;  // to write, in order
  size_t next = 0;
  bool begun = false, in_storage = false, finished = false, synced = false;
  uint64_t written = 0;  // of the open record
  uint32_t crc = 0;

  Impl(const std::string& path, std::string a)
      : own(std::make_unique<AtomicFileWriter>(path)), file(*own), base(0), archive(std::move(a)) {}
  Impl(AtomicFileWriter& into, std::string a) : file(into), base(into.size()), archive(std::move(a)) {}

  void open_record(const std::string& name, uint64_t size) {
    zip::Entry e;
    e.name = archive + "/" + name;
    e.header_offset = file.size() - base;
    e.size = size;
    const std::string h = zip::local_header(e.name, e.header_offset, size, 0, force_zip64);
    file.write(h.data(), h.size());
    e.data_offset = file.size() - base;
    entries.push_back(std::move(e));
    written = 0;
    crc = 0;
  }
  void write(const void* data, size_t n) {
    file.write(data, n);
    crc = crc32(crc, data, n);
    written += n;
  }
  void close_record() {
    zip::Entry& e = entries.back();
    e.crc = crc;
    char le[4];
    coding::encode_le(le, crc, 4);
    file.write_at(base + e.header_offset + zip::kLocalCrcField, le, sizeof le);
  }
  void whole_record(const std::string& name, const std::string& bytes) {
    open_record(name, bytes.size());
    write(bytes.data(), bytes.size());
    close_record();
  }
};

namespace {
void check_archive(const std::string& archive) {
  if (archive.empty() || archive.find('/') != std::string::npos || archive.size() > 1024) {
    throw UsageError("PtWriter: the archive name '" + archive + "' is empty, too long or has a '/'");
  }
}
}  // namespace

PtWriter::PtWriter(const std::string& path, std::string archive) {
  check_archive(archive);
  impl_ = std::make_unique<Impl>(path, std::move(archive));
}

PtWriter::PtWriter(AtomicFileWriter& into, std::string archive) {
  check_archive(archive);
  impl_ = std::make_unique<Impl>(into, std::move(archive));
}

uint64_t PtWriter::bytes() const { return impl_->file.size() - impl_->base; }

PtWriter::~PtWriter() = default;

const std::string& PtWriter::path() const { return impl_->file.path(); }

void PtWriter::begin(const PtValue& root) {
  Impl& w = *impl_;
  if (w.begun) throw UsageError("PtWriter::begin called twice");
  std::vector<const PtTensorRef*> tensors;
  collect_tensors(root, tensors);
  std::set<std::string> keys;
  for (const PtTensorRef* t : tensors) {
    const std::string what = "PtWriter: the tensor of storage '" + t->storage_key + "'";
    if (!valid_key(t->storage_key)) throw UsageError(what + ": keys are 1-255 of [A-Za-z0-9_.-]");
    if (!keys.insert(t->storage_key).second) throw UsageError(what + ": two tensors name that storage");
    const std::string problem = pickle::tensor_ref_problem(*t);
    if (!problem.empty()) throw UsageError(what + ": " + problem);
    int64_t numel = 1, stride = 1;
    bool contiguous = t->storage_offset == 0;
    for (size_t d = t->sizes.size(); d-- > 0;) {
      contiguous = contiguous && (t->sizes[d] == 1 || t->strides[d] == stride);
      stride *= t->sizes[d];
      numel *= t->sizes[d];
    }
    if (!contiguous || numel != t->storage_numel) {
      throw UsageError(what + " is not the whole storage, contiguous from offset 0");
    }
    w.storages.push_back(*t);
  }
  const std::string pkl = pickle_value(root);
  w.begun = true;
  w.whole_record("data.pkl", pkl);
  w.whole_record("byteorder", "little");
}

const PtTensorRef* PtWriter::next_storage() const {
  const Impl& w = *impl_;
  return w.next < w.storages.size() ? &w.storages[w.next] : nullptr;
}

void PtWriter::begin_storage(const std::string& key) {
  Impl& w = *impl_;
  if (w.finished || w.synced) throw UsageError("PtWriter: storage '" + key + "' written after finish()");
  if (!w.begun) throw UsageError("PtWriter: storage '" + key + "' written before begin()");
  if (w.in_storage) throw UsageError("PtWriter: storage '" + key + "' begun before the last one ended");
  if (w.next >= w.storages.size()) {
    throw UsageError("PtWriter: storage '" + key + "' is not in the value (all " + std::to_string(w.storages.size()) +
                     " are written)");
  }
  const PtTensorRef& want = w.storages[w.next];
  if (key != want.storage_key) {
    throw UsageError("PtWriter: storage '" + key + "' written where '" + want.storage_key + "' comes next");
  }
  w.open_record("data/" + key, storage_nbytes(want));
  w.in_storage = true;
}

void PtWriter::append(const void* data, size_t n) {
  Impl& w = *impl_;
  if (!w.in_storage) throw UsageError("PtWriter::append outside begin_storage/end_storage");
  const zip::Entry& e = w.entries.back();
  if (n > e.size - w.written) {
    throw UsageError("PtWriter: more than the " + std::to_string(e.size) + " bytes of storage '" +
                     w.storages[w.next].storage_key + "'");
  }
  w.write(data, n);
}

void PtWriter::end_storage() {
  Impl& w = *impl_;
  if (!w.in_storage) throw UsageError("PtWriter::end_storage without begin_storage");
  const zip::Entry& e = w.entries.back();
  if (w.written != e.size) {
    throw UsageError("PtWriter: storage '" + w.storages[w.next].storage_key + "' got " + std::to_string(w.written) +
                     " of its " + std::to_string(e.size) + " bytes");
  }
  w.close_record();
  w.in_storage = false;
  ++w.next;
}

void PtWriter::sync() {
  Impl& w = *impl_;
  if (w.finished || w.synced) return;
  if (!w.begun) throw UsageError("PtWriter::finish before begin()");
  if (w.in_storage) throw UsageError("PtWriter::finish inside a storage");
  if (w.next != w.storages.size()) {
    throw UsageError("PtWriter::finish: storage '" + w.storages[w.next].storage_key + "' and " +
                     std::to_string(w.storages.size() - w.next - 1) + " more were not written");
  }
  w.whole_record("version", "3\n");
  const uint64_t at = w.file.size() - w.base;
  const std::string cd = zip::central_directory(w.entries, at, w.force_zip64);
  w.file.write(cd.data(), cd.size());
  if (w.own) w.file.sync();  // an archive inside another's file: its owner syncs
  w.synced = true;
}

void PtWriter::commit() {
  Impl& w = *impl_;
  if (w.finished) return;
  sync();
  if (w.own) w.file.commit();
  w.finished = true;
}

void PtWriter::finish() { commit(); }

// ---- reader ---------------------------------------------------------------------

struct PtReader::Impl {
  FileReader file;
  std::string archive;
  std::map<std::string, zip::Entry> records;  // by name under the archive folder
  PtValue root;

  explicit Impl(const std::string& path) : file(path) {}
  Impl(const std::string& path, uint64_t base, uint64_t length) : file(path, base, length) {}
  void open();

  [[noreturn]] void fail(const std::string& what) const { throw CheckpointError(file.path() + ": " + what); }
  // A CheckpointError of a layer that does not know the file, given its name.
  [[noreturn]] void rethrow(const CheckpointError& e, const std::string& where) const {
    const std::string what = e.what();
    if (what.rfind(file.path() + ":", 0) == 0) throw e;
    fail(where + what);
  }

  const zip::Entry& record(const std::string& name) const {
    const auto it = records.find(name);
    if (it == records.end()) fail("no record '" + archive + "/" + name + "' (not a .pt file, or damaged)");
    return it->second;
  }

  // The first n bytes of a record into out, the rest through a buffer; the
  // CRC of all of it checked.
  void read_record(const zip::Entry& e, void* out, uint64_t n) const {
    if (n > e.size) fail("record '" + e.name + "' has " + std::to_string(e.size) + " bytes, not " + std::to_string(n));
    uint32_t crc = 0;
    char* p = static_cast<char*>(out);
    for (uint64_t at = 0; at < n;) {
      const size_t k = static_cast<size_t>(std::min<uint64_t>(n - at, uint64_t{1} << 30));
      file.read_at(e.data_offset + at, p + at, k);
      crc = crc32(crc, p + at, k);
      at += k;
    }
    if (n < e.size) {
      std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(e.size - n, kChunk)));
      for (uint64_t at = n; at < e.size;) {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(e.size - at, buf.size()));
        file.read_at(e.data_offset + at, buf.data(), k);
        crc = crc32(crc, buf.data(), k);
        at += k;
      }
    }
    check_crc(e, crc);
  }
  void check_crc(const zip::Entry& e, uint32_t crc) const {
    if (crc != e.crc) {
      fail("record '" + e.name + "' is corrupt: its CRC-32 is " + hex32(crc) + ", the directory says " + hex32(e.crc));
    }
  }

  std::string small_record(const std::string& name, uint64_t limit) const {
    const zip::Entry& e = record(name);
    if (e.size > limit) fail("record '" + e.name + "' has " + std::to_string(e.size) + " bytes, over " + std::to_string(limit));
    std::string s(static_cast<size_t>(e.size), '\0');
    read_record(e, s.data(), s.size());
    return s;
  }

  // A ref of root (or given by a caller): its record is there and holds its storage.
  const zip::Entry& storage_record(const PtTensorRef& t) const {
    const std::string problem = pickle::tensor_ref_problem(t);
    if (!problem.empty()) fail("the tensor of storage '" + t.storage_key + "': " + problem);
    const zip::Entry& e = record("data/" + t.storage_key);
    if (e.size != storage_nbytes(t)) {
      fail("record '" + e.name + "' has " + std::to_string(e.size) + " bytes, but its storage of " +
           std::to_string(t.storage_numel) + " " + c10::toString(t.dtype) + " needs " +
           std::to_string(storage_nbytes(t)));
    }
    return e;
  }
};

PtReader::PtReader(const std::string& path) : impl_(std::make_unique<Impl>(path)) { impl_->open(); }

PtReader::PtReader(const std::string& path, uint64_t base, uint64_t length)
    : impl_(std::make_unique<Impl>(path, base, length)) {
  impl_->open();
}

void PtReader::Impl::open() {
  Impl& r = *this;
  std::vector<zip::Entry> entries;
  try {
    entries = zip::read_directory(
        [&r](uint64_t offset, void* out, size_t n) { r.file.read_at(offset, out, n); }, r.file.size());
    r.archive = zip::archive_of(entries);
  } catch (const CheckpointError& e) {
    r.rethrow(e, "");
  }
  for (zip::Entry& e : entries) r.records.emplace(e.name.substr(r.archive.size() + 1), std::move(e));
  if (r.records.count("byteorder")) {
    const std::string order = r.small_record("byteorder", 16);
    if (order != "little") r.fail("byteorder is '" + order + "': only little-endian files are read");
  }
  if (r.records.count("version")) {
    const std::string v = r.small_record("version", 16);
    const std::string digits = v.substr(0, v.find_last_not_of("\r\n") + 1);
    const bool number = !digits.empty() && digits.size() < 4 &&
                        std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!number || std::stoi(digits) < kMinVersion || std::stoi(digits) > kMaxVersion) {
      r.fail("version record '" + digits + "' is not a format version this reader knows (1 to 10)");
    }
  }
  const std::string pkl = r.small_record("data.pkl", kMaxPickleBytes);
  try {
    r.root = unpickle_value(pkl);
  } catch (const CheckpointError& e) {
    r.rethrow(e, "data.pkl: ");
  }
  std::vector<const PtTensorRef*> tensors;
  collect_tensors(r.root, tensors);
  std::map<std::string, const PtTensorRef*> seen;
  for (const PtTensorRef* t : tensors) {
    const auto [it, fresh] = seen.emplace(t->storage_key, t);
    if (!fresh && (it->second->dtype != t->dtype || it->second->storage_numel != t->storage_numel)) {
      r.fail("storage '" + t->storage_key + "' is viewed as two dtypes or sizes");
    }
    if (fresh) r.storage_record(*t);
  }
}

PtReader::~PtReader() = default;

const PtValue& PtReader::root() const { return impl_->root; }

const std::string& PtReader::path() const { return impl_->file.path(); }

uint64_t PtReader::storage_bytes(const std::string& key) const { return impl_->record("data/" + key).size; }

void PtReader::read_storage_into(const std::string& key, void* out, uint64_t n) const {
  impl_->read_record(impl_->record("data/" + key), out, n);
}

void PtReader::check_storage(const PtTensorRef& ref) const { impl_->storage_record(ref); }

void PtReader::read_storage(const PtTensorRef& ref, void* out) const {
  const Impl& r = *impl_;
  const zip::Entry& e = r.storage_record(ref);
  r.read_record(e, out, e.size);
  if (ref.dtype == c10::kBool) {
    const auto* b = static_cast<const uint8_t*>(out);
    for (uint64_t i = 0; i < e.size; ++i) {
      if (b[i] > 1) r.fail("record '" + e.name + "' holds a bool other than 0 or 1");
    }
  }
}

void PtReader::stream_storage(const PtTensorRef& ref, const ByteSink& sink) const {
  const Impl& r = *impl_;
  const zip::Entry& e = r.storage_record(ref);
  // Not zero-filled (many records are small optimizer states), and not
  // kept: a checkpoint of many ranks has a reader per rank.
  const size_t chunk = static_cast<size_t>(std::min<uint64_t>(e.size, kStreamChunk));
  const std::unique_ptr<char[]> buffer(new char[std::max<size_t>(chunk, 1)]);
  char* buf = buffer.get();
  uint32_t crc = 0;
  bool bad_bool = false;  // the sink gets nothing from there on
  for (uint64_t at = 0; at < e.size;) {
    const size_t k = static_cast<size_t>(std::min<uint64_t>(e.size - at, chunk));
    r.file.read_at(e.data_offset + at, buf, k);
    crc = crc32(crc, buf, k);
    bad_bool = bad_bool || (ref.dtype == c10::kBool &&
                            std::any_of(buf, buf + k, [](char c) { return static_cast<uint8_t>(c) > 1; }));
    if (!bad_bool) sink(buf, k);
    at += k;
  }
  r.check_crc(e, crc);  // a corrupt record says so first, as read_storage does
  if (bad_bool) r.fail("record '" + e.name + "' holds a bool other than 0 or 1");
}

bool view_is_contiguous(const PtTensorRef& r) {
  int64_t expect = 1;
  for (size_t d = r.sizes.size(); d-- > 0;) {
    if (r.sizes[d] == 0) return true;
    if (r.sizes[d] != 1 && r.strides[d] != expect) return false;
    expect *= r.sizes[d];
  }
  return true;
}

void gather_view(const PtTensorRef& r, const void* storage_bytes, void* out_bytes) {
  const size_t elem = c10::elementSize(r.dtype);
  const char* storage = static_cast<const char*>(storage_bytes);
  char* out = static_cast<char*>(out_bytes);
  const size_t n = r.sizes.size();
  int64_t numel = 1;
  for (int64_t s : r.sizes) numel *= s;
  if (numel == 0) return;
  std::vector<int64_t> i(n, 0);
  for (int64_t k = 0; k < numel; ++k) {
    int64_t at = r.storage_offset;
    for (size_t d = 0; d < n; ++d) at += i[d] * r.strides[d];
    std::memcpy(out + static_cast<uint64_t>(k) * elem, storage + static_cast<uint64_t>(at) * elem, elem);
    for (size_t d = n; d-- > 0;) {
      if (++i[d] < r.sizes[d]) break;
      i[d] = 0;
    }
  }
}


}  // namespace tdist::checkpoint
