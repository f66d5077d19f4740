// Auto wrapping for FullyShardedDataParallel: the policies users know from
// torch_xla and PyTorch, and wrap() for building units while the model is
// constructed.
//
//   tdist::FullyShardedDataParallelOptions o;
//   o.auto_wrap_policy = tdist::transformer_auto_wrap_policy<Block>();
//   tdist::FSDP<ViT> model(ViT(cfg), o);   // every Block a unit, the rest the root's
//   std::cout << *model;                    // shows the units
//
// What can be wrapped: LibTorch calls a module's forward directly (it is
// not virtual), so a wrapper can take over only calls that go through a
// type-erased slot: the entries of a torch::nn::Sequential. A module the
// policy picks anywhere else (a typed member, a ModuleList entry) is
// refused with a UsageError naming it; it is never left unsharded. An
// auto-wrapped entry takes one tensor and returns one (what an AnyModule
// entry shows of its signature); wrap modules with other signatures by
// hand (tdist::FSDP<Block>) or with wrap() below.
#pragma once

#include <torch/nn/modules/container/any.h>

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>

#include "tdist/fsdp.h"

namespace tdist {

// Wraps a module when its not-yet-wrapped parameters number at least
// min_num_params (torch_xla's default: 1e8), looking inside modules as long
// as that holds; never wraps a container (Sequential, ModuleList,
// ModuleDict) and never looks inside a MultiheadAttention.
AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params = 100000000);

// Wraps every module of the given classes (module classes or their
// holders: transformer_auto_wrap_policy<Block>() or <BlockImpl>()).
template <typename... Layers>
AutoWrapPolicy transformer_auto_wrap_policy();

// The same, with classes named as Module::name() says ("BlockImpl",
// "torch::nn::Conv2dImpl"): for names read from a command line.
AutoWrapPolicy transformer_auto_wrap_policy(std::set<std::string> layer_names);

// Wraps the modules for which fn returns true.
AutoWrapPolicy lambda_auto_wrap_policy(std::function<bool(torch::nn::Module&)> fn);

// Wraps `module` as auto wrapping would (options.auto_wrapper_callable, or
// FullyShardedDataParallel), for a torch::nn::Sequential entry: to build
// units while the model is constructed, so that the whole model never
// exists unsharded:
//   for (int i = 0; i < depth; ++i) blocks->push_back(tdist::wrap(Block(cfg), o));
template <typename ModuleHolder>
torch::nn::AnyModule wrap(ModuleHolder module, const FullyShardedDataParallelOptions& options);

namespace detail {

template <typename T, typename = void>
struct ImplOf {
  using type = T;
};
template <typename T>
struct ImplOf<T, std::void_t<typename T::ContainedType>> {
  using type = typename T::ContainedType;
};

// The options auto wrapping gives the wrappers it makes: no policy.
FullyShardedDataParallelOptions child_options(const FullyShardedDataParallelOptions& options);

}  // namespace detail

template <typename... Layers>
AutoWrapPolicy transformer_auto_wrap_policy() {
  return [](torch::nn::Module& m, bool recurse, int64_t) {
    if (recurse) return true;
    return (... || (dynamic_cast<typename detail::ImplOf<Layers>::type*>(&m) != nullptr));
  };
}

template <typename ModuleHolder>
torch::nn::AnyModule wrap(ModuleHolder module, const FullyShardedDataParallelOptions& options) {
  const FullyShardedDataParallelOptions o = detail::child_options(options);
  if (options.auto_wrapper_callable) return options.auto_wrapper_callable(torch::nn::AnyModule(std::move(module)), o);
  return torch::nn::AnyModule(FullyShardedDataParallel<ModuleHolder>(std::move(module), o));
}

}  // namespace tdist
