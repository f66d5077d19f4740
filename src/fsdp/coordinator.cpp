// Coordinator: the forward order, the backward of the units, the end of
// backward. The contract is in coordinator.h.
#include "fsdp/coordinator.h"

#include <algorithm>

#include <torch/csrc/autograd/engine.h>

#include "autograd/weight_fence.h"
#include "fsdp/block_pool.h"
#include "fsdp/fsdp_state.h"
#include "process_group/async_ops.h"
#include "trace/flight_recorder.h"
#include "trace/timeline.h"

namespace tdist::detail {

namespace {
thread_local Coordinator* t_active = nullptr;
}  // namespace

Coordinator* active_coordinator() { return t_active; }
void set_active_coordinator(Coordinator* c) { t_active = c; }

void FsdpState::before_grad_accumulates(size_t index) {
  // The reduction in flight ends (and its buffer goes back to the pool)
  // before this unit takes its gradient buffer from it (not now when it
  // has one, or takes it late, or takes none: without sharding the
  // gradients accumulate in autograd's tensors and are reduced in them,
  // so this unit's backward runs while the ones before it are reduced).
  if (auto c = current.lock()) {
    if (!unit->sharded() || unit->has_grad_buffer() || unit->late_grad_buffer()) {
      c->poll_in_flight();
    } else {
      c->finish_in_flight();
    }
  }
  unit->set_aside_grad(tracked[index]);
}

void FsdpState::on_grad_ready(size_t index) {
  if (!tracker->mark_arrived(index)) return;
  if (++arrived < tracker->size()) return;
  if (auto c = current.lock()) c->unit_ready(*this);
}

void Coordinator::reset_flags() {
  for (auto& s : order_) {
    s->phase = FsdpState::Phase::kIdle;
    s->arrived = 0;
    if (s->tracker) s->tracker->reset();
  }
}

bool Coordinator::syncs(const FsdpState& s) const { return require_sync && s.requires_gradient_sync; }

bool Coordinator::reshards_when_ready(const FsdpState& s) const {
  return s.reshard_after_forward && (s.reshard_after_backward || syncs(s)) && !s.unit->has_frozen();
}

void Coordinator::prefetch_one(FsdpState& s) {
  if (s.unit->unsharded() || s.unit->gathering()) return;
  const detail::AsyncOpsScope async;  // a prefetch: the worker runs it while this unit computes
  s.unit->start_unshard();
  prefetched_.push_back(s.weak_from_this());
}

void Coordinator::prefetch(const std::vector<std::weak_ptr<FsdpState>>& units) {
  for (const auto& w : units) {
    if (auto t = w.lock()) prefetch_one(*t);
  }
}

void Coordinator::drop_unused_prefetches() {
  for (const auto& w : prefetched_) {
    auto t = w.lock();
    if (t && !t->recorded() && !t->summoned) t->unit->reshard();
  }
  prefetched_.clear();
}

void Coordinator::gather_for_forward(FsdpState& s) {
  std::vector<FsdpState*> ahead;
  if (s.forward_prefetch_units) {
    for (const auto& w : *s.forward_prefetch_units) {
      if (auto t = w.lock()) ahead.push_back(t.get());
    }
  } else if (s.options.forward_prefetch) {
    if (FsdpState* next = next_in_last_forward(s)) ahead.push_back(next);
  }
  const auto needs_gather = [](const FsdpState* t) { return !t->unit->unsharded() && !t->unit->gathering(); };
  if (std::any_of(ahead.begin(), ahead.end(), needs_gather)) {
    const detail::AsyncOpsScope async;
    s.unit->start_unshard();
    for (FsdpState* t : ahead) prefetch_one(*t);
  }
  try {
    s.unit->finish_unshard();
  } catch (...) {
    drop_failed_prefetches();
    throw;
  }
}

void Coordinator::drop_failed_prefetches() noexcept {
  for (const auto& w : prefetched_) {
    if (auto t = w.lock(); t && t->unit->gathering()) t->unit->drop_in_flight();
  }
}

void Coordinator::settle(bool keep_gathered) {
  drop_unused_prefetches();
  const bool dirty = backward_started_;
  for (auto& s : order_) {
    if (dirty || s->unit->reducing() || s->unit->gathering()) {
      s->unit->drop_in_flight();
    } else if (!keep_gathered || !s->kept_after_backward) {
      s->unit->reshard();  // else kept gathered for the next forward (set_reshard_after_backward)
    }
    s->kept_after_backward = false;
  }
  in_flight_.clear();
  backward_started_ = false;
}

void Coordinator::forget_units() {
  order_.clear();
  last_order_.clear();
  in_flight_.clear();
  launched_ = 0;
}

void Coordinator::begin_iteration() {
  settle(/*keep_gathered=*/true);
  reset_flags();
  if (!order_.empty()) last_order_ = std::move(order_);
  order_.clear();
  launched_ = 0;
}

void Coordinator::record_forward(FsdpState& s) {
  if (s.recorded()) return;
  s.phase = FsdpState::Phase::kRecorded;
  s.order_index = order_.size();
  order_.push_back(s.shared_from_this());
}

FsdpState* Coordinator::next_in_last_forward(const FsdpState& s) const {
  for (size_t i = 0; i + 1 < last_order_.size(); ++i) {
    if (last_order_[i].get() == &s) return last_order_[i + 1].get();
  }
  return nullptr;
}

void Coordinator::pre_backward(FsdpState& s) {
  if (!s.recorded()) return;  // a second backward through this iteration's graph
  if (!backward_started_) {
    backward_started_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([weak = weak_from_this()] {
      if (auto c = weak.lock()) c->end_of_backward();
    });
  }
  if (s.backward_began()) return;
  s.phase = FsdpState::Phase::kBackwardBegan;
  // The outermost unit stays gathered through the backward: with units
  // inside it, whose backwards come between its first gradients and its
  // last, its gradient buffer is taken only for its reduction (unit.h),
  // where it reuses the block of the full parameters freed when the unit
  // is ready (so not when they stay). Not in a backward without
  // reduction: its gradients stay full, accumulating over backwards in
  // the buffer's reduce dtype, not in autograd's (the compute dtype).
  s.unit->set_late_grad_buffer(s.is_root && order_.size() > 1 && syncs(s) && reshards_when_ready(s));
  s.backward_began_ns = Timeline::active() ? fr_now_ns() : 0;
  s.unit->finish_unshard();
  if (s.backward_prefetch_units) {
    prefetch(*s.backward_prefetch_units);
  } else if (s.options.backward_prefetch == BackwardPrefetch::BACKWARD_PRE && s.order_index > 0) {
    FsdpState& next = *order_[s.order_index - 1];
    if (!next.backward_began()) prefetch_one(next);
  }
}

void Coordinator::unit_ready(FsdpState& s) {
  if (!s.recorded() || s.gradients_ready()) return;
  s.phase = FsdpState::Phase::kGradientsReady;
  if (Timeline* tl = Timeline::active(); tl && s.backward_began_ns > 0) {
    tl->complete("compute", "backward " + s.unit->trace_name(), s.backward_began_ns, fr_now_ns());
    s.backward_began_ns = 0;
  }
  // Its backward is over: the full parameters can go (before the
  // reduction takes its buffer, which may reuse their block), unless a
  // frozen parameter's backward (which reads them but reports nothing) may
  // still be to come.
  if (reshards_when_ready(s)) s.unit->reshard();
  launch_ready_in_order();
  // Nothing gathers again before the next forward: the pool's free blocks
  // go (block_pool.h), once the reduction just launched took its buffer
  // (the block the reshard above gave back, for the outermost unit).
  if (!gathers_left()) release_pooled_blocks();
}

bool Coordinator::gathers_left() const {
  for (const auto& t : order_) {
    if (!t->backward_began()) return true;
  }
  return false;
}

void Coordinator::poll_in_flight() {
  size_t done = 0;
  while (done < in_flight_.size() && in_flight_[done]->unit->reduce_done()) ++done;
  if (done == 0) return;
  // Erased first: a finish that throws leaves none of them in the list.
  const std::vector<FsdpState*> finished(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(done));
  in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(done));
  for (FsdpState* s : finished) s->unit->finish_reduce();
}

void Coordinator::finish_in_flight() {
  const std::vector<FsdpState*> all = std::move(in_flight_);
  in_flight_.clear();
  for (FsdpState* s : all) s->unit->finish_reduce();
}

void Coordinator::launch(FsdpState& s) {
  if (s.unit->reduces_in_place()) {
    poll_in_flight();
  } else {
    finish_in_flight();  // its buffer or converted copy: at most one besides the accumulating gradients
  }
  s.unit->start_reduce();
  in_flight_.push_back(&s);
}

void Coordinator::launch_ready_in_order() {
  while (launched_ < order_.size()) {
    FsdpState& s = *order_[order_.size() - 1 - launched_];
    if (!s.gradients_ready()) return;
    if (syncs(s)) launch(s);  // else its full gradients stay (end_of_backward)
    ++launched_;
  }
}

void Coordinator::end_of_backward() {
  while (launched_ < order_.size()) {
    FsdpState& s = *order_[order_.size() - 1 - launched_];
    if (syncs(s)) {
      // Never ready (a parameter got no gradient): freed now, before its
      // reduction takes a buffer (a late one reuses their block).
      if (reshards_when_ready(s)) s.unit->reshard();
      launch(s);
    }
    ++launched_;
  }
  // A checkpoint's pending copy of the weights, while the reductions
  // travel: the optimizer's step comes next (autograd/weight_fence.h).
  detail::wait_weight_fences();
  for (auto& s : order_) {
    if (syncs(*s)) {
      s->unit->finish_reduce();
    } else {
      s->unit->set_aside_shard_grads();
      s->unit->keep_full_grads();
    }
  }
  in_flight_.clear();
  // A unit stays gathered only while its gradients stay full: one whose
  // gradients were reduced now holds shard gradients, which the optimizer
  // steps with the shards.
  for (auto& s : order_) {
    if (s->reshard_after_backward || syncs(*s)) {
      s->unit->reshard();
    } else {
      s->kept_after_backward = true;
    }
  }
  drop_unused_prefetches();
  backward_started_ = false;
  reset_flags();
  // The order stays for the next iteration's forward prefetch and cleanup.
  launched_ = order_.size();
}

}  // namespace tdist::detail
