// What tdist's module wrappers (FullyShardedDataParallel, CheckpointModule)
// need to know about the module they wrap: how to call it, and the
// signature of its forward, so that a wrapper can offer exactly that
// signature. A wrapper with a plain (non-template) forward fits where
// LibTorch erases module types: torch::nn::AnyModule and the entries of a
// torch::nn::Sequential, which auto_wrap_policy replaces.
//
// The wrapped module is a module holder (torch::nn::Linear, a TORCH_MODULE)
// or a torch::nn::AnyModule. A holder's forward signature is known when its
// forward is one non-template member function; otherwise the wrapper's
// forward is a template (it still wraps and calls, but cannot itself go into
// an AnyModule). An AnyModule's signature cannot be seen: its wrappers take
// one tensor and return one, as the entries of a Sequential of layers do.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace tdist::detail {

// A tdist wrapper module: its child "module" is the module it wraps. The
// names of parameters as in the unwrapped model leave those steps out.
class WrapperModule {
 public:
  virtual ~WrapperModule() = default;
};

template <typename T>
constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, at::Tensor>;

// ForwardSignature<M>::type: R(A...) for M::forward, or void when unknown.
template <typename P>
struct MemberSignature {
  using type = void;
};
template <typename R, typename C, typename... A>
struct MemberSignature<R (C::*)(A...)> {
  using type = R(A...);
};
template <typename R, typename C, typename... A>
struct MemberSignature<R (C::*)(A...) const> {
  using type = R(A...);
};

template <typename M, typename = void>
struct ForwardSignature {
  using type = void;
};
template <typename M>
struct ForwardSignature<M, std::void_t<decltype(&M::forward)>> {
  using type = typename MemberSignature<decltype(&M::forward)>::type;
};

// The wrapped module: a holder (H::ContainedType is the module class).
template <typename H>
struct Wrapped {
  using Signature = typename ForwardSignature<typename H::ContainedType>::type;
  static std::shared_ptr<torch::nn::Module> ptr(const H& h) { return h.ptr(); }
  template <typename... A>
  static decltype(auto) call(H& h, A&&... a) {
    return h->forward(std::forward<A>(a)...);
  }
};

// The wrapped module: an AnyModule (a tensor in, a tensor out).
template <>
struct Wrapped<torch::nn::AnyModule> {
  using Signature = at::Tensor(at::Tensor);
  static std::shared_ptr<torch::nn::Module> ptr(const torch::nn::AnyModule& h) { return h.ptr(); }
  template <typename... A>
  static at::Tensor call(torch::nn::AnyModule& h, A&&... a) {
    return h.forward<at::Tensor>(std::forward<A>(a)...);
  }
};

}  // namespace tdist::detail
