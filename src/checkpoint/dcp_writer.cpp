// One rank's DCP data file (dcp_writer.h).
#include "checkpoint/dcp_writer.h"

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

}  // namespace tdist::checkpoint
