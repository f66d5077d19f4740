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

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <type_traits>
#include <utility>

namespace tdist::compat {

// The handle on a leaf's gradient accumulator: std::shared_ptr<Node> in
// 1.13, c10::intrusive_ptr<Node> in 2.x. Either way autograd holds the
// accumulator weakly, so its post hooks fire only while one is kept.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// c10::Allocator::allocate is const before 2.3 and not after, where
// copy_data also became a pure virtual to define.
#if TDIST_TORCH_VERSION_AT_LEAST(2, 3)
#define TDIST_ALLOCATOR_CONST
#define TDIST_ALLOCATOR_HAS_COPY_DATA 1
#else
#define TDIST_ALLOCATOR_CONST const
#define TDIST_ALLOCATOR_HAS_COPY_DATA 0
#endif

// Whether Optimizer::zero_grad() and Module::zero_grad() with no argument
// set gradients to undefined (2.x) rather than to zero (1.13).
inline constexpr bool kZeroGradSetsToNone = TDIST_TORCH_VERSION_AT_LEAST(2, 0);

// Optimizer::zero_grad(set_to_none) on every version: 1.13's takes no
// argument and zeroes.
inline void zero_grad(torch::optim::Optimizer& opt, bool set_to_none) {
#if TDIST_TORCH_VERSION_AT_LEAST(2, 0)
  opt.zero_grad(set_to_none);
#else
  if (!set_to_none) {
    opt.zero_grad();
    return;
  }
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) p.mutable_grad().reset();
  }
#endif
}

// The key of a parameter in Optimizer::state(): the TensorImpl's address
// as a string in 1.13, the address itself in 2.x.
using OptimizerStateKey =
    typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
inline OptimizerStateKey optimizer_state_key(const at::Tensor& p) {
#if TDIST_TORCH_VERSION_AT_LEAST(2, 0)
  return p.unsafeGetTensorImpl();
#else
  return c10::guts::to_string(p.unsafeGetTensorImpl());
#endif
}

// A copy of g, as Generator::clone() makes it (the caller holds g's
// mutex), that is freed when its last holder lets go. LibTorch 1.x's
// GeneratorImpl::clone() hands the copy out without the weak reference
// that an intrusive_ptr's strong references hold together, so the last
// release never deletes it (LeakSanitizer: CPUGeneratorImpl::clone_impl);
// 2.x adds that reference itself.
inline at::Generator clone_generator(const at::Generator& g) {
  at::Generator copy = g.clone();
#if !TDIST_TORCH_VERSION_AT_LEAST(2, 0)
  if (copy.getIntrusivePtr().weak_use_count() == 0) {
    c10::raw::weak_intrusive_ptr::incref(copy.unsafeGetGeneratorImpl());
  }
#endif
  return copy;
}

}  // namespace tdist::compat
