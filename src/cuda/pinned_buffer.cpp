// PinnedBuffer: growth and release. The contract is in pinned_buffer.h.
#include "cuda/pinned_buffer.h"

#include "cuda/cuda_check.h"

namespace tdist::cuda {

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);  // may fail at exit, when the driver is gone: nothing to do then
}

void* PinnedBuffer::get(size_t bytes) {
  if (bytes == 0) return nullptr;
  if (bytes <= capacity_) return data_;
  size_t want = capacity_ == 0 ? (size_t{1} << 20) : capacity_;
  while (want < bytes) want *= 2;
  if (data_ != nullptr) {
    // A copy queued from the old buffer may still be pending. Growing is
    // rare (the sizes of a training loop repeat), so a full wait is fine.
    check(cudaDeviceSynchronize(), "waiting for the device before growing the staging memory");
    cudaFreeHost(data_);
  }
  data_ = nullptr;
  capacity_ = 0;
  check(cudaHostAlloc(&data_, want, cudaHostAllocPortable), "allocating " + std::to_string(want) +
                                                                 " bytes of pinned host memory for staging");
  capacity_ = want;
  return data_;
}

}  // namespace tdist::cuda
