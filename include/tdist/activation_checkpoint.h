// Activation (gradient) checkpointing for any LibTorch module: the forward
// keeps none of the module's intermediate activations; the backward runs
// the forward again (with the random-number state of the first run, so
// dropout draws the same mask) and back-propagates through that.
//
//   auto block = tdist::checkpoint_module(Block(cfg));   // a CheckpointModule<Block>
//   auto y = block(x);                                   // as Block's forward
//   // inside FSDP, as torch_xla's example does:
//   tdist::FSDP<tdist::CheckpointModule<Block>> unit(tdist::checkpoint_module(Block(cfg)), o);
//
// Gradients are those of the plain module, bit for bit: the parameters'
// gradients reach their accumulators in the backward that reaches the
// module (never in a nested one), so DDP's and FSDP's gradient hooks see
// them as usual. Standalone, inside DDP, and inside FSDP units (also units
// nested in the checkpointed module); not around the outermost FSDP
// wrapper (an error says so).
//
// Limits: the checkpoint is skipped (the module runs as it is, keeping its
// activations) when gradients are off or no tensor argument requires a
// gradient, as for the first layer of a model: its parameters still get
// their gradients. Tensor arguments are inputs of the checkpoint (kept for
// the backward); other arguments are copied. The forward returns a tensor,
// a std::vector of tensors or a std::tuple of tensors. No double backward.
// State a forward changes (BatchNorm's running statistics) changes again
// in the re-run, as with PyTorch's checkpoint. The random-number state
// restored is the CPU generator's and those of the inputs' devices.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <ostream>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tdist/wrapped_forward.h"

namespace tdist {

namespace detail {

using CheckpointRun = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

// Whether a forward with these tensor arguments is checkpointed: gradients
// on and one of them requires a gradient.
bool checkpoint_wanted(const std::vector<at::Tensor>& inputs);

// run(inputs) under no_grad, its outputs tied into autograd by one node
// whose backward re-runs run (on detached inputs, the random-number state
// restored) and returns the gradients of the inputs and of params (the
// module's parameters that require grad).
std::vector<at::Tensor> checkpoint_apply(CheckpointRun run, const std::vector<at::Tensor>& inputs,
                                         const std::vector<at::Tensor>& params);

std::vector<at::Tensor> trainable_parameters(torch::nn::Module& m);

// The forward's result as tensors and back.
template <typename R>
struct Outputs {
  static_assert(is_tensor_v<R>,
                "checkpoint_module: the forward must return a tensor, a std::vector or a std::tuple of tensors");
  static std::vector<at::Tensor> flatten(const at::Tensor& t) { return {t}; }
  static at::Tensor unflatten(std::vector<at::Tensor>&& v) { return std::move(v[0]); }
};
template <>
struct Outputs<std::vector<at::Tensor>> {
  static std::vector<at::Tensor> flatten(const std::vector<at::Tensor>& v) { return v; }
  static std::vector<at::Tensor> unflatten(std::vector<at::Tensor>&& v) { return std::move(v); }
};
template <typename... T>
struct Outputs<std::tuple<T...>> {
  static_assert((is_tensor_v<T> && ...), "checkpoint_module: a tuple result must hold tensors only");
  static std::vector<at::Tensor> flatten(const std::tuple<T...>& t) {
    return std::apply([](const auto&... x) { return std::vector<at::Tensor>{x...}; }, t);
  }
  static std::tuple<T...> unflatten(std::vector<at::Tensor>&& v) {
    return unflatten(std::move(v), std::index_sequence_for<T...>{});
  }
  template <size_t... I>
  static std::tuple<T...> unflatten(std::vector<at::Tensor>&& v, std::index_sequence<I...>) {
    return std::tuple<T...>(std::move(v[I])...);
  }
};

template <typename T>
void add_if_tensor(const T& x, std::vector<at::Tensor>& out) {
  if constexpr (is_tensor_v<T>) out.push_back(x);
}
// x, or the next of `tensors` where x is a tensor.
template <typename T>
std::decay_t<T> substitute(const T& x, const std::vector<at::Tensor>& tensors, size_t& next) {
  if constexpr (is_tensor_v<T>) {
    return tensors[next++];
  } else {
    return x;
  }
}

}  // namespace detail

// Everything of a CheckpointModule but its forward.
template <typename ModuleHolder>
class CheckpointModuleBase : public torch::nn::Module, public detail::WrapperModule {
 public:
  explicit CheckpointModuleBase(ModuleHolder module) : module_(std::move(module)) {
    register_module("module", detail::Wrapped<ModuleHolder>::ptr(module_));
  }
  ModuleHolder module() const { return module_; }
  void pretty_print(std::ostream& stream) const override { stream << "tdist::CheckpointModule"; }

 protected:
  template <typename R, typename... Args>
  R run(Args&&... args) {
    std::vector<at::Tensor> inputs;
    (detail::add_if_tensor(args, inputs), ...);
    if (!detail::checkpoint_wanted(inputs)) {
      return detail::Wrapped<ModuleHolder>::call(module_, std::forward<Args>(args)...);
    }
    // The arguments as they were, for the run again in backward.
    auto saved = std::make_tuple(std::decay_t<Args>(args)...);
    ModuleHolder m = module_;
    detail::CheckpointRun again = [m, saved](const std::vector<at::Tensor>& tensors) mutable {
      size_t next = 0;
      auto call = [&](const auto&... a) {
        return detail::Wrapped<ModuleHolder>::call(m, detail::substitute(a, tensors, next)...);
      };
      return detail::Outputs<R>::flatten(std::apply(call, saved));
    };
    return detail::Outputs<R>::unflatten(
        detail::checkpoint_apply(std::move(again), inputs, detail::trainable_parameters(*this)));
  }

 private:
  ModuleHolder module_;
};

template <typename ModuleHolder, typename Signature = typename detail::Wrapped<ModuleHolder>::Signature>
class CheckpointModuleImpl : public CheckpointModuleBase<ModuleHolder> {
  static_assert(!std::is_void_v<Signature>,
                "checkpoint_module: the module's forward must be one non-template member function");
};

template <typename ModuleHolder, typename R, typename... A>
class CheckpointModuleImpl<ModuleHolder, R(A...)> : public CheckpointModuleBase<ModuleHolder> {
 public:
  explicit CheckpointModuleImpl(ModuleHolder module) : CheckpointModuleBase<ModuleHolder>(std::move(module)) {}
  R forward(A... args) { return this->template run<R>(std::forward<A>(args)...); }
};

template <typename ModuleHolder>
class CheckpointModule : public torch::nn::ModuleHolder<CheckpointModuleImpl<ModuleHolder>> {
 public:
  using torch::nn::ModuleHolder<CheckpointModuleImpl<ModuleHolder>>::ModuleHolder;
};

// checkpoint_module(Block(...)), checkpoint_module(any_module).
template <typename ModuleHolder>
CheckpointModule<std::decay_t<ModuleHolder>> checkpoint_module(ModuleHolder&& module) {
  return CheckpointModule<std::decay_t<ModuleHolder>>(std::forward<ModuleHolder>(module));
}

}  // namespace tdist
