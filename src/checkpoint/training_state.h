// A rank's training state in a Checkpointer's step folder
// (train_rank-R-of-W.pt): what a resumed run needs besides the model and
// optimizer to continue exactly where it stopped. A torch.save-compatible
// dict, so Python reads it too:
//   {"step": int, "world_size": int, "rank": int,
//    "rng_cpu": uint8 tensor (the default CPU generator's state),
//    "rng_cuda": [uint8 tensor per CUDA device],
//    "extras": {name: tensor},          # the user's
//    "tdist": {"format": 1, "kind": "train_state"}}
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/tensor_tree.h"

namespace tdist::detail {

struct TrainingStateFile {
  checkpoint::TensorSink sink;
  checkpoint::PtValue root;
};

// This rank's state now: the step, the RNGs' states, the extras (copied to
// host memory from `copies` when given).
TrainingStateFile build_training_state(int64_t step, int rank, int world_size,
                                       const std::map<std::string, at::Tensor>& extras,
                                       checkpoint::CopyPool* copies);
// Writes it to path (aside, synced, renamed into place).
void write_training_state(const std::string& path, TrainingStateFile& file);

struct TrainingState {
  int64_t step = 0;
  at::Tensor rng_cpu;
  std::vector<at::Tensor> rng_cuda;
  std::map<std::string, at::Tensor> extras;
};
// Reads one back; CheckpointError when it is not a training state of
// `step` (a file of another save, damaged, or not tdist's).
TrainingState read_training_state(const std::string& path, int64_t step);
// Sets the CPU generator's state, and each CUDA device's it has one for.
void restore_rng(const TrainingState& state);

}  // namespace tdist::detail
