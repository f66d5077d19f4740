// State dicts: a model's parameters and buffers by the names of the
// unwrapped model (no "module." steps of FSDP, DDP or checkpoint_module
// wrappers), so that they load into the plain module.
//
//   auto full = tdist::full_state_dict(*model);        // FSDP: gathered unit by unit, to rank 0
//   if (rank == 0) tdist::save_safetensors("model.safetensors", full);
//   tdist::load_full_state_dict(*model, full);         // any world size: each rank keeps its rows
//
//   auto local = tdist::sharded_state_dict(*model);    // this rank's shards + get_shard_metadata()
//   tdist::load_sharded_state_dict(*model, local);     // the same world size and layout
//
// `model` is the module itself (`*fsdp`, `*ddp`, `*net`). For FSDP models
// the full state dict and its load are collective (every rank calls them,
// between iterations); rank 0 holds at most one unit gathered besides the
// result. Without FSDP they are local. Loading checks that the state holds
// every name of the model with its shape, and (strict) nothing else, and
// names the first that does not: a CheckpointError. Values are copied into
// the model's own tensors (converted to their dtype, as load_state_dict
// does), so optimizers built on them stay valid.
//
// Tied parameters (one tensor registered under several names, as GPT-2's
// lm_head.weight is its transformer.wte.weight): the full state dict lists
// every name, one tensor under each (as Python's state_dict()); the sharded
// state dict, and so sharded checkpoints, hold it once, under its first
// name in model order. Loading wants at least one of its names (Hugging
// Face files drop lm_head.weight); two present with different values are a
// CheckpointError naming both.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <map>
#include <string>
#include <vector>

#include "tdist/errors.h"
#include "tdist/fsdp.h"

namespace tdist {

using StateDict = torch::OrderedDict<std::string, at::Tensor>;

// Whole parameters and buffers, in the unwrapped model's order (each
// module's parameters, then its buffers, then its children's). With
// rank0_only (FSDP), other ranks get an empty dict.
StateDict full_state_dict(torch::nn::Module& model, bool rank0_only = true);
void load_full_state_dict(torch::nn::Module& model, const StateDict& state, bool strict = true);

// This rank's part: each FSDP parameter as this rank's rows of it (what
// get_shard_metadata describes), everything else whole.
struct ShardedStateDict {
  StateDict tensors;
  ShardMetadata metadata;  // world_size 1 and no units without FSDP
};
ShardedStateDict sharded_state_dict(torch::nn::Module& model);
// REQUIRES the model sharded as it was when `state` was taken (same world
// size and rank; a CheckpointError says what differs). To move a state to
// another world size, go through the full state dict (or, streaming, the
// checkpoint tools).
void load_sharded_state_dict(torch::nn::Module& model, const ShardedStateDict& state, bool strict = true);

// ---- optimizer state, by parameter name ----------------------------------
// Adam, AdamW, SGD, RMSprop and Adagrad (another optimizer: UsageError).
// Each parameter's state is named tensors shaped like the parameter
// ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
// "square_avg", "grad_avg", "sum") and "step", a 0-d int64 tensor; each
// param group keeps its options by name ("lr", "beta1", "beta2", "eps",
// "weight_decay", "amsgrad", "momentum", ...; flags as 0/1) and its
// parameters' names. Under FSDP the full state gathers each state tensor
// like its parameter (to rank 0 by default) and loading keeps this rank's
// rows, so it moves across world sizes; the sharded state is this rank's
// rows as they are. `model` is the one whose parameters `opt` steps.
// Loading replaces the optimizer's whole state (a parameter the state has
// nothing for starts afresh) after checking the optimizer's kind, every
// parameter name, group and shape. The sharded dicts (model and optimizer)
// alias the live tensors, which the next step changes: clone to keep them.
struct OptimizerParamGroupState {
  std::map<std::string, double> options;
  std::vector<std::string> params;
};
struct OptimizerStateDict {
  std::string optimizer;  // "Adam", "AdamW", "SGD", "RMSprop", "Adagrad": loads only into the same
  // Sharded: the world size and rank it was taken at, which its load
  // requires; full: 1 and 0 (it loads at any world size).
  int world_size = 1;
  int rank = 0;
  torch::OrderedDict<std::string, StateDict> state;  // parameters without state (never stepped) are absent
  std::vector<OptimizerParamGroupState> param_groups;
};
OptimizerStateDict full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                             bool rank0_only = true);
void load_full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                    const OptimizerStateDict& state);
OptimizerStateDict sharded_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& opt);
void load_sharded_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                       const OptimizerStateDict& state);

}  // namespace tdist
