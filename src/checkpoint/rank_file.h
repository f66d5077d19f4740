// One rank's file of a sharded checkpoint (sharded_checkpoint.h), in two
// steps: built in memory, then written and committed together with the
// other ranks' files. save_sharded_checkpoint does both at once; the
// Checkpointer (checkpointer.h) builds with copies on the training thread
// and commits on its writer thread, over a group of its own.
#pragma once

#include <functional>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "checkpoint/tensor_tree.h"
#include "tdist/sharded_checkpoint.h"

namespace tdist::detail {

struct RankFileContents {
  checkpoint::TensorSink sink;
  checkpoint::PtValue root;
};

// This rank's file: model shards, shard metadata, optimizer shards, the
// hook's state. copies: every tensor copied to host memory from it now
// (the model may change while it is written); null: none copied. Collective only where settling FSDP
// units is.
RankFileContents build_rank_file(ProcessGroup& pg, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                         const ShardedCheckpointOptions& options, int64_t save_id, checkpoint::CopyPool* copies);

// How the local writing runs: given the work, runs it and returns (or
// raises what it raised). Empty: inline.
using WriteRunner = std::function<void(const std::function<void()>& work)>;

// Writes and syncs `file` under prefix (or reports `error`, when building
// it failed), then renames every rank's file into place once all are
// written: save_sharded_checkpoint's protocol. Collective over pg;
// CheckpointError on every rank when any rank failed. The writing and
// syncing (no collective) runs through run_write when given.
void commit_rank_files(const std::string& prefix, ProcessGroup& pg, RankFileContents* file, std::string error,
                       const ShardedCheckpointOptions& options, const WriteRunner& run_write = {});

// A fresh id for one save, the same on every rank (rank 0's). Collective.
int64_t agree_on_save_id(ProcessGroup& pg, std::chrono::milliseconds timeout);

}  // namespace tdist::detail
