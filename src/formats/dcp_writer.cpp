// One rank's DCP data file (dcp_writer.h).
#include "formats/dcp_writer.h"

#include <dirent.h>
#include <unistd.h>

#include <set>

#include "tdist/errors.h"

namespace tdist::checkpoint {

DcpRankFileWriter::DcpRankFileWriter(const std::string& dir, std::string name)
    : name_(std::move(name)), file_(dir + "/" + name_) {}

DcpRankFileWriter::~DcpRankFileWriter() = default;

void DcpRankFileWriter::begin_tensor(c10::ScalarType dtype, const std::vector<int64_t>& sizes) {
  if (item_) throw UsageError("DcpRankFileWriter: a tensor begun inside another");
  PtTensorRef ref;
  ref.storage_key = "0";
  ref.dtype = dtype;
  ref.sizes = sizes;
  ref.strides.assign(sizes.size(), 1);
  int64_t numel = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    ref.strides[d] = numel;
    numel *= sizes[d];
  }
  ref.storage_numel = numel;
  item_start_ = file_.size();
  item_ = std::make_unique<PtWriter>(file_, "archive");
  item_->begin(PtValue::tensor(ref));
  item_->begin_storage("0");
}

void DcpRankFileWriter::append(const void* data, size_t n) {
  if (!item_) throw UsageError("DcpRankFileWriter::append outside a tensor");
  item_->append(data, n);
}

dcp::Storage DcpRankFileWriter::end_tensor() {
  if (!item_) throw UsageError("DcpRankFileWriter::end_tensor without begin_tensor");
  item_->end_storage();
  item_->finish();
  item_.reset();
  return {name_, item_start_, file_.size() - item_start_};
}

dcp::Storage DcpRankFileWriter::add_value(const PtValue& v) {
  if (item_) throw UsageError("DcpRankFileWriter: a value inside a tensor");
  const uint64_t start = file_.size();
  PtWriter w(file_, "archive");
  w.begin(v);
  w.finish();
  return {name_, start, file_.size() - start};
}

void DcpRankFileWriter::sync() { file_.sync(); }

void DcpRankFileWriter::commit() { file_.commit(); }

namespace {

// The data files the folder's current .metadata names (none when it has none or
// it does not parse).
std::set<std::string> current_files(const std::string& dir) {
  std::set<std::string> out;
  if (!dcp::is_dcp_folder(dir)) return out;
  try {
    const dcp::Metadata m = dcp::read_metadata(dir);
    for (const dcp::Item& it : m.items) {
      if (!it.tensor) out.insert(it.bytes.file);
      for (const auto& c : it.chunks) out.insert(c.storage.file);
    }
  } catch (const CheckpointError&) {
  }
  return out;
}

// A k for this save's __<rank>_<k>.distcp that no current file has.
int fresh_index(const std::set<std::string>& current) {
  for (int k = 0;; ++k) {
    const std::string tail = "_" + std::to_string(k) + ".distcp";
    bool used = false;
    for (const auto& f : current) used = used || (f.size() > tail.size() && f.compare(f.size() - tail.size(), tail.size(), tail) == 0);
    if (!used) return k;
  }
}

}  // namespace

void remove_stale_files(const std::string& dir, const dcp::Metadata& m) {
  std::set<std::string> keep;
  for (const dcp::Item& it : m.items) {
    if (!it.tensor) keep.insert(it.bytes.file);
    for (const auto& c : it.chunks) keep.insert(c.storage.file);
  }
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.size() > 9 && n.rfind("__", 0) == 0 && n.compare(n.size() - 7, 7, ".distcp") == 0 && !keep.count(n)) {
      stale.push_back(n);
    }
  }
  ::closedir(d);
  for (const auto& n : stale) ::unlink((dir + "/" + n).c_str());
}


int fresh_file_index(const std::string& dir) { return fresh_index(current_files(dir)); }

}  // namespace tdist::checkpoint
