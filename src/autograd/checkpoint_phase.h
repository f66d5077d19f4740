// Where the thread is with respect to checkpoint_module: in a checkpointed
// forward (gradients off, activations dropped), or re-running one in
// backward. FSDP units nested in a checkpointed module read it: in the
// first run they still join the iteration's order (their gradients will
// come), in the second they gather as for their backward.
#pragma once

namespace tdist::detail {

enum class CheckpointPhase { kNone, kForward, kRecompute };

CheckpointPhase checkpoint_phase();

// Sets the phase for its lifetime.
class CheckpointPhaseGuard {
 public:
  explicit CheckpointPhaseGuard(CheckpointPhase phase);
  ~CheckpointPhaseGuard();
  CheckpointPhaseGuard(const CheckpointPhaseGuard&) = delete;
  CheckpointPhaseGuard& operator=(const CheckpointPhaseGuard&) = delete;

 private:
  CheckpointPhase previous_;
};

}  // namespace tdist::detail
