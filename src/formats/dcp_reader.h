// A DCP folder's data (dcp_metadata.h says what it holds): boxes of its
// tensors read from the chunks that overlap them, and its other values.
//
//   DcpReader r("ckpt/step100");
//   const dcp::Item* w = r.metadata().find("model.l1.weight");
//   std::vector<float> rows(2 * 5);
//   r.read_rows(*w, 1, 2, rows.data());      // rows 1 and 2 of a [3, 5] tensor
//   PtValue lr = r.read_value(*r.metadata().find("optim.param_groups.0.lr"));
//
// A chunk stored as torch.save (PyTorch's default) is read through the .pt
// reader, 1 MiB at a time with its record's CRC checked, its elements
// copied straight to where they belong; one stored in a safetensors blob
// (FileSystemWriter's SerializationFormat.SAFETENSORS) likewise from its
// byte range. Each chunk's file record must be exactly the chunk (dtype,
// sizes). Memory: the caller's buffer and ~1 MiB (a chunk whose tensor
// is a non-contiguous view: its storage). No LibTorch (c10 only).
//
// Errors: CheckpointError naming the file, the key and the problem.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "formats/dcp_metadata.h"
#include "formats/pt_file.h"

namespace tdist::checkpoint {

class DcpReader {
 public:
  // The folder's .metadata read and checked (read_metadata).
  explicit DcpReader(std::string dir);
  ~DcpReader();

  const dcp::Metadata& metadata() const { return metadata_; }
  const std::string& dir() const { return dir_; }

  // The elements of `item` in the box starting at `lo` of `extent` (one
  // per dim) into `out`, row-major over the box, in the item's dtype.
  void read_box(const dcp::Item& item, const std::vector<int64_t>& lo, const std::vector<int64_t>& extent,
                void* out) const;
  // Rows [first, first + rows) of dim 0 (a 0-d tensor: whole when rows is 1).
  void read_rows(const dcp::Item& item, int64_t first, int64_t rows, void* out) const;
  // A non-tensor item's value (its torch.save, read by the .pt reader; a
  // tensor inside it is refused).
  PtValue read_value(const dcp::Item& item) const;

 private:
  struct Blob;  // a safetensors blob's header, by (file, offset)
  std::string dir_;
  dcp::Metadata metadata_;
  mutable std::mutex mu_;
  mutable std::map<std::pair<std::string, uint64_t>, std::shared_ptr<const Blob>> blobs_;

  void read_chunk(const dcp::Item& item, const dcp::Chunk& c, const std::vector<int64_t>& lo,
                  const std::vector<int64_t>& extent, char* out) const;
  std::shared_ptr<const Blob> blob(const dcp::Storage& s) const;
};

}  // namespace tdist::checkpoint
