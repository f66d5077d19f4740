// DistributedDataParallel: data-parallel training of any torch::nn::Module.
//
//   auto world = tdist::init_process_group();
//   tdist::DistributedDataParallel<Net> ddp(Net(), tdist::DistributedDataParallelOptions{});
//   auto loss = loss_fn(ddp->forward(x), y);
//   loss.backward();          // gradients are averaged over ranks when this returns
//   optimizer.step();
//
// At construction every rank checks that all ranks hold the same parameters
// (names, shapes, dtypes, order), then parameters and buffers are broadcast
// from rank 0. During backward, gradients are grouped into buckets (reverse
// registration order; the first bucket 1 MiB, then bucket_cap_mb each) and a
// bucket's all-reduce starts as soon as its last gradient is ready, while the
// rest of backward runs. Buckets are launched in index order, the same on
// every rank.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tdist/comm_hooks.h"
#include "tdist/join.h"
#include "tdist/process_group.h"
#include "tdist/wrapped_forward.h"  // detail::WrapperModule

namespace tdist {

struct DistributedDataParallelOptions {
  std::shared_ptr<ProcessGroup> process_group;  // null: the default group
  double bucket_cap_mb = 25;
  double first_bucket_cap_mb = 1;
  bool broadcast_buffers = true;                // broadcast buffers from rank 0 before each forward
  // Parameters that the forward's outputs cannot reach (found by walking the
  // autograd graph after each forward) are reduced as zeros as soon as
  // backward starts; a parameter that no rank used keeps its .grad as it was.
  // Any parameter still without gradient when backward ends is treated the
  // same way (e.g. one reached only from an output that the loss ignored).
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;         // .grad tensors are views into the bucket buffers
  // The set of parameters that take part is the same in every iteration:
  // the first iteration is reduced after its backward and records which
  // parameters no rank used; later ones need no graph walk and no extra
  // all-reduce. Reentrant backward (activation checkpointing) is not supported.
  bool static_graph = false;
  // The device the module trains on, as PyTorch's device_ids=[i]: the
  // module is moved there (module->to) before its parameters are
  // broadcast. Unset: where its parameters are. All of them must be on one
  // device; for CUDA, one device per process. Buckets and comm hooks then
  // work on that device, and every backend serves it (nccl natively,
  // shm/gloo/mpi through pinned host memory).
  std::optional<c10::Device> device_id = std::nullopt;
};

namespace detail {

// The built-in hooks that the reducer runs itself; kNone: a user's hook.
enum class Builtin { kNone, kAllreduce, kFp16, kBf16, kNoop };

// The gradient reducer behind every DistributedDataParallel<M>; not a
// template, so it is compiled once.
class DataParallel {
 public:
  DataParallel(torch::nn::Module& module, DistributedDataParallelOptions options);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Called before each forward: raises a pending error from the previous
  // backward (e.g. parameters that got no gradient) and broadcasts buffers.
  // join: the options of the Join (tdist/join.h) this rank trains in (null:
  // none). In a Join, one more small all_reduce tells the joined ranks
  // whether this iteration's backward synchronises, and every rank which
  // rank's buffers to take (the lowest that still trains).
  void before_forward(const JoinOptions* join = nullptr);
  // The JoinHook of DistributedDataParallel (tdist/join.h).
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options);
  // Where the parameters are (the CPU without any).
  c10::Device device() const;
  // find_unused_parameters: the template hands over the forward's outputs.
  bool wants_outputs() const;
  void after_forward(const std::vector<at::Tensor>& outputs);
  void set_require_sync(bool on);
  bool require_sync() const;
  const std::shared_ptr<ProcessGroup>& process_group() const;
  // Parameter indices (registration order) of each bucket, in launch order.
  std::vector<std::vector<size_t>> bucket_indices() const;
  // Whether the one-time rebuild after the first iteration has happened;
  // set_bucket_indices adopts a layout (one bucket_indices gave, e.g. in a
  // checkpoint) as the rebuilt one, so that a resumed run buckets its
  // gradients as the saved run did. Call it before the first forward, with
  // the same layout on every rank.
  bool buckets_rebuilt() const;
  void set_bucket_indices(const std::vector<std::vector<size_t>>& assignment);
  // set_bucket_indices' check alone (UsageError unless a permutation of the
  // parameters); changes nothing.
  void check_bucket_indices(const std::vector<std::vector<size_t>>& assignment) const;
  // Once per instance, before training; a second call raises UsageError.
  void register_comm_hook(CommHook hook);
  // The (group, hook) form for plain functions. The built-in hooks are
  // recognised and run by the reducer itself, on the gradients in place.
  using BuiltinHookFn = std::shared_ptr<Work> (*)(const std::shared_ptr<ProcessGroup>&, GradBucket&);
  void register_comm_hook(const std::shared_ptr<ProcessGroup>& group, BuiltinHookFn fn);

  struct State;  // private to src/ddp/data_parallel.cpp

 private:
  void check_layout(const std::vector<std::vector<size_t>>& assignment) const;  // REQUIRES state_->mu
  std::shared_ptr<State> state_;
};

// The tensors inside a forward's result: a tensor, or vectors, tuples and
// pairs of them (nested). Other types hold none that DDP can see.
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}
inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
template <typename T>
void collect_tensors(const std::vector<T>& v, std::vector<at::Tensor>& out);
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out);
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out);
template <typename T>
void collect_tensors(const std::vector<T>& v, std::vector<at::Tensor>& out) {
  for (const auto& x : v) collect_tensors(x, out);
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... x) { (collect_tensors(x, out), ...); }, t);
}

// What a DistributedDataParallel<M> is, seen through torch::nn::Module
// (the checkpoint code saves and restores its bucket layout).
class DataParallelModule {
 public:
  virtual ~DataParallelModule() = default;
  virtual DataParallel& data_parallel() = 0;
};

}  // namespace detail

// A WrapperModule: state dicts (tdist/state_dict.h) name parameters as the
// unwrapped model does, without the "module." step.
template <typename ModuleHolder>
class DistributedDataParallelImpl : public torch::nn::Module,
                                    public detail::WrapperModule,
                                    public detail::DataParallelModule,
                                    public Joinable {
 public:
  DistributedDataParallelImpl(ModuleHolder module, DistributedDataParallelOptions options = {})
      : module_(register_module("module", std::move(module))), core_(*module_.ptr(), std::move(options)) {}

  // The wrapped module's own forward, with its own signature.
  template <typename... Args>
  auto forward(Args&&... args) {
    Join::notify_join_context(*this);
    core_.before_forward(active_join());
    auto out = module_->forward(std::forward<Args>(args)...);
    if (core_.wants_outputs()) {
      std::vector<at::Tensor> tensors;
      detail::collect_tensors(out, tensors);
      core_.after_forward(tensors);
    }
    return out;
  }

  ModuleHolder module() const { return module_; }

  // Replaces the all-reduce of each bucket (see tdist/comm_hooks.h). Call
  // once, before training. Either a callable taking GradBucket&, or a state
  // and a hook taking (state, GradBucket&), as with the built-ins:
  //   ddp->register_comm_hook(group, tdist::fp16_compress_hook);
  void register_comm_hook(CommHook hook) { core_.register_comm_hook(std::move(hook)); }
  template <typename State, typename Hook>
  void register_comm_hook(std::shared_ptr<State> state, Hook hook) {
    if constexpr (std::is_same_v<State, ProcessGroup> &&
                  std::is_convertible_v<Hook, detail::DataParallel::BuiltinHookFn>) {
      core_.register_comm_hook(state, static_cast<detail::DataParallel::BuiltinHookFn>(hook));
    } else {
      core_.register_comm_hook(
          [state = std::move(state), hook = std::move(hook)](GradBucket& b) { return hook(state, b); });
    }
  }
  const std::shared_ptr<ProcessGroup>& process_group() const { return core_.process_group(); }
  std::vector<std::vector<size_t>> bucket_indices() const { return core_.bucket_indices(); }
  detail::DataParallel& data_parallel() override { return core_; }

  // Joinable (tdist/join.h): tdist::Join join({ddp.get()}) trains on uneven
  // inputs.
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) override { return core_.join_hook(options); }
  std::shared_ptr<ProcessGroup> join_process_group() override { return core_.process_group(); }
  c10::Device join_device() override { return core_.device(); }

  // Gradient accumulation: a forward run while the guard lives has a
  // backward that only accumulates into .grad locally (decided at forward
  // time, as in PyTorch, wherever the backward runs); the first forward
  // after it has a backward that synchronises everything.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(detail::DataParallel& core) : core_(core), previous_(core.require_sync()) {
      core_.set_require_sync(false);
    }
    ~NoSyncGuard() { core_.set_require_sync(previous_); }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    detail::DataParallel& core_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(core_); }

 private:
  ModuleHolder module_;
  detail::DataParallel core_;
};

// ModuleHolder style: ddp->forward(x), ddp(x), ddp->parameters(), ...
template <typename ModuleHolder>
class DistributedDataParallel : public torch::nn::ModuleHolder<DistributedDataParallelImpl<ModuleHolder>> {
 public:
  using torch::nn::ModuleHolder<DistributedDataParallelImpl<ModuleHolder>>::ModuleHolder;
  // LibTorch's ModuleHolder::operator() cannot see a templated forward.
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

}  // namespace tdist
