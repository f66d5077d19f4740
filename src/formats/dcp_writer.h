// One rank's data file of a DCP save (dcp_metadata.h has the layout):
// items appended one after another, each tensor chunk a torch.save of it
// and each other value a torch.save of the value, as PyTorch's
// FileSystemWriter writes them; each returns where it lies for the
// .metadata. The file is written aside and renamed by commit(), as
// AtomicFileWriter does.
//
//   DcpRankFileWriter w(dir, "__0_0.distcp");
//   w.begin_tensor(c10::kFloat, {4, 6});  w.append(p, n);  dcp::Storage s = w.end_tensor();
//   dcp::Storage lr = w.add_value(PtValue::floating(0.01));
//   w.sync();  ...  w.commit();
//
// No LibTorch (c10 only).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "formats/dcp_metadata.h"
#include "formats/file_io.h"
#include "formats/pt_file.h"

namespace tdist::checkpoint {

class DcpRankFileWriter {
 public:
  DcpRankFileWriter(const std::string& dir, std::string name);
  ~DcpRankFileWriter();

  // A chunk of `sizes` elements of `dtype`, contiguous: begin, then
  // exactly its bytes through append, then end.
  void begin_tensor(c10::ScalarType dtype, const std::vector<int64_t>& sizes);
  void append(const void* data, size_t n);
  dcp::Storage end_tensor();
  // A value without tensors.
  dcp::Storage add_value(const PtValue& v);
  void sync();
  void commit();
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  AtomicFileWriter file_;
  std::unique_ptr<PtWriter> item_;
  uint64_t item_start_ = 0;
};

// A k for a new save's __<rank>_<k>.distcp files in `dir` that no file its
// current .metadata names has (0 in a folder without one): a save writes
// beside the checkpoint it replaces, which stays whole until the new
// .metadata is renamed over the old.
int fresh_file_index(const std::string& dir);
// The data files (__*.distcp) in `dir` that `m` does not name, removed:
// an older save's, once the new .metadata is in place.
void remove_stale_files(const std::string& dir, const dcp::Metadata& m);

}  // namespace tdist::checkpoint
