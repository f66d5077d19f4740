// ShardedUnit: one FSDP unit's parameters, in their two forms, and the
// collectives that move between them (docs/fsdp.md).
//
// The unit owns a set of the module's parameters (the tensors registered in
// the module: the unit never replaces them, it re-points them with
// set_data). Between iterations each parameter is this rank's shard of it
// (its rows by ShardLayout, padding not included): what the optimizer
// steps. unshard() all-gathers every parameter straight into its place in
// the unit's FullStorage and points the parameters at the full tensors;
// reshard() points them back at the shards and releases the full memory.
// Gradients: just before a parameter's gradient accumulates, its .grad is
// pointed at its place in the unit's full gradient buffer (laid out as the
// full parameters, padding zero), so autograd accumulates there;
// reduce() reduce-scatters that buffer (AVG) into shard-shaped .grad
// (adding what .grad held before this backward), or, without sharding
// (NO_SHARD), all-reduces autograd's own .grad in place.
//
// Owns: the chunk (this rank's shards back to back, padding zero: the
// all-gather input; none when the full storage is kept), the full storage, the shard gradients set aside during
// a backward, and the collectives in flight.
// Threading: not synchronised: the training thread (forward, backward hooks
// and callbacks on the CPU autograd engine's caller thread) uses it.
// Lifetime: the parameters stay the module's; the unit must outlive any
// collective it launched (drop_in_flight() waits them out).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/full_storage.h"
#include "fsdp/shard_layout.h"
#include "tdist/process_group.h"

namespace tdist::detail {

class ShardedUnit {
 public:
  // params: CPU, dense, one dtype, full as the module built them (already
  // equal on every rank). shard: false for NO_SHARD (every rank keeps
  // every parameter whole). keep_full (SHARD_GRAD_OP, ZeRO-2): the full
  // storage is never released and the shards are this rank's rows of it,
  // so the full parameters cost no second copy of the shards. label: how
  // messages name the unit.
  // compute_dtype: the dtype forward and backward see the full parameters
  // in (gathered in it; the shards keep the parameters' dtype);
  // reduce_dtype: the dtype gradients are reduced in. Either may be the
  // parameters' dtype. With a compute dtype of its own the full storage is
  // never kept (keep_full is ignored) and, without sharding, unshard()
  // converts locally.
  // keep_dtype (empty, or one flag per parameter): parameters that forward
  // and backward see in their own dtype even with a compute dtype (those of
  // BatchNorm, whose kernels take fp32 weights with bf16 inputs and fp32
  // running statistics, but not bf16 weights); they are still gathered in
  // the compute dtype.
  ShardedUnit(std::shared_ptr<ProcessGroup> pg, std::string label, std::vector<std::string> names,
              std::vector<at::Tensor> params, bool shard, bool keep_full, std::optional<at::ScalarType> compute_dtype,
              std::optional<at::ScalarType> reduce_dtype, std::vector<char> keep_dtype = {});
  ShardedUnit(const ShardedUnit&) = delete;
  ShardedUnit& operator=(const ShardedUnit&) = delete;
  ~ShardedUnit();

  const std::string& label() const { return label_; }
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  bool trainable(size_t k) const { return trainable_[k]; }
  bool has_frozen() const { return has_frozen_; }
  bool has_trainable() const { return has_trainable_; }
  bool sharded() const { return sharded_; }
  // The layout (world 1 without sharding) and this rank's place in it.
  const ShardLayout& layout() const { return layout_; }
  int shard_rank() const { return shard_rank_; }
  const std::shared_ptr<ProcessGroup>& process_group() const { return pg_; }

  // ---- parameters ----
  // Whether the parameters hold their full values (always, without sharding).
  bool unsharded() const { return state_ == State::kFull; }
  bool gathering() const { return state_ == State::kGathering; }
  // Launches the all-gathers (nothing when unsharded or already gathering),
  // in the compute dtype, or with exact in the shards' own (for
  // summon_full_params).
  void start_unshard(bool exact = false);
  // Waits for them and points the parameters at the full tensors. A failed
  // gather raises (PeerFailureError, TimeoutError...) and leaves the unit
  // sharded.
  void finish_unshard();
  void unshard(bool exact = false) {
    if (exact && !sharded_ && state_ == State::kSharded) return;  // the shards are whole and exact
    start_unshard(exact);
    finish_unshard();
  }
  // Points the parameters at their shards and releases the full memory.
  void reshard();
  // Copies this rank's rows of the full parameters into the shards (after
  // the user edited full parameters). REQUIRES: unsharded().
  void write_back();
  // Where the shards are rows of the kept full storage (SHARD_GRAD_OP),
  // edits to the full parameters reach them directly: a summon without
  // writeback saves them first and puts them back after.
  void save_shards();
  void restore_shards();
  // UsageError naming the parameter if one no longer lies where the unit
  // put it (e.g. module.to() or set_data after wrapping).
  void check_params_in_place() const;

  // ---- gradients ----
  // Before parameter k's gradient accumulates in a backward: moves its
  // shard-shaped .grad aside (autograd accumulates the full gradient into
  // .grad). Once per backward; nothing while full gradients are kept from
  // a no_sync backward, or without sharding.
  void set_aside_grad(size_t k);
  // The same for every parameter not yet set aside.
  void set_aside_shard_grads();
  // Whether the full-gradient buffer is taken (the unit's gradients are
  // accumulating, or kept from no_sync).
  bool has_grad_buffer() const { return grad_full_.allocated(); }
  // Launches the reduction of the full gradients (zeros for a parameter
  // that got none, so every rank takes part).
  void start_reduce();
  // Waits for it; .grad = the shard gradient plus what was set aside.
  void finish_reduce();
  bool reducing() const { return reduce_.has_value(); }
  // Whether the reduction in flight has finished (finish_reduce will not wait).
  bool reduce_done() const;
  // no_sync: the full gradients stay in .grad; the next synchronised
  // backward accumulates into them and reduces them.
  void keep_full_grads() { grads_full_ = true; }
  // After a failed backward: waits out the collectives in flight (their
  // errors are dropped: the failure was reported where it happened), drops
  // the partial full gradients of the parameters whose accumulation ran and
  // puts back the .grad they had before it, and reshards.
  void drop_in_flight() noexcept;

 private:
  enum class State { kSharded, kGathering, kFull };
  struct Reduce {
    std::vector<std::shared_ptr<Work>> works;
    at::Tensor out;                  // sharded: the reduce-scatter output, a chunk
    std::vector<at::Tensor> inputs;  // kept alive until the works are done
    std::vector<size_t> targets;     // not sharded: the parameter of each input
  };

  void ensure_grad_buffer();
  // Parameter k's full gradient, padded, in the gradient buffer (zeros if
  // it got none); .grad is dropped.
  at::Tensor take_full_grad(size_t k);
  // numel zeros of the shards' dtype on the unit's device; on the CPU in
  // symmetric memory where the group has it.
  at::Tensor zeroed(int64_t numel) const;
  void point_at_shards();
  void release_full();  // unless keep_full

  std::shared_ptr<ProcessGroup> pg_;
  std::string label_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  std::vector<char> trainable_;
  bool has_frozen_ = false;
  bool has_trainable_ = false;
  bool sharded_;
  bool keep_full_;
  int shard_rank_;
  ShardLayout layout_;
  c10::Device device_;            // the parameters' (all on one device)
  at::ScalarType dtype_;          // the shards' (the parameters' as built)
  at::ScalarType compute_dtype_;  // the full parameters' in forward and backward
  at::ScalarType reduce_dtype_;   // the gradients' in the reduction
  bool cast_;                     // compute_dtype_ != dtype_
  bool swaps_;                    // the parameters move between shards and full storage (sharded_ || cast_)
  std::vector<char> keep_dtype_;  // per parameter: computes in dtype_ (a converted copy of its gathered values)

  at::Tensor chunk_;                      // this rank's shards, padding zero
  std::vector<at::Tensor> shard_views_;   // per parameter: its real rows in chunk_
  FullStorage full_;
  FullStorage grad_full_;  // sharded: the full gradients, in the full layout (the reduce-scatter input)
  State state_ = State::kSharded;
  std::vector<std::shared_ptr<Work>> gathers_;
  std::vector<at::Tensor> gather_inputs_;  // kept alive until the gathers are done
  std::vector<at::Tensor> saved_shards_;   // save_shards()

  std::vector<at::Tensor> set_aside_;     // per parameter: .grad before this backward
  std::vector<char> aside_;               // per parameter: set_aside_[k] holds it
  bool grads_full_ = false;
  std::optional<Reduce> reduce_;
};

}  // namespace tdist::detail
