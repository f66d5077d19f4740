// A DCP checkpoint (PyTorch's torch.distributed.checkpoint folder) read
// into this rank's part of a model and its optimizer: what
// load_sharded_checkpoint does when given such a folder (the contract is
// in include/tdist/sharded_checkpoint.h).
//
// Each rank reads only the chunks that overlap the rows it keeps (a unit
// parameter's rows under FSDP; the whole tensor for a plain or DDP
// model). Names go through dcp_layout.h (Python's roots and wrappers
// removed); the optimizer state is by parameter name or, as
// optimizer.state_dict() keys it, by index in the optimizer's order; its
// param groups' options ("betas" as beta1 and beta2; flags as 0/1) map
// onto tdist's. Nothing is changed here: the caller checks and applies.
//
// Errors: CheckpointError naming the folder and what differs.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <string>

#include "tdist/process_group.h"
#include "tdist/state_dict.h"

namespace tdist::checkpoint {

struct DcpStaged {
  ShardedStateDict model;
  std::optional<OptimizerStateDict> optimizer;
  int64_t save_id = 0;  // the same on every rank that read the same .metadata
};

DcpStaged stage_dcp(const std::string& dir, ProcessGroup& pg, torch::nn::Module& model,
                    torch::optim::Optimizer* optimizer);

}  // namespace tdist::checkpoint
