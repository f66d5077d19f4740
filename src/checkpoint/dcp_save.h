// A model and its optimizer saved as a DCP folder (PyTorch's
// torch.distributed.checkpoint layout, dcp_metadata.h): what
// save_sharded_checkpoint does with ShardedCheckpointOptions::format =
// ShardedFormat::dcp. Python's dcp.load reads it into an FSDP2 (or any)
// model at any world size, and dcp_to_torch_save into one file.
//
// The keys are what PyTorch's get_state_dict gives for the same model:
// "model.<name>" (every name of a tied tensor, its bytes stored once) and
// "optim.state.<param>.<field>" ("step" a float32 0-d tensor, as
// PyTorch's optimizers keep it), "optim.param_groups.<i>.<key>" with
// PyTorch's keys for the optimizer's kind ("betas" as a tuple; the flags
// tdist has no use for at PyTorch's defaults) and "params" the parameters'
// names. A unit parameter's rows are a chunk of the rank holding them;
// anything every rank holds whole is written by rank 0.
//
// Crash-safe: each rank writes __<rank>_<k>.distcp aside (k chosen so that
// no file the folder's current .metadata names is touched), all sync,
// then rename; rank 0 writes the new .metadata last (aside, fsync,
// rename): until then the folder's previous checkpoint loads. Files of
// older saves are removed after. Collective over `pg`; a rank that fails
// makes every rank's call fail (CheckpointError), within `timeout`.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <string>

#include "tdist/process_group.h"

namespace tdist::checkpoint {

void save_dcp(const std::string& dir, ProcessGroup& pg, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
              std::chrono::milliseconds timeout);

}  // namespace tdist::checkpoint
