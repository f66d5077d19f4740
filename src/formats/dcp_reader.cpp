// A DCP folder's tensors and values read (dcp_reader.h).
#include "formats/dcp_reader.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "formats/file_io.h"
#include "formats/pickle_format.h"
#include "formats/safetensors_header.h"
#include "formats/safetensors_names.h"
#include "tdist/errors.h"

namespace tdist::checkpoint {

namespace {

constexpr uint64_t kPiece = uint64_t{1} << 20;
constexpr uint64_t kMaxValueBytes = uint64_t{4} << 20;

// Where a chunk's elements go in a box: runs of elements contiguous in
// both (src: element index in the chunk, row-major; dst: in the box),
// in increasing src order.
class Runs {
 public:
  Runs(const dcp::Chunk& c, const std::vector<int64_t>& lo, const std::vector<int64_t>& ext) {
    const size_t n = c.sizes.size();
    rlo_.resize(n);
    rhi_.resize(n);
    for (size_t d = 0; d < n; ++d) {
      rlo_[d] = std::max(c.offsets[d], lo[d]);
      rhi_[d] = std::min(c.offsets[d] + c.sizes[d], lo[d] + ext[d]);
      if (rlo_[d] >= rhi_[d]) empty_ = true;
    }
    cstride_.assign(n, 1);
    bstride_.assign(n, 1);
    for (size_t d = n; d-- > 1;) {
      cstride_[d - 1] = cstride_[d] * c.sizes[d];
      bstride_[d - 1] = bstride_[d] * ext[d];
    }
    // Trailing dims whole in the chunk and the box merge into one run.
    k_ = n == 0 ? 0 : n - 1;
    while (k_ > 0) {
      const size_t d = k_;
      const bool whole = rlo_[d] == c.offsets[d] && rlo_[d] == lo[d] && rhi_[d] - rlo_[d] == c.sizes[d] &&
                         c.sizes[d] == ext[d];
      if (!whole) break;
      --k_;
    }
    len_ = n == 0 ? 1 : (rhi_[k_] - rlo_[k_]) * cstride_[k_];
    co_ = c.offsets;
    lo_ = lo;
  }
  bool empty() const { return empty_; }
  // Calls f(src, dst, len) for each run, in increasing src.
  void each(const std::function<void(int64_t, int64_t, int64_t)>& f) {
    if (empty_) return;
    const size_t n = rlo_.size();
    if (n == 0) return f(0, 0, 1);
    std::vector<int64_t> i(rlo_.begin(), rlo_.begin() + static_cast<std::ptrdiff_t>(k_));
    while (true) {
      int64_t src = (rlo_[k_] - co_[k_]) * cstride_[k_], dst = (rlo_[k_] - lo_[k_]) * bstride_[k_];
      for (size_t d = 0; d < k_; ++d) {
        src += (i[d] - co_[d]) * cstride_[d];
        dst += (i[d] - lo_[d]) * bstride_[d];
      }
      f(src, dst, len_);
      size_t d = k_;
      while (d > 0) {
        --d;
        if (++i[d] < rhi_[d]) break;
        i[d] = rlo_[d];
        if (d == 0) return;
      }
      if (k_ == 0) return;
    }
  }

 private:
  std::vector<int64_t> rlo_, rhi_, cstride_, bstride_, co_, lo_;
  size_t k_ = 0;
  int64_t len_ = 0;
  bool empty_ = false;
};

// Pieces of a chunk's bytes, in order from byte `from`, copied into the
// box by its runs.
class Scatter {
 public:
  Scatter(Runs& runs, size_t elem, char* out) : elem_(elem), out_(out) {
    runs.each([this](int64_t s, int64_t d, int64_t n) { runs_.push_back({s, d, n}); });
  }
  // The chunk bytes needed: [first, last).
  uint64_t first() const { return runs_.empty() ? 0 : static_cast<uint64_t>(runs_.front().src) * elem_; }
  uint64_t last() const {
    return runs_.empty() ? 0 : static_cast<uint64_t>(runs_.back().src + runs_.back().len) * elem_;
  }
  // Bytes [at, at + n) of the chunk.
  void piece(uint64_t at, const char* p, size_t n) {
    while (next_ < runs_.size()) {
      const Run& r = runs_[next_];
      const uint64_t b = static_cast<uint64_t>(r.src) * elem_, e = b + static_cast<uint64_t>(r.len) * elem_;
      const uint64_t from = std::max(b, at), to = std::min(e, at + n);
      if (from < to) std::memcpy(out_ + static_cast<uint64_t>(r.dst) * elem_ + (from - b), p + (from - at), to - from);
      if (e > at + n) return;  // the run goes on in the next piece
      ++next_;
    }
  }

 private:
  struct Run {
    int64_t src, dst, len;
  };
  std::vector<Run> runs_;
  size_t next_ = 0;
  size_t elem_;
  char* out_;
};

}  // namespace

struct DcpReader::Blob {
  safetensors::Header header;
  uint64_t data_start = 0;  // in the file
};

DcpReader::DcpReader(std::string dir) : dir_(std::move(dir)), metadata_(dcp::read_metadata(dir_)) {}

DcpReader::~DcpReader() = default;

std::shared_ptr<const DcpReader::Blob> DcpReader::blob(const dcp::Storage& s) const {
  {
    std::lock_guard<std::mutex> g(mu_);
    const auto it = blobs_.find({s.file, s.offset});
    if (it != blobs_.end()) return it->second;
  }
  const std::string path = dir_ + "/" + s.file;
  FileReader f(path);
  auto b = std::make_shared<Blob>();
  try {
    uint8_t first8[8];
    f.read_at(s.offset, first8, 8);
    const uint64_t n = safetensors::header_length(first8, f.size() - s.offset);
    std::string json(static_cast<size_t>(n), '\0');
    f.read_at(s.offset + 8, json.data(), json.size());
    b->header = safetensors::parse_header(json.data(), json.size(), f.size() - s.offset - 8 - n);
    b->data_start = s.offset + 8 + n;
  } catch (const safetensors::FormatError& e) {
    throw CheckpointError(path + ": at byte " + std::to_string(s.offset) +
                          ": neither a torch.save zip nor a safetensors blob: " + e.what());
  }
  std::lock_guard<std::mutex> g(mu_);
  return blobs_.emplace(std::make_pair(s.file, s.offset), std::move(b)).first->second;
}

void DcpReader::read_chunk(const dcp::Item& item, const dcp::Chunk& c, const std::vector<int64_t>& lo,
                           const std::vector<int64_t>& extent, char* out) const {
  Runs runs(c, lo, extent);
  if (runs.empty()) return;
  const size_t elem = c10::elementSize(item.dtype);
  Scatter scatter(runs, elem, out);
  const std::string path = dir_ + "/" + c.storage.file;
  const std::string what = "'" + item.fqn + "' (its chunk at offset " + std::to_string(c.storage.offset) + ")";
  const auto mismatch = [&](const std::string& dtype, const std::vector<int64_t>& sizes) {
    std::string s = "[";
    for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
    throw CheckpointError(path + ": " + what + " holds " + dtype + s + "], the metadata says " +
                          c10::toString(item.dtype) + " of its chunk sizes");
  };
  char magic[4] = {0, 0, 0, 0};
  if (c.storage.length >= 4) FileReader(path).read_at(c.storage.offset, magic, 4);
  if (std::memcmp(magic, "PK\x03\x04", 4) != 0) {  // the safetensors variant
    const std::shared_ptr<const Blob> b = blob(c.storage);
    const auto t = std::find_if(b->header.tensors.begin(), b->header.tensors.end(),
                                [&](const safetensors::TensorEntry& e) { return e.name == item.fqn; });
    if (t == b->header.tensors.end()) throw CheckpointError(path + ": " + what + " is not in its safetensors blob");
    if (safetensors::dtype_or_undefined(t->dtype) != item.dtype || t->shape != c.sizes) mismatch(t->dtype, t->shape);
    FileReader f(path);
    std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(kPiece, scatter.last() - scatter.first())));
    for (uint64_t at = scatter.first(); at < scatter.last();) {
      const size_t k = static_cast<size_t>(std::min<uint64_t>(buf.size(), scatter.last() - at));
      f.read_at(b->data_start + t->begin + at, buf.data(), k);
      scatter.piece(at, buf.data(), k);
      at += k;
    }
    return;
  }
  PtReader r(path, c.storage.offset, c.storage.length);
  if (r.root().kind() != PtValue::Kind::Tensor) throw CheckpointError(r.path() + ": " + what + " is not a tensor");
  const PtTensorRef& ref = r.root().as_tensor();
  if (ref.dtype != item.dtype || ref.sizes != c.sizes) mismatch(c10::toString(ref.dtype), ref.sizes);
  if (view_is_contiguous(ref)) {
    const uint64_t base = static_cast<uint64_t>(ref.storage_offset) * elem;
    uint64_t pos = 0;  // in the storage
    r.stream_storage(ref, [&](const char* p, size_t n) {
      if (pos + n > base) {
        const uint64_t skip = pos < base ? base - pos : 0;
        scatter.piece(pos + skip - base, p + skip, n - skip);
      }
      pos += n;
    });
    return;
  }
  // A strided view (its storage whole, then its elements in order).
  std::vector<char> storage(static_cast<size_t>(ref.storage_numel) * elem);
  r.read_storage(ref, storage.data());
  std::vector<char> dense(static_cast<size_t>(c.numel()) * elem);
  gather_view(ref, storage.data(), dense.data());
  scatter.piece(0, dense.data(), dense.size());
}

void DcpReader::read_box(const dcp::Item& item, const std::vector<int64_t>& lo, const std::vector<int64_t>& extent,
                         void* out) const {
  if (!item.tensor) throw UsageError("DcpReader::read_box: '" + item.fqn + "' is not a tensor");
  if (lo.size() != item.size.size() || extent.size() != item.size.size()) {
    throw UsageError("DcpReader::read_box: a box of another rank than '" + item.fqn + "'");
  }
  for (size_t d = 0; d < lo.size(); ++d) {
    if (lo[d] < 0 || extent[d] < 0 || lo[d] > item.size[d] || extent[d] > item.size[d] - lo[d]) {
      throw UsageError("DcpReader::read_box: a box outside '" + item.fqn + "'");
    }
  }
  for (const dcp::Chunk& c : item.chunks) read_chunk(item, c, lo, extent, static_cast<char*>(out));
}

void DcpReader::read_rows(const dcp::Item& item, int64_t first, int64_t rows, void* out) const {
  if (item.size.empty()) {
    if (first != 0 || rows > 1) throw UsageError("DcpReader::read_rows: rows of a 0-d tensor '" + item.fqn + "'");
    if (rows == 1) read_box(item, {}, {}, out);
    return;
  }
  std::vector<int64_t> lo(item.size.size(), 0), ext = item.size;
  lo[0] = first;
  ext[0] = rows;
  read_box(item, lo, ext, out);
}

PtValue DcpReader::read_value(const dcp::Item& item) const {
  if (item.tensor) throw UsageError("DcpReader::read_value: '" + item.fqn + "' is a tensor");
  if (item.bytes.length > kMaxValueBytes) {  // a param group's option, a list of names: never this big
    throw CheckpointError(dir_ + "/" + item.bytes.file + ": '" + item.fqn + "' is a value of " +
                          std::to_string(item.bytes.length) + " bytes, over the " +
                          std::to_string(kMaxValueBytes >> 20) + " MiB a value item may have");
  }
  PtReader r(dir_ + "/" + item.bytes.file, item.bytes.offset, item.bytes.length);
  std::function<void(const PtValue&)> no_tensor = [&](const PtValue& v) {
    if (v.kind() == PtValue::Kind::Tensor) throw CheckpointError(r.path() + ": '" + item.fqn + "' holds a tensor");
    if (v.kind() == PtValue::Kind::List || v.kind() == PtValue::Kind::Tuple) {
      for (const PtValue& x : v.items()) no_tensor(x);
    } else if (v.kind() == PtValue::Kind::Dict) {
      for (const auto& e : v.entries()) no_tensor(e.second);
    }
  };
  no_tensor(r.root());
  return r.root();
}

}  // namespace tdist::checkpoint
