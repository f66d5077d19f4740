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
#include <functional>
#include <string>
#include <vector>

#include "formats/dcp_metadata.h"
#include "checkpoint/tensor_tree.h"
#include "tdist/process_group.h"

namespace tdist::checkpoint {

void save_dcp(const std::string& dir, ProcessGroup& pg, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
              std::chrono::milliseconds timeout);

// save_dcp in two steps, for the Checkpointer (which builds on the training
// thread and commits on its writer): what this rank writes (each tensor a
// host copy from `copies` when given, else the live tensor), then written
// and committed as above. Building is collective where settling FSDP units
// is; commit_dcp is collective over pg (`error`: building failed on this
// rank; every rank then fails). The writing runs through run_write when
// given.
struct DcpPlannedItem {
  std::string fqn;
  std::vector<dcp::Item::Part> path;
  at::Tensor tensor;  // a chunk; undefined for a value
  std::vector<int64_t> size, offsets;
  PtValue value;
};
struct DcpRankContents {
  std::vector<DcpPlannedItem> items;
};
DcpRankContents build_dcp_rank(ProcessGroup& pg, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                               CopyPool* copies);
using DcpWriteRunner = std::function<void(const std::function<void()>& work)>;
void commit_dcp(const std::string& dir, ProcessGroup& pg, const DcpRankContents* contents, std::string error,
                std::chrono::milliseconds timeout, const DcpWriteRunner& run_write = {});

}  // namespace tdist::checkpoint
