// FullyShardedDataParallel: each rank keeps 1/N of the parameters,
// gradients and optimizer state (ZeRO-3, or ZeRO-2 with SHARD_GRAD_OP).
//
//   tdist::init_process_group();
//   tdist::FullyShardedDataParallelOptions o;
//   // Inner units first (inside the model's constructor, or as here)...
//   struct NetImpl : torch::nn::Module {
//     NetImpl(const tdist::FullyShardedDataParallelOptions& o)
//         : block1(register_module("block1", tdist::FSDP<Block>(Block(), o))), ... {}
//     ...
//   };
//   // ...then the rest with an outer wrapper.
//   tdist::FSDP<Net> model(Net(o), o);
//   torch::optim::Adam opt(model->parameters(), 1e-3);  // the local shards
//   auto loss = loss_fn(model(x), y);
//   loss.backward();                 // gradients reduce-scattered into the shards' .grad
//   model->clip_grad_norm_(1.0);
//   opt.step();
//
// A wrapper owns one unit: the parameters of its module that no inner
// wrapper owns. Between iterations every such parameter is this rank's
// shard of it: its rows [r * ceil(rows / N), ...) along dim 0 (possibly
// none), so parameters(), named_parameters() and the optimizer see shards
// under their original names. The wrapper's forward all-gathers its unit's
// full parameters, runs the wrapped forward and, under FULL_SHARD, frees
// them again; backward gathers them once more (prefetching the next unit)
// and, as soon as a unit's gradients are complete, reduce-scatters them
// (averaged over ranks) into the shards' .grad. Parameters and buffers are
// broadcast from rank 0 at construction.
//
// Limits: a unit's parameters on one device (the CPU, or the CUDA device of
// `device_id`); forward and backward on one thread; every rank
// runs the same units in the same order (a unit skipped on one rank only is
// a CollectiveMismatchError or a timeout, never a silent wrong result);
// convert or load the module before wrapping it (or build it with
// tdist::deferred_init: each unit is then made where it trains, one at a
// time, see param_init_fn).
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <ostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tdist/ddp.h"  // detail::collect_tensors
#include "tdist/device_mesh.h"
#include "tdist/join.h"
#include "tdist/process_group.h"
#include "tdist/shard_metadata.h"
#include "tdist/wrapped_forward.h"

namespace tdist {

enum class ShardingStrategy {
  FULL_SHARD,     // ZeRO-3: parameters, gradients and optimizer state sharded
  SHARD_GRAD_OP,  // ZeRO-2: full parameters kept from forward to the end of backward
  NO_SHARD,       // every rank keeps everything; gradients all-reduced (DDP)
  // Hybrid sharding (HSDP): FULL_SHARD within a group of ranks (a node),
  // replicated across the groups. Gathers stay inside the group; gradients
  // are reduce-scattered inside it, then all-reduced across the groups (a
  // shard's worth of bytes per rank leaves the node, not the model's). The
  // groups come from device_mesh (2-D: dimension 0 replicates, 1 shards),
  // from sharding_groups, or else from LOCAL_WORLD_SIZE (one group per node).
  HYBRID_SHARD,
  HYBRID_SHARD_ZERO2,  // the same with SHARD_GRAD_OP inside the group (PyTorch's _HYBRID_SHARD_ZERO2)
};

enum class BackwardPrefetch {
  NONE,          // gather each unit when its backward starts
  BACKWARD_PRE,  // when a unit's backward starts, start gathering the next one
};

struct FullyShardedDataParallelOptions;

// FSDP2's reshard_after_forward, a bool or an int. true: free the full
// parameters after a unit's forward and gather them again over the shard
// group for its backward. false: keep them until the backward. An int k
// (ZeRO++'s hpZ): after forward keep 1/k of the full parameters, in the
// compute dtype, on each rank of a block of k consecutive ranks of the
// shard group, and gather the unit for its backward within that block
// only (e.g. within a node). k must divide the shard group's size; k equal
// to it is true, k = 1 is false.
struct ReshardAfterForward {
  ReshardAfterForward(bool on) : ranks(on ? 0 : 1) {}  // NOLINT: implicit, as Python's bool
  ReshardAfterForward(int k) : ranks(k) {}             // NOLINT: implicit, as Python's int
  // 0: the whole shard group (true); 1: no reshard (false); else k.
  int ranks = 0;
};

// Mixed precision, as PyTorch's FSDP names it. The shards (what the
// optimizer steps) keep the parameters' dtype; a unit's forward and
// backward compute with full parameters gathered in param_dtype (half the
// bytes of fp32 to move and to hold for bf16/fp16), and its gradients are
// reduce-scattered in reduce_dtype before they land, in the shards' dtype,
// in the shards' .grad.
struct MixedPrecision {
  std::optional<at::ScalarType> param_dtype;   // unset: the parameters' own
  std::optional<at::ScalarType> reduce_dtype;  // unset: param_dtype
  // Buffers (BatchNorm's running statistics) are converted to it at
  // wrapping; unset: they keep their dtype (fp32), which is what BatchNorm
  // wants (pytorch/pytorch#75478, #143900).
  std::optional<at::ScalarType> buffer_dtype;
  // The wrapper converts the floating-point tensor arguments of its forward
  // to param_dtype (the root's inputs come in fp32).
  bool cast_forward_inputs = true;
};

// Which modules auto_wrap_policy wraps (tdist/fsdp_wrap.h has the usual
// ones). Asked twice per module, children first: with recurse = true,
// "look inside this module?"; with recurse = false, after its children
// were visited, "wrap this module?". nonwrapped_numel: the parameters of
// the module that no wrapper (made before, or just now for a child) owns.
using AutoWrapPolicy = std::function<bool(torch::nn::Module& module, bool recurse, int64_t nonwrapped_numel)>;
// Makes the wrapper of a module the policy picked (the module, an entry of
// a torch::nn::Sequential, comes as the entry's AnyModule), e.g. to add
// activation checkpointing:
//   o.auto_wrapper_callable = [](torch::nn::AnyModule m, const tdist::FullyShardedDataParallelOptions& o) {
//     return torch::nn::AnyModule(tdist::FullyShardedDataParallel(tdist::checkpoint_module(std::move(m)), o));
//   };
using AutoWrapperCallable =
    std::function<torch::nn::AnyModule(torch::nn::AnyModule module, const FullyShardedDataParallelOptions& options)>;

struct FullyShardedDataParallelOptions {
  std::shared_ptr<ProcessGroup> process_group;  // null: the default group
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  // The ranks as a mesh (tdist/device_mesh.h), as PyTorch's device_mesh:
  // 1-D, its group is the process group; 2-D, hybrid sharding over it
  // (dimension 0 replicates, dimension 1 shards; FULL_SHARD and
  // SHARD_GRAD_OP then mean HYBRID_SHARD and HYBRID_SHARD_ZERO2, as
  // fully_shard does with a 2-D mesh). Give the same mesh to every wrapper
  // of a model: its groups are made once.
  std::shared_ptr<DeviceMesh> device_mesh;
  // torch_xla's form of hybrid sharding: the groups of ranks (of
  // process_group) that shard together, equal in size, each rank in one;
  // ranks at the same place in every group replicate. Made into a
  // device_mesh at construction, which the wrappers auto_wrap_policy makes
  // share.
  std::vector<std::vector<int>> sharding_groups;
  // Free the full parameters after the unit's forward (and gather them again
  // for its backward), or keep a 1/k share of them within blocks of k
  // ranks (ReshardAfterForward above). Unset: true for FULL_SHARD, false
  // otherwise. The outermost wrapper keeps its own until the end of
  // backward either way (its backward comes first), and forwards without
  // gradient (NoGradGuard) or in eval mode always free them all.
  std::optional<ReshardAfterForward> reshard_after_forward;
  // Broadcast rank 0's parameters and buffers at construction. Off: every
  // rank must have built the same values itself (same seed).
  bool sync_module_states = true;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
  // Start gathering the next unit (in the last iteration's forward order)
  // when a unit's forward starts. At most one unit is ever gathered ahead,
  // in forward and in backward, so the memory of prefetching is bounded by
  // one unit's full parameters (what limit_all_gathers buys in PyTorch).
  bool forward_prefetch = false;
  // Mixed precision (above). torch_xla's names map onto it: compute_dtype
  // is param_dtype, fp32_reduce_scatter makes reduce_dtype fp32 (else it is
  // compute_dtype), buffer_dtype is buffer_dtype. Give one form or the
  // other.
  MixedPrecision mixed_precision;
  std::optional<at::ScalarType> compute_dtype;
  std::optional<at::ScalarType> buffer_dtype;
  bool fp32_reduce_scatter = false;
  // Wrap the module's children in units of their own, as the policy picks
  // them (tdist/fsdp_wrap.h), before the wrapper takes what is left. Only
  // children called through a type-erased slot can be wrapped: the entries
  // of a torch::nn::Sequential. A picked module that is anything else (a
  // typed member, a ModuleList entry) is refused with an error naming it.
  // The children's wrappers get these options without the policy.
  AutoWrapPolicy auto_wrap_policy;
  // Makes the children's wrappers; empty: FullyShardedDataParallel itself.
  AutoWrapperCallable auto_wrapper_callable;
  // The device the module trains on, as PyTorch's FSDP device_id: each
  // unit's parameters and buffers are moved there as the unit is made (one
  // unit at a time, never the whole model at once). Unset: where its
  // parameters are. A unit's parameters must be on one device; shards,
  // full parameters and gradients live there, and every backend serves it
  // (nccl natively, shm/gloo/mpi through pinned host memory).
  std::optional<c10::Device> device_id = std::nullopt;
  // A model built with tdist::deferred_init (tdist/deferred_init.h) is
  // made real one unit at a time as its wrappers are built: each unit's
  // parameters and buffers full on the unit's device (device_id, else the
  // CPU), initialized, sharded, the full copy freed before the next unit.
  // By default they are initialized as the model's constructor did (its
  // layers' reset(), its own init: bit for bit the eager values with the
  // same seed). param_init_fn, FSDP1's name, replaces that: the unit's
  // tensors are made real with their elements unset and it is called on
  // each module that holds one of them (not on inner units' modules), in
  // model order; it must set every element, e.g.
  //   o.param_init_fn = [](torch::nn::Module& m) {
  //     torch::NoGradGuard g;
  //     for (auto& p : m.parameters(false)) p.normal_(0.0, 0.02);
  //   };
  std::function<void(torch::nn::Module&)> param_init_fn;
  // For a deferred model whose weights come from files (fine-tuning,
  // resuming): its parameters are made real with no initialization at all
  // (its buffers as its constructor made them), so that a loader's values
  // (load_pretrained, load_full_state_dict, load_sharded_checkpoint, a
  // Checkpointer's restore) are the first its shards hold. Until a loader
  // has written a parameter, a forward, summon_full_params or a full
  // state dict of its unit is a UsageError naming it (every rank alike).
  // A write counts when it goes through the module's tensor (copy_,
  // fill_, an optimizer's step), not through .data(). With
  // sync_module_states, rank 0's broadcast values are the load. Not with
  // param_init_fn; nothing to skip in a model built eagerly.
  bool skip_init = false;
};

namespace detail {

struct FsdpState;  // src/fsdp/fsdp_state.h

// The machinery behind every FullyShardedDataParallel<M>; not a template.
class FullyShardedCore {
 public:
  FullyShardedCore(torch::nn::Module& module, FullyShardedDataParallelOptions options);
  ~FullyShardedCore();
  FullyShardedCore(const FullyShardedCore&) = delete;
  FullyShardedCore& operator=(const FullyShardedCore&) = delete;

  // Around the wrapped forward: begin() gathers the unit, end(outputs)
  // frees it (as the strategy says) and hooks its backward; abort() when
  // the forward threw.
  void begin_forward();
  void end_forward(const std::vector<at::Tensor>& outputs, bool training);
  void abort_forward() noexcept;

  const std::shared_ptr<ProcessGroup>& process_group() const;
  // Every rank of the wrapper (the shard group and, under hybrid sharding,
  // its replicas).
  const std::shared_ptr<ProcessGroup>& world_process_group() const;
  const FullyShardedDataParallelOptions& options() const;
  // A floating-point argument of the forward in the compute dtype (as is
  // without mixed precision).
  at::Tensor cast_input(const at::Tensor& t) const;
  // "FullyShardedDataParallel(FULL_SHARD, 1234 parameters, this rank 617)".
  void pretty_print(std::ostream& stream) const;
  const std::shared_ptr<FsdpState>& state() const { return state_; }

 private:
  std::shared_ptr<FsdpState> state_;
};

// The non-template side of every wrapper, so that an outer wrapper finds
// the inner ones in its module tree.
class FullyShardedModule : public WrapperModule {
 public:
  virtual FullyShardedCore& fsdp_core() = 0;
};

// Operations over every wrapper in `root`'s tree (root included).
double clip_grad_norm(torch::nn::Module& root, double max_norm, double norm_type);
void set_require_sync(torch::nn::Module& root, bool on);
bool require_sync(torch::nn::Module& root);
// FSDP2's controls, on root's wrapper or (recurse) every wrapper in its tree.
void set_requires_gradient_sync(torch::nn::Module& root, bool on, bool recurse);
void set_reshard_after_backward(torch::nn::Module& root, bool on, bool recurse);
void set_modules_to_prefetch(torch::nn::Module& root, const std::vector<std::shared_ptr<FullyShardedModule>>& modules,
                             bool forward);
// Every unit of root's tree sharded, nothing in flight.
void reshard_units(torch::nn::Module& root);
// The JoinHook of root's tree (tdist/join.h): its main hook runs step with
// every unit's gradients reduced as zeros.
std::unique_ptr<JoinHook> fsdp_join_hook(torch::nn::Module& root, std::function<void()> step,
                                         const JoinOptions& options);
ShardMetadata shard_metadata(torch::nn::Module& root);
// Gathers every unit's full parameters; end_summon() frees them again,
// after copying this rank's rows back into the shards when writeback.
void begin_summon(torch::nn::Module& root, bool writeback);
void end_summon(torch::nn::Module& root, bool writeback) noexcept;

}  // namespace detail

// Everything of a wrapper but its forward (FullyShardedDataParallelImpl
// below adds the forward with the wrapped module's own signature).
template <typename ModuleHolder>
class FullyShardedBase : public torch::nn::Module, public detail::FullyShardedModule, public Joinable {
 public:
  FullyShardedBase(ModuleHolder module, FullyShardedDataParallelOptions options)
      : module_(std::move(module)),
        core_(*register_module("module", detail::Wrapped<ModuleHolder>::ptr(module_)), std::move(options)) {}

  ModuleHolder module() const { return module_; }
  const std::shared_ptr<ProcessGroup>& process_group() const { return core_.process_group(); }
  detail::FullyShardedCore& fsdp_core() override { return core_; }
  void pretty_print(std::ostream& stream) const override { core_.pretty_print(stream); }

  // Scales the gradients of every unit in this wrapper's tree so that their
  // global norm (over all ranks' shards, as if the model were whole) is at
  // most max_norm; returns the norm before scaling. norm_type: 2, 1, or
  // infinity. Collective: call it on every rank.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0) {
    return detail::clip_grad_norm(*this, max_norm, norm_type);
  }

  // The wrappers in this tree: names, shapes and this rank's rows.
  ShardMetadata get_shard_metadata() { return detail::shard_metadata(*this); }

  // ---- FSDP2's controls (PyTorch's FSDPModule names) ----
  // Whether backward reduces this wrapper's gradients (recurse: every
  // wrapper's in its tree). Off, they accumulate full and unreduced, as
  // under no_sync(), until a backward with it on reduces them: gradient
  // accumulation without re-entering a guard. Every rank must set the same.
  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true) {
    detail::set_requires_gradient_sync(*this, requires_gradient_sync, recurse);
  }
  // Whether backward frees the full parameters (default on). Off, they
  // stay gathered into the next forward, which then gathers nothing: for
  // the micro-batches of gradient accumulation (with gradient sync off),
  // trading memory for communication. Before the optimizer steps, turn it
  // back on for the last backward or call reshard(): the optimizer steps
  // the shards.
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true) {
    detail::set_reshard_after_backward(*this, reshard_after_backward, recurse);
  }
  // Explicit prefetching: when this wrapper's forward (backward) starts,
  // start gathering these wrappers' units, in place of forward_prefetch
  // (backward_prefetch). E.g. two blocks ahead:
  //   blocks[i]->set_modules_to_forward_prefetch({blocks[i + 1].ptr(), blocks[i + 2].ptr()});
  // Each gathered unit holds its full parameters until its own forward
  // (backward) uses them; every rank must name the same.
  void set_modules_to_forward_prefetch(const std::vector<std::shared_ptr<detail::FullyShardedModule>>& modules) {
    detail::set_modules_to_prefetch(*this, modules, /*forward=*/true);
  }
  void set_modules_to_backward_prefetch(const std::vector<std::shared_ptr<detail::FullyShardedModule>>& modules) {
    detail::set_modules_to_prefetch(*this, modules, /*forward=*/false);
  }
  // ---- Join (tdist/join.h) ----
  // What a rank that has joined runs for each iteration the others still
  // train: one training step as the loop makes it (zero_grad, a forward
  // and backward on any batch of the right shape, clip_grad_norm_ if the
  // loop clips, the optimizer's and scheduler's step). Its gradients take
  // part in the reductions as zeros, so the step adds nothing of its own;
  // it keeps this rank's shards and their optimizer state stepping with
  // the others'. A Join over this wrapper refuses to start without it.
  void set_join_step(std::function<void()> step) { join_step_ = std::move(step); }
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) override {
    return detail::fsdp_join_hook(*this, join_step_, options);
  }
  std::shared_ptr<ProcessGroup> join_process_group() override { return core_.world_process_group(); }

  // Frees every gathered unit of this tree now (after backwards that kept
  // them with set_reshard_after_backward(false)). Not inside a forward or
  // backward.
  void reshard() { detail::reshard_units(*this); }

  // Gradient accumulation: while the guard lives, backward keeps full
  // gradients locally (one unit's worth of memory per unit, as PyTorch's
  // FSDP does); the first backward after it reduces everything.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(torch::nn::Module& root) : root_(root), previous_(detail::require_sync(root)) {
      detail::set_require_sync(root_, false);
    }
    ~NoSyncGuard() { detail::set_require_sync(root_, previous_); }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    torch::nn::Module& root_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  // While the guard lives, every parameter in this tree is whole (to read,
  // evaluate or initialise). With writeback, edits to this rank's rows are
  // kept when it ends. Collective: every rank takes and drops it together.
  class SummonGuard {
   public:
    SummonGuard(torch::nn::Module& root, bool writeback) : root_(root), writeback_(writeback) {
      detail::begin_summon(root_, writeback_);
    }
    ~SummonGuard() { detail::end_summon(root_, writeback_); }
    SummonGuard(const SummonGuard&) = delete;
    SummonGuard& operator=(const SummonGuard&) = delete;

   private:
    torch::nn::Module& root_;
    bool writeback_;
  };
  [[nodiscard]] SummonGuard summon_full_params(bool writeback = true) { return SummonGuard(*this, writeback); }

 protected:
  // The wrapped module's forward between the unit's gather and free.
  template <typename... Args>
  decltype(auto) run(Args&&... args) {
    Join::notify_join_context(*this);
    core_.begin_forward();
    try {
      decltype(auto) out = detail::Wrapped<ModuleHolder>::call(module_, cast_arg(std::forward<Args>(args))...);
      std::vector<at::Tensor> tensors;
      detail::collect_tensors(out, tensors);
      core_.end_forward(tensors, this->is_training());
      return out;
    } catch (...) {
      core_.abort_forward();
      throw;
    }
  }

 private:
  template <typename T>
  decltype(auto) cast_arg(T&& x) {
    if constexpr (detail::is_tensor_v<T>) {
      return core_.cast_input(x);
    } else {
      return std::forward<T>(x);
    }
  }

  ModuleHolder module_;
  detail::FullyShardedCore core_;
  std::function<void()> join_step_;
};

// The wrapper of a module whose forward signature is not known (a template
// or overloaded forward): forward is a template.
template <typename ModuleHolder, typename Signature = typename detail::Wrapped<ModuleHolder>::Signature>
class FullyShardedDataParallelImpl : public FullyShardedBase<ModuleHolder> {
 public:
  FullyShardedDataParallelImpl(ModuleHolder module, FullyShardedDataParallelOptions options = {})
      : FullyShardedBase<ModuleHolder>(std::move(module), std::move(options)) {}
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    return this->run(std::forward<Args>(args)...);
  }
};

// The wrapped module's own forward, with its own signature: the wrapper
// fits into a torch::nn::Sequential or an AnyModule as the module did.
template <typename ModuleHolder, typename R, typename... A>
class FullyShardedDataParallelImpl<ModuleHolder, R(A...)> : public FullyShardedBase<ModuleHolder> {
 public:
  FullyShardedDataParallelImpl(ModuleHolder module, FullyShardedDataParallelOptions options = {})
      : FullyShardedBase<ModuleHolder>(std::move(module), std::move(options)) {}
  R forward(A... args) { return this->run(std::forward<A>(args)...); }
};

// ModuleHolder style: fsdp->forward(x), fsdp(x), fsdp->parameters(), ...
template <typename ModuleHolder>
class FullyShardedDataParallel : public torch::nn::ModuleHolder<FullyShardedDataParallelImpl<ModuleHolder>> {
 public:
  using torch::nn::ModuleHolder<FullyShardedDataParallelImpl<ModuleHolder>>::ModuleHolder;
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

template <typename ModuleHolder>
using FSDP = FullyShardedDataParallel<ModuleHolder>;

// tdist::FullyShardedDataParallel(module, options) without naming the type.
template <typename ModuleHolder>
FullyShardedDataParallel(ModuleHolder, FullyShardedDataParallelOptions) -> FullyShardedDataParallel<ModuleHolder>;

}  // namespace tdist
