// The checkpoint tools over a sharded checkpoint's per-rank files:
// consolidation into one full state dict, resharding to another world
// size, inspection. Declared apart from the rest of the checkpoint API
// because the tools need no LibTorch (only c10's dtypes): tdist-ckpt runs
// them in a process of a few MiB whatever the model. (Here, in libtdist,
// consolidate_sharded_model_checkpoints also writes the libtorch format,
// which needs LibTorch; tdist-ckpt calls the streaming part directly and
// runs tdist-ckpt-libtorch for that one.)
//
//   tdist::consolidate_sharded_model_checkpoints("ckpt/step100", "_rank-*-of-*.pt", "full.pt");
//   tdist::reshard_sharded_checkpoint("ckpt/step100", "_rank-*-of-*.pt", 4, "ckpt/step100_world-4");
//
// Each streams: the bytes go from the ranks' files to the output in 1 MiB
// chunks, every record's CRC checked; nothing is renamed into place
// until all of it has been read and checked.
//
// Errors: CheckpointError naming the file and the problem; UsageError for
// bad arguments.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tdist {

enum class CheckpointFormat {
  pt,           // {"model": ..., "optimizer": ...}: torch.load in Python, load_consolidated_checkpoint in C++
  safetensors,  // the model's tensors by name (with optimizer: "optimizer/<param>/<field>" too)
  libtorch,     // torch::save's archive of the model's tensors: torch::load(module, path) (not streaming)
};

struct ConsolidateOptions {
  CheckpointFormat format = CheckpointFormat::pt;
  bool optimizer = false;  // also the full optimizer state, by parameter name
};

// Merges a sharded checkpoint's files into one full state dict (the names
// of the unwrapped model, padding stripped). pt and safetensors stream (a
// few MiB in memory, whatever the model); libtorch holds the model whole
// (torch::serialize's archive) and needs libtdist. save_path "" means
// ckpt_prefix + "_consolidated.pt" (".safetensors", ".libtorch.pt").
// Returns the path written.
std::string consolidate_sharded_model_checkpoints(const std::string& ckpt_prefix,
                                                  const std::string& ckpt_suffix = "_rank-*-of-*.pt",
                                                  const std::string& save_path = "",
                                                  const ConsolidateOptions& options = {});

// Writes the checkpoint again for `world_size` ranks (1 to 65536) as FSDP
// lays them out (rows_per_rank = ceil(rows / world_size)), model and
// optimizer, under out_prefix with the same suffix; streaming like
// consolidation.
//
// Neither tool overwrites its input: an output that resolves to one of the
// checkpoint's files (another spelling of its path, a hard link) or is
// named like one is a UsageError, and so is an out_prefix that already
// holds rank files of another world size (two checkpoints under one prefix
// load as neither). Files of this world size there (an earlier reshard's)
// are replaced.
void reshard_sharded_checkpoint(const std::string& ckpt_prefix, const std::string& ckpt_suffix, int world_size,
                                const std::string& out_prefix);

// What a sharded checkpoint holds.
struct CheckpointTensorInfo {
  std::string name;  // model entry, or "<param>/<field>" of the optimizer state
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::kFloat;
  int64_t bytes = 0;
  bool sharded = false;
};
struct ShardedCheckpointInfo {
  int world_size = 0;
  std::vector<std::string> files;
  std::vector<std::string> units;  // the FSDP units' prefixes ("" for the outermost)
  std::vector<CheckpointTensorInfo> model;
  std::string optimizer;  // its kind, or empty
  std::vector<CheckpointTensorInfo> optimizer_state;
  // Records of the files that the above does not show, "PATH: NAME (WHAT)":
  // a non-empty comm_hook, and any root entry tdist does not write.
  std::vector<std::string> other_records;
};
ShardedCheckpointInfo inspect_sharded_checkpoint(const std::string& ckpt_prefix,
                                                 const std::string& ckpt_suffix = "_rank-*-of-*.pt");

}  // namespace tdist
