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
#include <vector>

namespace tdist::detail {

// sizes and strides as at::empty_strided's (strides empty: contiguous);
// `options` names the dtype (its device must be the CPU, or is ignored).
inline at::Tensor mapped_cpu_tensor(at::IntArrayRef sizes, at::IntArrayRef strides, const at::TensorOptions& options) {
  std::vector<int64_t> contiguous(sizes.size());
  for (size_t d = sizes.size(), step = 1; d-- > 0;) {
    contiguous[d] = static_cast<int64_t>(step);
    step *= static_cast<size_t>(std::max<int64_t>(sizes[d], 1));
  }
  if (strides.empty()) strides = contiguous;
  size_t span = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) span = 0;
  }
  if (span != 0) {
    for (size_t d = 0; d < sizes.size(); ++d) span += static_cast<size_t>(sizes[d] - 1) * static_cast<size_t>(strides[d]);
  }
  const size_t bytes = span * options.dtype().itemsize();
  const auto cpu = options.device(at::kCPU);
  if (bytes == 0) return at::empty_strided(sizes, strides, cpu);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return at::from_blob(p, sizes, strides, [bytes](void* q) { ::munmap(q, bytes); }, cpu);
}

}  // namespace tdist::detail
