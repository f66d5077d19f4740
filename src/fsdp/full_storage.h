// FullStorage: the memory of a unit's full (unsharded) parameters, which
// is given back between uses without the storage object going away.
//
// Why not a fresh tensor per gather: autograd keeps what the forward saved
// for backward (a parameter, or a view such as weight.t()) as tensors over
// the storage the parameter had during the forward. Releasing the memory of
// that same storage object, and allocating it again before the backward,
// keeps every saved view valid without keeping the memory in between
// (what PyTorch's FSDP does with storage resize_).
//
// Owns: one storage on the unit's device and, while allocated, its memory
// (on the CPU a block of the pool in block_pool.h, which takes it back on
// release; on a CUDA device a block of LibTorch's caching allocator, which
// pools its blocks itself).
// Threading: not synchronised; the unit that owns it uses it from the
// training thread only.
// Lifetime: tensors made by tensor_at() share the storage object; reading
// them while released is a bug of the caller (the unit never hands them out
// while released).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <cstdint>

namespace tdist::detail {

class FullStorage {
 public:
  FullStorage(at::ScalarType dtype, int64_t numel, c10::Device device = c10::kCPU);
  FullStorage(const FullStorage&) = delete;
  FullStorage& operator=(const FullStorage&) = delete;

  bool allocated() const { return allocated_; }
  // Gives the storage numel elements of fresh (uninitialised) memory.
  // REQUIRES: !allocated().
  void allocate();
  // Takes t's memory (numel() elements of this dtype, contiguous) as its
  // own, keeping t alive while allocated: e.g. a block of symmetric memory.
  // REQUIRES: !allocated().
  void adopt(const at::Tensor& t);
  // Frees the memory; the storage object stays, with zero bytes.
  void release();
  // A contiguous tensor of `sizes` at `offset` elements into the storage:
  // not an autograd view (set_ on a fresh tensor), so optimizers and
  // set_data accept it. REQUIRES: allocated(), or a size of 0 elements.
  at::Tensor tensor_at(int64_t offset, at::IntArrayRef sizes) const;

  int64_t numel() const { return numel_; }
  at::ScalarType dtype() const { return dtype_; }
  // The dtype of the memory the next allocate() gives (mixed precision
  // gathers in the compute dtype, summon_full_params in the shards').
  // REQUIRES: !allocated().
  void set_dtype(at::ScalarType dtype);
  const c10::StorageImpl* storage_impl() const { return storage_.unsafeGetStorageImpl(); }

 private:
  at::ScalarType dtype_;
  int64_t numel_;
  c10::Device device_;
  c10::Storage storage_;
  bool allocated_ = false;
};

// A contiguous tensor of `sizes` on `storage` at `offset` elements (set_ on
// a fresh tensor: shares the storage object, is no autograd view).
at::Tensor tensor_on(const c10::Storage& storage, at::ScalarType dtype, int64_t offset, at::IntArrayRef sizes);

// A 1-D tensor of `numel` uninitialised elements on `device` whose memory
// comes from (and goes back to) the block pool (block_pool.h) on the CPU,
// LibTorch's caching allocator on a CUDA device.
at::Tensor pooled_empty(at::ScalarType dtype, int64_t numel, c10::Device device = c10::kCPU);

}  // namespace tdist::detail
