// A sharded checkpoint's tensors as LibTorch tensors: sharded_tensors.h.
#include "checkpoint/sharded_tensors.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace tdist::checkpoint {

at::Tensor read_full(const ShardedCheckpointFiles& files, const LogicalTensor& t) {
  // The shape was checked against every piece's record when the files were
  // opened; each piece (a whole storage) is read straight into its place.
  at::Tensor full = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
  char* out = static_cast<char*>(full.data_ptr());
  for (size_t r = 0; r < t.pieces.size(); ++r) {
    files.reader(static_cast<int>(r)).read_storage(*t.pieces[r], out);
    out += t.pieces[r]->storage_numel * static_cast<int64_t>(full.element_size());
  }
  return full;
}

at::Tensor read_rows(const ShardedCheckpointFiles& files, const LogicalTensor& t, int64_t first, int64_t rows) {
  if (rows == 0) return at::empty(rows_shape(t.shape, 0), at::TensorOptions().dtype(t.dtype));
  if (t.shape.empty()) return read_full(files, t);
  if (!t.sharded) return read_full(files, t).narrow(0, first, rows).clone();
  at::Tensor out = at::empty(rows_shape(t.shape, rows), at::TensorOptions().dtype(t.dtype));
  int64_t start = 0;  // the piece's first row
  for (int r = 0; r < files.world_size(); ++r) {
    const PtTensorRef& ref = *t.pieces[static_cast<size_t>(r)];
    const int64_t n = ref.sizes[0];
    const int64_t lo = std::max(first, start), hi = std::min(first + rows, start + n);
    if (lo < hi) {
      const at::Tensor piece = files.reader(r).read_tensor(ref);
      out.narrow(0, lo - first, hi - lo).copy_(piece.narrow(0, lo - start, hi - lo));
    }
    start += n;
  }
  return out;
}

}  // namespace tdist::checkpoint
