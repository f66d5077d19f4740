// ShardedUnit: one FSDP unit's parameters, in their two forms, and the
// collectives that move between them (docs/fsdp.md).
//
// The life of a unit, step by step:
// - Made: each parameter (an FsdpParam, below) keeps this rank's rows of
//   itself (ShardLayout) in the unit's chunk, and the parameter the module
//   holds is pointed at them: what the optimizer steps.
// - unshard(): ONE all-gather (unit_comm.h) of the whole unit (every
//   parameter's shard straight into its place in the FullStorage), then
//   the parameters are pointed at the full tensors.
// - Backward: just before a parameter's gradient accumulates, its .grad
//   (the shard gradient of earlier backwards) is set aside and .grad is
//   pointed at the parameter's place in the unit's full gradient buffer
//   (laid out as the full parameters, padding zero), so autograd
//   accumulates there.
// - reduce(): ONE reduce-scatter of the whole unit (AVG) into a chunk of
//   shard gradients (under hybrid sharding chained with one all-reduce of
//   that chunk across the replicas), added to what was set aside; without
//   sharding (NO_SHARD) one all-reduce of autograd's own .grads in place.
// - reshard(): the parameters point at their shards again and the full
//   memory goes back to the pool.
// - reshard_after_forward() with a post-forward group of k ranks (hpZ):
//   reshard(), but first this rank's 1/k of the full parameters (its rows
//   in a ShardLayout over k ranks, which fit inside the full layout's
//   padded rows since k divides the group's size) is copied into a
//   post-forward chunk. The next unshard() gathers from those chunks
//   within the k ranks, unless a parameter changed since (its version
//   counter moved: an optimizer step), in which case it gathers over the
//   whole group. reshard() drops the post-forward chunk (the Coordinator's
//   settle reshards every unit at a forward after a missing backward).
// A failed backward calls drop_in_flight(), which waits the collectives
// out and puts every .grad back as it was.
//
// Owns: the records of its parameters, the chunk (this rank's shards back
// to back, padding zero: the all-gather input; none when the full storage
// is kept), the full storage and the full gradient buffer, and the
// collectives in flight.
// Threading: not synchronised: the training thread (forward, backward hooks
// and callbacks on the CPU autograd engine's caller thread) uses it.
// Lifetime: the parameters stay the module's (the unit never replaces
// them, it re-points them with set_data); the unit must outlive any
// collective it launched (drop_in_flight() waits them out).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/full_storage.h"
#include "fsdp/shard_layout.h"
#include "fsdp/unit_comm.h"
#include "tdist/process_group.h"

namespace tdist::detail {

// What a unit is made from, per parameter.
struct FsdpParamSpec {
  std::string name;  // in the wrapped module, as its named_parameters() says
  at::Tensor param;  // CPU or one CUDA device, dense, full as the module built it (equal on every rank)
  // Forward and backward see it in its own dtype even with a compute dtype
  // (BatchNorm's: its kernels take fp32 weights with bf16 inputs); it is
  // still gathered in the compute dtype.
  bool keep_dtype = false;
  // Its first name in model order without wrapper steps, and the other
  // names a tied parameter is registered under (both within the wrapped
  // module).
  std::string original_name;
  std::vector<std::string> aliases;
};

// How a unit shards and computes.
struct UnitOptions {
  bool shard = true;  // false: NO_SHARD (every rank keeps every parameter whole)
  // SHARD_GRAD_OP (ZeRO-2): the full storage is never released and the
  // shards are this rank's rows of it, so the full parameters cost no
  // second copy of the shards. Ignored with a compute dtype of its own.
  bool keep_full = false;
  // The dtype forward and backward see the full parameters in (gathered in
  // it; the shards keep the parameters' dtype), and the one gradients are
  // reduced in. Empty: the parameters' (the reduce dtype: the compute one).
  std::optional<at::ScalarType> compute_dtype;
  std::optional<at::ScalarType> reduce_dtype;
  // Hybrid sharding: the ranks holding the same shards in the other shard
  // groups. The reduced shard gradients are all-reduced (AVG) over it, so
  // they average over every rank; gathers stay in the shard group.
  std::shared_ptr<ProcessGroup> replicate_group;
  // reshard_after_forward as an int k (hpZ): the block of k consecutive
  // ranks of the shard group holding this rank (post_forward_group). Null:
  // reshard_after_forward() frees everything.
  std::shared_ptr<ProcessGroup> post_forward_group;
};

// One parameter of a unit (as FSDP2's FSDPParam): the module's tensor, its
// place in the unit's buffers, and its gradient's state in a backward.
struct FsdpParam {
  std::string name;                  // FsdpParamSpec's three names
  std::string original_name;
  std::vector<std::string> aliases;
  at::Tensor param;  // the module's tensor: re-pointed, never replaced
  const ParamShardLayout* layout = nullptr;  // its shape and offsets (in the unit's ShardLayout)
  bool trainable = false;                    // requires_grad when wrapped
  bool keep_dtype = false;                   // FsdpParamSpec::keep_dtype
  at::Tensor shard;                          // this rank's real rows (in the chunk or the kept full storage)
  // While its gradient accumulates in the full buffer: the shard-shaped
  // .grad from before this backward (undefined if there was none).
  at::Tensor grad_before;
  bool grad_set_aside = false;
  // save_shards(): a copy of shard while a summon without writeback lets
  // the full parameters' edits reach it.
  at::Tensor saved_shard;
  // Its name in the whole model, for messages, once the outermost wrapper
  // has told it (empty until then: name).
  std::string model_name;
  // Made with skip_init and not written since: the version counter the
  // module's tensor had then (-1: it holds values).
  int64_t awaiting_load_at = -1;

  bool empty() const { return layout->shard_numel() == 0; }
};

class ShardedUnit {
 public:
  // params: one dtype, one device. label: how messages name the unit.
  ShardedUnit(std::shared_ptr<ProcessGroup> pg, std::string label, std::vector<FsdpParamSpec> params,
              const UnitOptions& options);
  ShardedUnit(const ShardedUnit&) = delete;
  ShardedUnit& operator=(const ShardedUnit&) = delete;
  ~ShardedUnit();

  const std::string& label() const { return label_; }
  // The short name the flight recorder and the timeline give it
  // ("GptBlockImpl #3": its module's type and the process's count of units).
  const std::string& trace_name() const { return trace_name_; }
  void set_trace_name(std::string name) { trace_name_ = std::move(name); }
  const std::vector<FsdpParam>& params() const { return params_; }
  bool has_frozen() const;
  bool has_trainable() const;
  bool sharded() const { return sharded_; }
  // Whether its reduction takes no memory of its own: without sharding, in
  // autograd's gradients in their dtype (a reduce dtype of another makes a
  // converted copy, alive until the reduction is finished).
  bool reduces_in_place() const { return !sharded_ && reduce_dtype_ == dtype_; }
  // The layout (world 1 without sharding) and this rank's place in it.
  const ShardLayout& layout() const { return layout_; }
  int shard_rank() const { return shard_rank_; }
  const std::shared_ptr<ProcessGroup>& process_group() const { return pg_; }

  // ---- parameters ----
  // Whether the parameters hold their full values (always, without sharding).
  bool unsharded() const { return state_ == State::kFull; }
  bool gathering() const { return state_ == State::kGathering; }
  // Launches the unit's all-gather (nothing when unsharded or already
  // gathering), in the compute dtype, or with exact in the shards' own
  // (for summon_full_params).
  void start_unshard(bool exact = false);
  // Waits for it and points the parameters at the full tensors. A failed
  // gather raises (PeerFailureError, TimeoutError...) and leaves the unit
  // sharded.
  void finish_unshard();
  void unshard(bool exact = false);
  // Points the parameters at their shards and releases the full memory
  // (and a post-forward chunk).
  void reshard();
  // After a forward whose backward comes later: reshard(), keeping a
  // post-forward chunk when the unit has a post-forward group (above).
  void reshard_after_forward();
  // Whether a post-forward chunk is held.
  bool has_post_forward() const { return post_.has_value(); }
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
  // skip_init (FullyShardedDataParallelOptions): the parameters at these
  // indices hold no values yet. Until something writes each one (a
  // loader's copy moves its version counter), gathering the unit is a
  // UsageError naming the first: never a forward or a save of unset
  // memory. One integer test per gather otherwise.
  void await_load(const std::vector<size_t>& indices);
  bool awaiting_load() const { return awaiting_ > 0; }
  // The UsageError above, for a caller about to read the shards without
  // gathering (a sharded save); nothing once every parameter was written.
  void check_loaded() {
    if (awaiting_ > 0) check_awaiting();
  }
  void set_model_name(size_t k, std::string name) { params_.at(k).model_name = std::move(name); }

  // ---- gradients ----
  // Before parameter k's gradient accumulates in a backward: sets its
  // shard-shaped .grad aside (autograd accumulates the full gradient into
  // .grad). Once per backward; nothing while full gradients are kept from
  // a no_sync backward, or without sharding.
  void set_aside_grad(size_t k);
  // The same for every parameter not yet set aside.
  void set_aside_shard_grads();
  // Whether the gradients accumulate in autograd's own tensors, copied
  // into the gradient buffer by start_reduce, instead of in the buffer
  // itself (the default). For a unit gathered through the whole backward
  // (the outermost one: its parameters are used at both ends of the
  // forward, as a tied embedding is) the buffer would be held through the
  // whole backward beside the full parameters; taken late, after
  // reshard(), it reuses their block. Set before a backward starts.
  void set_late_grad_buffer(bool on) { late_grad_buffer_ = on; }
  bool late_grad_buffer() const { return late_grad_buffer_; }
  // Whether the full-gradient buffer is taken (the unit's gradients are
  // accumulating, or kept from no_sync).
  bool has_grad_buffer() const { return grad_full_.allocated(); }
  // Launches the unit's reduction (zeros for a parameter that got no
  // gradient, so every rank takes part).
  void start_reduce();
  // Waits for it; .grad = the shard gradient plus what was set aside.
  void finish_reduce();
  bool reducing() const { return reduce_.has_value(); }
  // Whether the reduction in flight has finished (finish_reduce will not wait).
  bool reduce_done() const { return !reduce_ || reduce_->done(); }
  // no_sync: the full gradients stay in .grad; the next synchronised
  // backward accumulates into them and reduces them.
  void keep_full_grads() { grads_full_ = true; }
  // Join (tdist/join.h): while on, this rank's gradients take part in the
  // reductions as zeros (a joined rank shadowing the others' step).
  void set_reduce_zeros(bool on) { reduce_zeros_ = on; }
  // After a failed backward: waits out the collectives in flight (their
  // errors are dropped: the failure was reported where it happened), drops
  // the partial full gradients of the parameters whose accumulation ran and
  // puts back the .grad they had before it, and reshards.
  void drop_in_flight() noexcept;

 private:
  enum class State { kSharded, kGathering, kFull };
  // hpZ: this rank's rows of the full parameters in the post-forward
  // layout, and the parameters' version counters (summed) when they were
  // taken.
  struct PostForward {
    at::Tensor chunk;
    int64_t versions = 0;
  };

  // Whether the parameters move between shards and full storage.
  bool swaps() const { return sharded_ || compute_dtype_ != dtype_; }
  // Parameter p's full tensor (its shape) or its padded region in the
  // full storage.
  at::Tensor full_of(const FsdpParam& p) const;
  at::Tensor padded_full_of(const FsdpParam& p) const;
  void ensure_grad_buffer();
  // Parameter p's full gradient, padded, in the gradient buffer (zeros if
  // it got none); .grad is dropped.
  at::Tensor take_full_grad(FsdpParam& p);
  // numel zeros of the shards' dtype on the unit's device; on the CPU in
  // symmetric memory where the group has it.
  at::Tensor zeroed(int64_t numel) const;
  void point_at_shards();
  void launch_unshard(bool exact);  // start_unshard's work, from the sharded state
  // The post-forward gather (launch_unshard's, when the chunk is usable).
  GatherRecord launch_post_forward_gather();
  int64_t param_versions() const;
  void release_full();  // unless the full storage is kept
  void check_awaiting();  // UsageError naming a parameter still awaiting its values
  void finish_reduce_unsharded(const ReduceRecord& r);

  std::shared_ptr<ProcessGroup> pg_;
  std::shared_ptr<ProcessGroup> replicate_;  // hybrid sharding (UnitOptions::replicate_group), else null
  std::shared_ptr<ProcessGroup> post_pg_;    // hpZ (UnitOptions::post_forward_group), else null
  std::string label_;
  std::string trace_name_;
  bool sharded_;
  int shard_rank_;
  ShardLayout layout_;            // before params_: they point into it
  std::optional<ShardLayout> post_layout_;  // hpZ: the layout over post_pg_'s ranks
  c10::Device device_;            // the parameters' (all on one device)
  at::ScalarType dtype_;          // the shards' (the parameters' as built)
  at::ScalarType compute_dtype_;  // the full parameters' in forward and backward
  at::ScalarType reduce_dtype_;   // the gradients' in the reduction
  bool keep_full_;                // SHARD_GRAD_OP without a compute dtype of its own
  std::vector<FsdpParam> params_;
  size_t awaiting_ = 0;  // parameters awaiting their values (await_load)

  at::Tensor chunk_;       // this rank's shards, padding zero (none when the full storage is kept)
  FullStorage full_;       // the full parameters, in the full layout
  FullStorage grad_full_;  // sharded: the full gradients, in the full layout (the reduce-scatter input)
  State state_ = State::kSharded;
  bool grads_full_ = false;  // a no_sync backward left full gradients in .grad
  bool reduce_zeros_ = false;  // set_reduce_zeros
  bool late_grad_buffer_ = false;  // set_late_grad_buffer
  std::optional<GatherRecord> gather_;  // unit_comm.h
  std::optional<ReduceRecord> reduce_;
  std::optional<PostForward> post_;  // hpZ: kept from the last forward
};

}  // namespace tdist::detail
