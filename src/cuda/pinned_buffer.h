// PinnedBuffer: page-locked host memory (cudaHostAlloc), grown on demand
// and kept between calls, for staging device buffers through host memory.
// Not thread safe: one op uses it at a time.
#pragma once

#include <cstddef>

namespace tdist::cuda {

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  // At least `bytes` bytes (nullptr for 0); earlier contents are lost when
  // it grows.
  void* get(size_t bytes);

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace tdist::cuda
