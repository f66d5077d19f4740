// FullStorage: allocate and release in place. The contract is in
// full_storage.h.
#include "fsdp/full_storage.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/CPUAllocator.h>

#include "fsdp/block_pool.h"
#include "util/check.h"

namespace tdist::detail {

namespace {

// Memory for FSDP's per-unit buffers: on the CPU a block of the pool
// (block_pool.h); on a CUDA device one of LibTorch's caching allocator,
// which pools its blocks itself.
c10::DataPtr block_on(c10::Device device, size_t nbytes) {
  return device.is_cpu() ? take_block(nbytes) : c10::GetAllocator(device.type())->allocate(nbytes);
}

}  // namespace

at::Tensor tensor_on(const c10::Storage& storage, at::ScalarType dtype, int64_t offset, at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * std::max<int64_t>(sizes[i], 1);
  at::NoGradGuard no_grad;
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype).device(storage.device()));
  t.set_(storage, offset, sizes, strides);
  return t;
}

FullStorage::FullStorage(at::ScalarType dtype, int64_t numel, c10::Device device)
    : dtype_(dtype),
      numel_(numel),
      device_(device),
      storage_(c10::Storage::use_byte_size_t(), 0, c10::GetAllocator(device.type()), /*resizable=*/true) {
  // An empty storage's DataPtr says CPU whatever the allocator: set the device.
  storage_.unsafeGetStorageImpl()->set_data_ptr_noswap(c10::DataPtr(nullptr, device_));
}

void FullStorage::set_dtype(at::ScalarType dtype) {
  TDIST_CHECK(!allocated_);
  dtype_ = dtype;
}

void FullStorage::allocate() {
  TDIST_CHECK(!allocated_);
  const size_t nbytes = static_cast<size_t>(numel_) * c10::elementSize(dtype_);
  auto* impl = storage_.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(block_on(device_, nbytes));
  impl->set_nbytes(nbytes);
  allocated_ = true;
}

void FullStorage::adopt(const at::Tensor& t) {
  TDIST_CHECK(!allocated_);
  TDIST_CHECK(t.is_contiguous() && t.numel() == numel_ && t.scalar_type() == dtype_);
  const size_t nbytes = static_cast<size_t>(numel_) * c10::elementSize(dtype_);
  auto* keep = new at::Tensor(t);
  auto* impl = storage_.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(t.data_ptr(), keep, [](void* p) { delete static_cast<at::Tensor*>(p); },
                                         t.device()));
  impl->set_nbytes(nbytes);
  allocated_ = true;
}

void FullStorage::release() {
  // The block goes back to the pool (block_pool.h) with the old DataPtr.
  auto* impl = storage_.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, device_));
  impl->set_nbytes(static_cast<size_t>(0));
  allocated_ = false;
}

at::Tensor FullStorage::tensor_at(int64_t offset, at::IntArrayRef sizes) const {
  return tensor_on(storage_, dtype_, offset, sizes);
}

at::Tensor pooled_empty(at::ScalarType dtype, int64_t numel, c10::Device device) {
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, block_on(device, nbytes), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return tensor_on(storage, dtype, 0, {numel});
}

}  // namespace tdist::detail
