// The LibTorch side of .pt files (pt_file.h): tensors in and out of storage
// records. Everything else of the format needs c10 only, so that the
// checkpoint tools run without LibTorch.
#include <ATen/ATen.h>

#include "checkpoint/pt_file.h"
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

at::Tensor PtReader::read_tensor(const PtTensorRef& ref) const {
  check_storage(ref);  // before allocating from its numel
  at::Tensor storage = at::empty({ref.storage_numel}, at::TensorOptions().dtype(ref.dtype));
  read_storage(ref, storage.data_ptr());
  at::Tensor t = storage.as_strided(ref.sizes, ref.strides, ref.storage_offset);
  if (t.numel() != ref.storage_numel || !t.is_contiguous() || ref.storage_offset != 0) t = t.clone();
  return t;
}

}  // namespace tdist::checkpoint
