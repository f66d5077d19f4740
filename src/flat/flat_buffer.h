// FlatBuffer: a list of tensors laid out in one flat buffer, each at an
// offset (elements), with padding where an alignment asks for it, and a
// tensor per entry over its piece. The buffer is allocated in ordinary
// memory or in a process group's symmetric memory.
//
// Owns: the flat tensor and the per-entry tensors (which share its memory).
// Users: DDP's buckets (a bucket's gradients); FSDP's units (a unit's
// gathered parameters, its gradients' reduce-scatter input).
// Threading: immutable after construction; the tensors' values are the
// users' business. Constructing one in symmetric memory is a collective:
// every rank of the group constructs the same layout, in the same order.
// Lifetime: the entry tensors keep the memory alive (kOwn by a deleter
// holding the flat tensor, kAlias by sharing its storage), so they may
// outlive the FlatBuffer.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "tdist/process_group.h"

namespace tdist::detail {

// What the tensor of each entry is.
enum class FlatView {
  // A tensor on the buffer's own storage (Tensor::set_, not an autograd
  // view): optimizers may detach_() and zero_() it, which autograd refuses
  // on views. What gradient_as_bucket_view hands out as .grad.
  kAlias,
  // A tensor with a storage of its own over the buffer's memory, keeping
  // the buffer alive: for a tensor that lives in the buffer without looking
  // like a piece of it.
  kOwn,
};

struct FlatBufferOptions {
  // Non-null: allocate in this group's symmetric memory (a collective; the
  // group falls back to ordinary memory where it has none, see
  // ProcessGroup::empty_symmetric, and in_symmetric_memory() tells).
  ProcessGroup* symmetric_group = nullptr;
  // Every entry starts at a multiple of this many elements (>= 1).
  int64_t align = 1;
  // The total is padded to a multiple of this many elements (>= 1), e.g.
  // the world size, so that a reduce-scatter splits it evenly.
  int64_t pad_to = 1;
  FlatView view = FlatView::kAlias;
};

// Where the entries go: offsets in elements and the padded total.
struct FlatLayout {
  std::vector<int64_t> offsets;
  int64_t total = 0;
};
// Entries of `numels` elements back to back, each offset rounded up to a
// multiple of `align`, the end rounded up to a multiple of `pad_to`.
FlatLayout flat_layout(const std::vector<int64_t>& numels, int64_t align = 1, int64_t pad_to = 1);

class FlatBuffer {
 public:
  FlatBuffer() = default;
  // One entry per shape; the buffer is zero-filled, of `options`' dtype and
  // device (symmetric memory is on the CPU). REQUIRES: align, pad_to >= 1.
  FlatBuffer(const std::vector<at::IntArrayRef>& shapes, const at::TensorOptions& options,
             const FlatBufferOptions& o = {});

  // The whole buffer, padding included: 1-D, contiguous.
  const at::Tensor& flat() const { return flat_; }
  size_t size() const { return views_.size(); }
  // Entry k's tensor, shaped as given, over flat() at offset(k).
  const at::Tensor& view(size_t k) const { return views_[k]; }
  const std::vector<at::Tensor>& views() const { return views_; }
  int64_t offset(size_t k) const { return layout_.offsets[k]; }
  // Whether flat() lies in the group's symmetric memory (false without one).
  bool in_symmetric_memory() const { return symmetric_; }

 private:
  FlatLayout layout_;
  at::Tensor flat_;
  std::vector<at::Tensor> views_;
  bool symmetric_ = false;
};

}  // namespace tdist::detail
