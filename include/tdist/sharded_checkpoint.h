// Sharded checkpoints: every rank saves its own file, in torch_xla's layout
// ({prefix}_rank-{r}-of-{w}.pt holding "model", "shard_metadata" and
// "optimizer"), which Python's torch.load reads; resume loads them back
// (bit for bit); the checkpoint tools consolidate them into one full state
// dict or reshard them to another world size, streaming one tensor at a
// time.
//
//   tdist::save_sharded_checkpoint("ckpt/step100", *pg, *model, &opt);
//   ...
//   tdist::load_sharded_checkpoint("ckpt/step100", *pg, *model, &opt);    // at any world size
//   tdist::load_sharded_checkpoint("dcp/step100", *pg, *model, &opt);     // a DCP folder from PyTorch too
//   tdist::consolidate_sharded_model_checkpoints("ckpt/step100", "_rank-*-of-*.pt", "full.pt");
//
// Saving and loading are collective over `pg` (the model's ranks: FSDP's
// group, DDP's, or any group for a plain model). A save writes each rank's
// file to a temporary name, waits until every rank's is written and synced,
// then renames them into place: a crash or kill before that point leaves
// the previous checkpoint whole. Files of another world size under the same
// prefix (an older save's) are removed once the new ones are in place.
// Loading checks the files as a set (ranks 0..w-1 each once, one world
// size, one save), the model (every name and shape), the optimizer (kind,
// groups, names, shapes) and a hook's state before it changes anything. At the saving world size each rank
// reads only its own file; at another, each rank reads the rows it needs
// from the files that hold them, one piece at a time.
//
// Errors: CheckpointError naming the file and the problem; a rank that
// fails makes every rank's call fail (within options.timeout).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tdist/checkpoint_tools.h"
#include "tdist/errors.h"
#include "tdist/powersgd.h"
#include "tdist/process_group.h"
#include "tdist/state_dict.h"

namespace tdist {

// The files a sharded save writes. tdist: torch_xla's per-rank .pt files
// ({prefix}_rank-{r}-of-{w}.pt). dcp: PyTorch's Distributed Checkpoint
// folder (`prefix` is the folder: .metadata and __<rank>_<k>.distcp), which
// Python's torch.distributed.checkpoint.load reads into an FSDP2 or plain
// model at any world size (keys "model.<name>", "optim.state.<param>.<field>",
// "optim.param_groups.<i>.<key>", as get_state_dict names them) and
// dcp_to_torch_save turns into one file. A load reads either, whichever
// `prefix` holds.
enum class ShardedFormat { tdist, dcp };

struct ShardedCheckpointOptions {
  ShardedFormat format = ShardedFormat::tdist;
  // The per-rank file name after the prefix: the first '*' is the rank, the
  // second the world size (torch_xla's consolidation takes the same).
  std::string suffix = "_rank-*-of-*.pt";
  // A PowerSGD hook's state (error feedback, Q memories, RNG), saved with
  // each rank's file and loaded back; resuming it needs the same world size.
  std::shared_ptr<PowerSGDState> comm_hook_state;
  // How long a rank waits for the others at each step of a save or load;
  // it includes the slowest rank's writing or reading of its file, so give
  // large checkpoints on slow disks more.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
};

void save_sharded_checkpoint(const std::string& prefix, ProcessGroup& pg, torch::nn::Module& model,
                             torch::optim::Optimizer* optimizer = nullptr,
                             const ShardedCheckpointOptions& options = {});
void load_sharded_checkpoint(const std::string& prefix, ProcessGroup& pg, torch::nn::Module& model,
                             torch::optim::Optimizer* optimizer = nullptr,
                             const ShardedCheckpointOptions& options = {});

// A consolidated .pt file (format pt) read back: load_full_state_dict and
// load_full_optimizer_state_dict take its parts.
struct ConsolidatedCheckpoint {
  torch::OrderedDict<std::string, at::Tensor> model;
  bool has_optimizer = false;
  OptimizerStateDict optimizer;
};
ConsolidatedCheckpoint load_consolidated_checkpoint(const std::string& path);

}  // namespace tdist
