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
// Limits: CPU parameters; forward and backward on one thread; every rank
// runs the same units in the same order (a unit skipped on one rank only is
// a CollectiveMismatchError or a timeout, never a silent wrong result);
// move, convert or load the module before wrapping it.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tdist/ddp.h"  // detail::collect_tensors
#include "tdist/process_group.h"

namespace tdist {

enum class ShardingStrategy {
  FULL_SHARD,     // ZeRO-3: parameters, gradients and optimizer state sharded
  SHARD_GRAD_OP,  // ZeRO-2: full parameters kept from forward to the end of backward
  NO_SHARD,       // every rank keeps everything; gradients all-reduced (DDP)
};

enum class BackwardPrefetch {
  NONE,          // gather each unit when its backward starts
  BACKWARD_PRE,  // when a unit's backward starts, start gathering the next one
};

struct FullyShardedDataParallelOptions {
  std::shared_ptr<ProcessGroup> process_group;  // null: the default group
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  // Free the full parameters after the unit's forward (and gather them again
  // for its backward). Unset: true for FULL_SHARD, false otherwise. The
  // outermost wrapper keeps its own until the end of backward either way
  // (its backward comes first), and forwards without gradient
  // (NoGradGuard) or in eval mode always free them.
  std::optional<bool> reshard_after_forward;
  // Broadcast rank 0's parameters and buffers at construction. Off: every
  // rank must have built the same values itself (same seed).
  bool sync_module_states = true;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
  // Start gathering the next unit (in the last iteration's forward order)
  // when a unit's forward starts. At most one unit is ever gathered ahead,
  // in forward and in backward, so the memory of prefetching is bounded by
  // one unit's full parameters (what limit_all_gathers buys in PyTorch).
  bool forward_prefetch = false;
};

// What get_shard_metadata() reports: enough to put the full parameters
// back together from every rank's shards (the checkpoint code reads it).
struct ShardedParamInfo {
  std::string name;           // in the wrapped model (as named_parameters() says)
  std::string original_name;  // the same without the wrappers' "module." steps
  std::vector<int64_t> shape;        // full
  std::vector<int64_t> shard_shape;  // this rank's
  int64_t numel = 0;                 // full
  int64_t first_row = 0;             // the shard's first row in the full parameter
  int64_t rows_per_rank = 0;         // every rank's shard is this many rows, padded
  int64_t padding_rows = 0;          // rows_per_rank * world_size - rows
  bool requires_grad = true;
};
struct ShardedUnitInfo {
  std::string prefix;  // where the wrapper sits in the model ("" for the outermost)
  bool sharded = true;  // false for NO_SHARD units (every rank holds everything)
  std::vector<ShardedParamInfo> params;
};
struct ShardMetadata {
  int world_size = 1;
  int rank = 0;
  std::vector<ShardedUnitInfo> units;  // the wrappers in the model, outermost first
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
  const FullyShardedDataParallelOptions& options() const;
  const std::shared_ptr<FsdpState>& state() const { return state_; }

 private:
  std::shared_ptr<FsdpState> state_;
};

// The non-template side of every wrapper, so that an outer wrapper finds
// the inner ones in its module tree.
class FullyShardedModule {
 public:
  virtual ~FullyShardedModule() = default;
  virtual FullyShardedCore& fsdp_core() = 0;
};

// Operations over every wrapper in `root`'s tree (root included).
double clip_grad_norm(torch::nn::Module& root, double max_norm, double norm_type);
void set_require_sync(torch::nn::Module& root, bool on);
bool require_sync(torch::nn::Module& root);
ShardMetadata shard_metadata(torch::nn::Module& root);
// Gathers every unit's full parameters; end_summon() frees them again,
// after copying this rank's rows back into the shards when writeback.
void begin_summon(torch::nn::Module& root, bool writeback);
void end_summon(torch::nn::Module& root, bool writeback) noexcept;

}  // namespace detail

template <typename ModuleHolder>
class FullyShardedDataParallelImpl : public torch::nn::Module, public detail::FullyShardedModule {
 public:
  FullyShardedDataParallelImpl(ModuleHolder module, FullyShardedDataParallelOptions options = {})
      : module_(register_module("module", std::move(module))), core_(*module_.ptr(), std::move(options)) {}

  // The wrapped module's own forward, with its own signature.
  template <typename... Args>
  auto forward(Args&&... args) {
    core_.begin_forward();
    try {
      auto out = module_->forward(std::forward<Args>(args)...);
      std::vector<at::Tensor> tensors;
      detail::collect_tensors(out, tensors);
      core_.end_forward(tensors, this->is_training());
      return out;
    } catch (...) {
      core_.abort_forward();
      throw;
    }
  }

  ModuleHolder module() const { return module_; }
  const std::shared_ptr<ProcessGroup>& process_group() const { return core_.process_group(); }
  detail::FullyShardedCore& fsdp_core() override { return core_; }

  // Scales the gradients of every unit in this wrapper's tree so that their
  // global norm (over all ranks' shards, as if the model were whole) is at
  // most max_norm; returns the norm before scaling. norm_type: 2, 1, or
  // infinity. Collective: call it on every rank.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0) {
    return detail::clip_grad_norm(*this, max_norm, norm_type);
  }

  // The wrappers in this tree: names, shapes and this rank's rows.
  ShardMetadata get_shard_metadata() { return detail::shard_metadata(*this); }

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

 private:
  ModuleHolder module_;
  detail::FullyShardedCore core_;
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

}  // namespace tdist
