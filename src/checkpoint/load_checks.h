// The checking halves of the sharded loads: everything
// load_sharded_state_dict and load_sharded_optimizer_state_dict check
// before they change anything, without changing anything, so that a
// checkpoint load can check every part before it applies any.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "tdist/state_dict.h"

namespace tdist::checkpoint {

// CheckpointError as the loads would raise it; nothing changes.
void check_sharded_model_state(torch::nn::Module& model, const ShardedStateDict& state);
void check_sharded_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                   const OptimizerStateDict& state);
// load_sharded_optimizer_state_dict of a state the caller gives away (a
// checkpoint load's staged state, dropped after): its tensors become the
// optimizer's where they are on the parameter's device in its dtype, no
// second copy (a rank's load then holds its shard once, not twice).
void adopt_sharded_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                   const OptimizerStateDict& state);

}  // namespace tdist::checkpoint
