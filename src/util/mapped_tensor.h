// A CPU tensor whose memory is mapped for it alone (mmap) and unmapped
// when its storage dies, outside malloc's heap.
//
// Why: glibc serves a large block from free space in its heap when it has
// some, and maps a fresh one (a page fault per 4 KiB on first touch)
// when it has none. A long-lived buffer taken from the heap (an
// asynchronous save's host copies, kept from one save to the next) uses
// up that free space, and every later large temporary of training (a
// Linear's weight gradient, each backward) is then mapped and faulted
// afresh: measured on the Intel Xeon VM, ~90,000 faults and a third of a
// core in the kernel per step of `tdist-bench checkpoint --size-mib 1024`
// while a save was being written. Freed through malloc instead, a block of
// this size also stays in the process (glibc raises its mmap threshold
// after the first free), which deferred_init's scratch tensors must not.
// The memory reads as zeros until written.
#pragma once

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <vector>

namespace tdist::detail {

// sizes and strides as at::empty_strided's (strides empty: contiguous);
// `options` names the dtype (the device is the CPU; pinning, which a
// mapping of this kind cannot give, is the caller's to ask of at::empty).
// Throws std::invalid_argument for strides that do not fit the sizes,
// std::bad_alloc when the bytes overflow or cannot be mapped.
inline at::Tensor mapped_cpu_tensor(at::IntArrayRef sizes, at::IntArrayRef strides, const at::TensorOptions& options) {
  std::vector<int64_t> contiguous;
  if (strides.empty()) {
    contiguous.resize(sizes.size());
    for (size_t d = sizes.size(), step = 1; d-- > 0;) {
      contiguous[d] = static_cast<int64_t>(step);
      if (__builtin_mul_overflow(step, static_cast<size_t>(std::max<int64_t>(sizes[d], 1)), &step) ||
          step > static_cast<size_t>(INT64_MAX)) {
        throw std::bad_alloc();
      }
    }
    strides = contiguous;
  }
  if (strides.size() != sizes.size()) throw std::invalid_argument("mapped_cpu_tensor: strides do not fit the sizes");
  bool empty = false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] < 0 || strides[d] < 0) throw std::invalid_argument("mapped_cpu_tensor: a negative size or stride");
    empty = empty || sizes[d] == 0;
  }
  const auto cpu = options.device(at::kCPU).pinned_memory(false);
  if (empty) return at::empty_strided(sizes, strides, cpu);
  // The last element's offset + 1, in elements, then bytes: checked.
  size_t span = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    size_t reach = 0;
    if (__builtin_mul_overflow(static_cast<size_t>(sizes[d] - 1), static_cast<size_t>(strides[d]), &reach) ||
        __builtin_add_overflow(span, reach, &span)) {
      throw std::bad_alloc();
    }
  }
  size_t bytes = 0;
  if (__builtin_mul_overflow(span, options.dtype().itemsize(), &bytes)) throw std::bad_alloc();
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  try {
    return at::from_blob(p, sizes, strides, [bytes](void* q) { ::munmap(q, bytes); }, cpu);
  } catch (...) {
    ::munmap(p, bytes);
    throw;
  }
}

}  // namespace tdist::detail
