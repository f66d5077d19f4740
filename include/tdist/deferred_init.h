// Deferred initialization: build a module without memory for its tensors,
// make them real later, one piece at a time, with the values an ordinary
// construction would have given them.
//
//   torch::manual_seed(0);
//   auto net = tdist::deferred_init([&] { return Net(cfg); });  // no memory: every tensor on the meta device
//   tdist::materialize_module(*net);                             // now as Net(cfg) would have been, bit for bit
//
// Inside deferred_init every tensor the function makes is a meta tensor
// (shape, dtype and strides, no data), and every operation on them is
// recorded: the factories, the layers' reset() (kaiming_uniform_, normal_,
// ...), a constructor's own init, views and copies. Materializing a tensor
// replays what made it, on the device it was made for, then gives the
// tensor (the same object: a module's members, its parameter list and an
// optimizer see the change) those values. A random operation keeps a copy
// of the generator as it stood when the operation ran (deferred_init also
// advances the generator as the real operation would have), so the order
// in which tensors are materialized changes nothing, and after
// deferred_init the default generator stands where an ordinary
// construction would have left it.
//
// FullyShardedDataParallel materializes a deferred model one unit at a
// time (docs/fsdp.md); the loaders fill a deferred model's tensors straight
// from their files.
//
// Limits. The function runs without gradient recording (as NoGradGuard:
// a constructor's tensor work needs none). It cannot read a value (item(),
// an if on a tensor's contents): that is an error naming the operation.
// Tensors made on other threads are not deferred. A tensor's construction
// that reads another tensor which was materialized before (e.g. one
// parameter initialized as a copy of another, materialized separately) is
// refused: materialize them together.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <optional>
#include <type_traits>
#include <utility>

namespace tdist {

namespace detail {
// While it lives, tensors made on this thread are deferred (nested scopes
// record into the outermost one's record).
class DeferredInitScope {
 public:
  DeferredInitScope();
  ~DeferredInitScope();
  DeferredInitScope(const DeferredInitScope&) = delete;
  DeferredInitScope& operator=(const DeferredInitScope&) = delete;

 private:
  bool outermost_;
  bool grad_before_ = c10::GradMode::is_enabled();
  c10::AutoGradMode no_grad_{false};  // construction records no autograd graph
};
}  // namespace detail

// Calls fn() with every tensor it makes deferred, and returns what fn
// returns (a module holder, a shared_ptr, a tensor, ...).
template <typename Fn>
auto deferred_init(Fn&& fn) -> std::invoke_result_t<Fn> {
  detail::DeferredInitScope scope;
  return std::forward<Fn>(fn)();
}

// Whether t is a tensor deferred_init made and nothing has materialized.
bool is_deferred(const at::Tensor& t);
// Whether any parameter or buffer of m (and its submodules) is deferred.
bool is_deferred(const torch::nn::Module& m);

// Makes t real, with the values its construction gave it, on `device`
// (unset: the device it was made for; else it is made there and moved).
// A tensor that is not deferred is left as it is.
void materialize_tensor(const at::Tensor& t, std::optional<c10::Device> device = std::nullopt);

// Every deferred parameter and buffer of m and its submodules, together.
void materialize_module(torch::nn::Module& m, std::optional<c10::Device> device = std::nullopt);

// Every deferred parameter and buffer of m and its submodules becomes real
// on `device` with its elements unset (PyTorch's Module.to_empty), for an
// init of one's own or a load that sets every element.
void to_empty(torch::nn::Module& m, c10::Device device);

}  // namespace tdist
