// Gradient-ready tracking: tells a listener when each parameter's gradient
// has been accumulated during backward, and when the backward has ended.
//
// Owns: one post hook (and optionally a pre hook) on each parameter's
// gradient accumulator, and the
// accumulators themselves (autograd holds them weakly: without our hold
// the hooks would silently never fire), the per-backward arrival flags,
// and whether the end-of-backward callback is queued.
// Users: DDP (its reducer fills and launches buckets as gradients arrive);
// FSDP (a unit's gradients are complete: reduce-scatter, reshard).
// Threading: the listener is called on the thread that runs backward. The
// per-backward methods (arm_end_of_backward, mark_arrived, arrived, reset)
// are not synchronised: REQUIRES the caller's lock (DDP calls them under
// its mutex, from its listener and its forward-side methods).
// Lifetime: the hooks and the queued callback hold the listener weakly and
// do nothing once it is gone; a tracker may be destroyed any time outside
// a backward in which it is armed.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "util/torch_compat.h"

namespace tdist::detail {

// The callbacks of a GradReadyTracker. Both run on the backward thread;
// an exception thrown from either fails that backward.
class GradReadyListener {
 public:
  virtual ~GradReadyListener() = default;
  // Parameter `index`'s accumulator has run: its .grad holds this
  // backward's contribution. Once per accumulator run (a reentrant
  // backward runs it more than once).
  virtual void on_grad_ready(size_t index) = 0;
  // Parameter `index`'s accumulator is about to run (only for a tracker
  // made with_pre_hooks): .grad does not hold this backward's part yet.
  virtual void before_grad_accumulates(size_t /*index*/) {}
  // The backward in which arm_end_of_backward() was called has finished
  // its graph; runs before backward() returns.
  virtual void on_backward_end() = 0;
};

class GradReadyTracker {
 public:
  // Hooks the accumulators of `params` (leaves that require grad); indices
  // are positions in `params`. with_pre_hooks: also a hook before each
  // accumulation (listener->before_grad_accumulates).
  GradReadyTracker(const std::vector<at::Tensor>& params, std::weak_ptr<GradReadyListener> listener,
                   bool with_pre_hooks = false);
  GradReadyTracker(const GradReadyTracker&) = delete;
  GradReadyTracker& operator=(const GradReadyTracker&) = delete;

  size_t size() const { return accumulators_.size(); }

  // ---- per backward (REQUIRES: the caller's lock) ----
  // Queues listener->on_backward_end() for the end of the running backward,
  // once per backward: later calls before reset() do nothing. Call it from
  // on_grad_ready (the autograd engine takes callbacks only during backward).
  void arm_end_of_backward();
  // Records that index's gradient arrived in this backward; false if it
  // already had (reentrant backward).
  bool mark_arrived(size_t index) {
    if (arrived_[index]) return false;
    arrived_[index] = 1;
    return true;
  }
  // Whether arm_end_of_backward() ran since the last reset(). Still true
  // when the next forward starts means that backward failed before its end
  // (the engine drops the queued callback when the graph task fails).
  bool armed() const { return armed_; }
  // Per parameter, 1 if its gradient arrived in this backward.
  const std::vector<char>& arrived() const { return arrived_; }
  // Forgets the arrivals and the armed callback: the next backward starts.
  void reset();

  // ---- unused-parameter detection ----
  // The indices (ascending) of the parameters that `outputs` cannot reach
  // through the autograd graph (a walk from their gradient edges): their
  // gradients will not arrive in a backward from these outputs. Call after
  // a forward, before its backward.
  std::vector<size_t> unreachable_from(const std::vector<at::Tensor>& outputs) const;

 private:
  std::weak_ptr<GradReadyListener> listener_;
  std::vector<compat::GradAccumulatorPtr> accumulators_;  // hooks fire only while held
  std::vector<char> arrived_;
  bool armed_ = false;
};

}  // namespace tdist::detail
