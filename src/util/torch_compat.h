// Every difference between the LibTorch versions tdist builds against
// (Debian's 1.13 here and in CI; 2.x from pytorch.org or a wheel, with or
// without CUDA) lives in this header and nowhere else.
#pragma once

#include <torch/version.h>

#define TDIST_TORCH_VERSION_AT_LEAST(major, minor)                 \
  (TORCH_VERSION_MAJOR > (major) ||                                \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !TDIST_TORCH_VERSION_AT_LEAST(1, 13)
#error "tdist needs LibTorch 1.13 or newer"
#endif

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/variable.h>

#include <type_traits>
#include <utility>

namespace tdist::compat {

// The handle on a leaf's gradient accumulator: std::shared_ptr<Node> in
// 1.13, c10::intrusive_ptr<Node> in 2.x. Either way autograd holds the
// accumulator weakly, so its post hooks fire only while one is kept.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

}  // namespace tdist::compat
