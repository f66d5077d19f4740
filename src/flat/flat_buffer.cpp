// FlatBuffer: layout arithmetic, allocation and the entry tensors. The
// contract (ownership, threading, lifetime) is in flat_buffer.h.
#include "flat/flat_buffer.h"

#include <ATen/ATen.h>

#include "util/check.h"

namespace tdist::detail {

namespace {

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// A tensor over flat's storage at `offset` elements, shaped `sizes`. Not an
// autograd view: optimizers may detach_() and zero_() it (LibTorch's
// zero_grad does), which autograd refuses on views.
at::Tensor alias_of(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, strides);
  return t;
}

// A tensor of its own (its own storage object, not a view) over flat's
// memory at `offset` elements, keeping flat alive: a gradient that lives in
// bucket memory without gradient_as_bucket_view.
at::Tensor own_tensor_in(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  void* data = static_cast<uint8_t*>(flat.data_ptr()) + offset * flat.element_size();
  return at::from_blob(data, sizes, [keep = flat](void*) mutable { keep.reset(); }, flat.options());
}

}  // namespace

FlatLayout flat_layout(const std::vector<int64_t>& numels, int64_t align, int64_t pad_to) {
  TDIST_CHECK_GE(align, 1);
  TDIST_CHECK_GE(pad_to, 1);
  FlatLayout layout;
  int64_t end = 0;
  for (int64_t n : numels) {
    const int64_t offset = round_up(end, align);
    layout.offsets.push_back(offset);
    end = offset + n;
  }
  layout.total = round_up(end, pad_to);
  return layout;
}

FlatBuffer::FlatBuffer(const std::vector<at::IntArrayRef>& shapes, const at::TensorOptions& options,
                       const FlatBufferOptions& o) {
  std::vector<int64_t> numels;
  for (const auto& shape : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    numels.push_back(n);
  }
  layout_ = flat_layout(numels, o.align, o.pad_to);
  flat_ = o.symmetric_group ? o.symmetric_group->empty_symmetric({layout_.total}, options.dtype().toScalarType())
                            : at::zeros({layout_.total}, options);
  symmetric_ = o.symmetric_group && o.symmetric_group->is_symmetric(flat_);
  views_.reserve(shapes.size());
  for (size_t k = 0; k < shapes.size(); ++k) {
    views_.push_back(o.view == FlatView::kAlias ? alias_of(flat_, layout_.offsets[k], shapes[k])
                                                : own_tensor_in(flat_, layout_.offsets[k], shapes[k]));
  }
}

}  // namespace tdist::detail
