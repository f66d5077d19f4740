// Where the thread is with respect to activation checkpointing
// (checkpoint_module): in a checkpointed forward (gradients off,
// activations dropped), or recomputing one in backward. FSDP units nested in a checkpointed module read it: in the
// first run they still join the iteration's order (their gradients will
// come), in the second they gather as for their backward.
#pragma once

namespace tdist::detail {

enum class RecomputePhase { kNone, kForward, kRecompute };

RecomputePhase recompute_phase();

// Sets the phase for its lifetime.
class RecomputePhaseGuard {
 public:
  explicit RecomputePhaseGuard(RecomputePhase phase);
  ~RecomputePhaseGuard();
  RecomputePhaseGuard(const RecomputePhaseGuard&) = delete;
  RecomputePhaseGuard& operator=(const RecomputePhaseGuard&) = delete;

 private:
  RecomputePhase previous_;
};

}  // namespace tdist::detail
