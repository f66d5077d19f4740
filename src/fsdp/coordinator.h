// Coordinator: one iteration of a model with FSDP units, as the outermost
// wrapper sees it: the forward order of its units, their backward
// (gather before it, prefetch the next, reduce in a fixed order, free),
// and the end of backward.
//
// Order: every rank issues its collectives in the same order, because the
// gathers follow the autograd graph and the reductions are launched in
// reverse forward order only (a unit ready early waits for the ones before
// it); units still unreduced when backward ends are reduced then, in the
// same order, with zeros for gradients they never got. A unit's reduction
// is launched after the ones in flight have finished, unless it takes no
// memory of its own (without sharding, in the gradients' own dtype): then
// it is queued behind them.
//
// Owns: the forward order (shared references to the units' states, the
// owner's own among them, until forget_units()).
// Threading: the training thread, as FsdpState.
// Lifetime: owned by the outermost wrapper's state; the queued end-of-
// backward callback holds it weakly. The wrapper's destructor calls
// forget_units(), which breaks the cycle through its own state.
#pragma once

#include <memory>
#include <vector>

namespace tdist::detail {

struct FsdpState;

class Coordinator : public std::enable_shared_from_this<Coordinator> {
 public:
  // The outermost wrapper's forward starts: whatever the last iteration
  // left (a forward without backward, a backward that failed part-way) is
  // waited out, its set-aside gradients put back, and every unit resharded.
  void begin_iteration();
  // A unit's forward with gradients on starts (once per unit per iteration).
  void record_forward(FsdpState& s);
  // Gathers s for its forward, and starts its forward prefetch: the unit
  // that followed s in the last iteration, or the units s names. With a
  // prefetch, s's gather and the prefetch are queued for the group's
  // worker before s's is waited for: on the CPU nothing runs ahead of a
  // wait (as a GPU's launches do), so a prefetch started after it would
  // leave the link idle from the end of s's gather to the end of s's
  // forward, and the worker runs the two back to back, with no hand-over
  // between threads.
  FsdpState* next_in_last_forward(const FsdpState& s) const;
  void gather_for_forward(FsdpState& s);
  // Backward reached one of s's outputs.
  void pre_backward(FsdpState& s);
  // s's tracked gradients have all arrived.
  void unit_ready(FsdpState& s);
  // A gradient is about to accumulate: the reductions that have finished in
  // the meantime hand their shards over and free their full gradients now
  // rather than at the next launch (the memory peak is inside a unit's
  // backward).
  void poll_in_flight();
  // Waits for the reductions in flight and hands their shards over: before
  // a sharded unit takes its gradient buffer, so that at most one unit's
  // full gradients exist besides the accumulating ones (the ZeRO bounds
  // allow one). A unit without sharding takes none, so its backward runs
  // while the units before it in backward are reduced, and its reduction,
  // when it takes no memory of its own either (ShardedUnit::
  // reduces_in_place), is queued behind theirs (launch): the group's worker
  // runs them back to back, with no wait for the training thread between.
  void finish_in_flight();
  // The queued callback at the end of backward.
  void end_of_backward();
  // Whether a backward has started and not ended.
  bool in_backward() const { return backward_started_; }
  // Every unit of this iteration: waited out and resharded (summon, and
  // begin_iteration, which keeps the units that set_reshard_after_backward
  // keeps gathered for the next forward).
  void settle(bool keep_gathered = false);
  // Drops its references to the units' states: the wrapper that owns it is
  // going away (its own state is among them: a cycle otherwise).
  void forget_units();

  bool require_sync = true;  // no_sync() clears it for the whole model

 private:
  // Whether s's gradients are reduced in this backward (else kept full).
  bool syncs(const FsdpState& s) const;
  // Starts gathering the units s names (set_modules_to_*_prefetch).
  void prefetch(const std::vector<std::weak_ptr<FsdpState>>& units);
  void prefetch_one(FsdpState& s);
  // Reshards the units prefetched in this iteration that did not run in
  // it (a gather from before the optimizer's step must not be used).
  void drop_unused_prefetches();
  // After a unit's own gather failed: the prefetches queued behind it are
  // waited out quietly and dropped (not rethrown at the next forward).
  void drop_failed_prefetches() noexcept;
  void launch_ready_in_order();
  // Whether s's full parameters are freed once its gradients are all in
  // (not under SHARD_GRAD_OP, nor while a frozen parameter's backward may
  // still read them, nor when kept gathered for the next forward).
  bool reshards_when_ready(const FsdpState& s) const;
  // Whether a unit of this forward has not begun its backward (may gather).
  bool gathers_left() const;
  void launch(FsdpState& s);
  void reset_flags();

  std::vector<std::shared_ptr<FsdpState>> order_;       // this iteration's forward order
  std::vector<std::shared_ptr<FsdpState>> last_order_;  // the last iteration's
  size_t launched_ = 0;                                 // units reduced, counted from the end of order_
  // The units whose reductions may still run, in launch order: more than
  // one only without sharding (a sharded unit's launch waits for them).
  std::vector<FsdpState*> in_flight_;
  std::vector<std::weak_ptr<FsdpState>> prefetched_;    // started gathering ahead, this iteration
  bool backward_started_ = false;
};

// The Coordinator of the forward running on this thread (null outside one).
Coordinator* active_coordinator();
void set_active_coordinator(Coordinator* c);

}  // namespace tdist::detail
