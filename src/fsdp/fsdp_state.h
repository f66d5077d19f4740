// FsdpState: what one FullyShardedDataParallel wrapper holds: its options,
// its unit, the gradient-ready tracker over the unit's trainable
// parameters, and the per-iteration flags the Coordinator of the
// outermost wrapper drives.
//
// Owns: the unit, the tracker, and the Coordinator it uses when it is the
// outermost wrapper of a forward.
// Threading: the training thread (forward, and backward hooks and
// callbacks, which the CPU autograd engine runs on the thread that called
// backward). Not synchronised.
// Lifetime: shared; the backward hooks hold it weakly.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "autograd/grad_ready.h"
#include "fsdp/unit.h"
#include "tdist/fsdp.h"

namespace tdist::detail {

class Coordinator;

struct FsdpState : GradReadyListener, std::enable_shared_from_this<FsdpState> {
  FullyShardedDataParallelOptions options;
  // The groups it works over: pg shards (the unit's gathers and
  // reduce-scatters); replicate_pg, under hybrid sharding, all-reduces the
  // shard gradients across the shard groups (null otherwise); world_pg is
  // both together (the checks and broadcast at construction).
  std::shared_ptr<ProcessGroup> pg;
  std::shared_ptr<ProcessGroup> replicate_pg;
  std::shared_ptr<ProcessGroup> world_pg;
  bool reshard_after_forward = true;
  // FSDP2's controls (set_requires_gradient_sync, set_reshard_after_backward,
  // set_modules_to_forward_prefetch / _backward_prefetch): whether its
  // backward reduces its gradients (else they accumulate full, as under
  // no_sync), whether its full parameters are freed after backward, and
  // the units it starts gathering when its forward / backward starts (in
  // place of forward_prefetch / backward_prefetch).
  bool requires_gradient_sync = true;
  bool reshard_after_backward = true;
  std::optional<std::vector<std::weak_ptr<FsdpState>>> forward_prefetch_units;  // set: replaces forward_prefetch
  std::optional<std::vector<std::weak_ptr<FsdpState>>> backward_prefetch_units;
  bool kept_after_backward = false;  // the last backward left it gathered (reshard_after_backward off)
  std::unique_ptr<ShardedUnit> unit;
  // Buffers converted to buffer_dtype, with their dtype before.
  std::vector<std::pair<const c10::TensorImpl*, at::ScalarType>> converted_buffers;
  std::optional<GradReadyTracker> tracker;  // over the unit's trainable parameters, in unit order
  std::shared_ptr<Coordinator> own;         // when this wrapper is the outermost of a forward
  std::weak_ptr<Coordinator> current;       // the outermost wrapper's, for this iteration
  bool summoned = false;                    // inside summon_full_params
  bool recomputing = false;                 // its forward runs again for a checkpoint's backward

  // Per iteration (the Coordinator resets them).
  bool is_root = false;   // outermost wrapper of this iteration's forward
  // Where this iteration has taken the unit, in order (a unit whose
  // gradients all arrive goes to kGradientsReady from either before it):
  // kIdle, not in this iteration's forward (or it ran without gradients);
  // kRecorded, in the forward order; kBackwardBegan, its backward has
  // started (gathered); kGradientsReady, every tracked gradient arrived.
  enum class Phase { kIdle, kRecorded, kBackwardBegan, kGradientsReady };
  Phase phase = Phase::kIdle;
  bool recorded() const { return phase != Phase::kIdle; }
  bool backward_began() const { return phase >= Phase::kBackwardBegan; }
  bool gradients_ready() const { return phase == Phase::kGradientsReady; }
  size_t order_index = 0;
  // With the timeline on (trace/timeline.h): when its forward and its
  // backward began, CLOCK_REALTIME ns.
  int64_t forward_began_ns = 0;
  int64_t backward_began_ns = 0;
  size_t arrived = 0;

  std::vector<size_t> tracked;  // tracker index -> unit parameter index

  void before_grad_accumulates(size_t index) override;
  void on_grad_ready(size_t index) override;
  void on_backward_end() override {}
};

// Tells state's unit, and every unit inside `module` (the module state's
// wrapper wraps), their parameters' names in that model, for messages
// (skip_init's); an outer wrapper's call names them again, in its model.
void name_params_in_model(FsdpState& state, torch::nn::Module& module);

}  // namespace tdist::detail
