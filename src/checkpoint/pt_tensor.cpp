// The LibTorch side of .pt files (pt_file.h): tensors in and out of storage
// records. Everything else of the format needs c10 only, so that the
// checkpoint tools run without LibTorch.
#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "checkpoint/checkpoint_tree.h"
#include "formats/pt_file.h"
#include "checkpoint/tensor_tree.h"
#include "tdist/errors.h"

namespace tdist::checkpoint {

void PtWriter::write_storage(const std::string& key, const at::Tensor& tensor) {
  const PtTensorRef* want = next_storage();
  if (!want || want->storage_key != key) begin_storage(key);  // throws the right error
  if (!tensor.defined() || tensor.scalar_type() != want->dtype || tensor.numel() != want->storage_numel ||
      tensor.layout() != at::kStrided) {
    throw UsageError("PtWriter: the tensor for storage '" + key + "' is not a dense " +
                     std::string(c10::toString(want->dtype)) + " tensor of " + std::to_string(want->storage_numel) +
                     " elements");
  }
  const at::Tensor t = tensor.to(at::kCPU).contiguous();
  begin_storage(key);
  append(t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
  end_storage();
}

namespace {

// What makes a view name an element twice ("" when nothing): a stride of 0
// (an expanded tensor) or dimensions that overlap. tensor_ref_problem has
// checked that the view stays inside its storage.
std::string view_overlap_problem(const PtTensorRef& ref) {
  if (ref.sizes.size() != ref.strides.size()) return "sizes and strides differ in length";
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dimensions that repeat
  for (size_t d = 0; d < ref.sizes.size(); ++d) {
    if (ref.sizes[d] < 0 || ref.strides[d] < 0) return "a negative size or stride";
    if (ref.sizes[d] == 0) return "";  // no element: nothing overlaps
    if (ref.sizes[d] > 1) dims.emplace_back(ref.strides[d], ref.sizes[d]);
  }
  std::sort(dims.begin(), dims.end());
  // Each dimension must step past every element the smaller-stride ones
  // reach: then no two indices share an element (and numel <= the span).
  int64_t reach = 0;  // the largest offset the dimensions so far reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) {
      return stride == 0 ? "a dimension of " + std::to_string(size) + " with stride 0 (an expanded view)"
                         : "dimensions whose elements overlap (stride " + std::to_string(stride) + ")";
    }
    int64_t span = 0;
    if (__builtin_mul_overflow(size - 1, stride, &span) || __builtin_add_overflow(reach, span, &reach)) {
      return "a view that overflows";
    }
  }
  return "";
}

// Every check before anything is allocated: the record holds exactly the
// storage (its size checked against the file), the view stays inside it
// and names no element twice, so the tensor is at most the record's size.
void check_view(const PtReader& reader, const PtTensorRef& ref) {
  reader.check_storage(ref);
  const std::string overlap = view_overlap_problem(ref);
  if (!overlap.empty()) {
    throw CheckpointError(reader.path() + ": the tensor of storage '" + ref.storage_key + "' (" +
                          shape_string(ref.sizes) + " over " + std::to_string(ref.storage_numel) +
                          " elements) has " + overlap + ": only views that name each element of their storage once are read");
  }
}

at::Tensor read_whole_storage(const PtReader& reader, const PtTensorRef& ref) {
  at::Tensor storage = at::empty({ref.storage_numel}, at::TensorOptions().dtype(ref.dtype));
  reader.read_storage(ref, storage.data_ptr());
  return storage;
}

bool is_whole(const at::Tensor& view, const PtTensorRef& ref) {
  return view.numel() == ref.storage_numel && view.is_contiguous() && ref.storage_offset == 0;
}

}  // namespace

void PtReader::check_tensor(const PtTensorRef& ref) const { check_view(*this, ref); }

at::Tensor PtReader::read_tensor(const PtTensorRef& ref) const {
  check_view(*this, ref);
  at::Tensor t = read_whole_storage(*this, ref).as_strided(ref.sizes, ref.strides, ref.storage_offset);
  return is_whole(t, ref) ? t : t.clone();
}

at::Tensor TensorReads::operator()(const PtTensorRef& ref) {
  check_view(reader_, ref);
  auto it = storages_.find(ref.storage_key);
  if (it == storages_.end()) it = storages_.emplace(ref.storage_key, read_whole_storage(reader_, ref)).first;
  return it->second.as_strided(ref.sizes, ref.strides, ref.storage_offset);
}

}  // namespace tdist::checkpoint
