// The streaming half of the checkpoint tools (include/tdist/checkpoint_tools.h):
// what needs c10 only, so that tdist-ckpt runs without LibTorch.
// consolidate.cpp adds the libtorch format on top.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "checkpoint/sharded_files.h"
#include "tdist/checkpoint_tools.h"

namespace tdist::checkpoint {

// An optimizer tree's kind and groups as a safetensors file's metadata
// ("tdist.optimizer", "tdist.param_groups": the groups as JSON), which
// consolidate and convert write beside "optimizer/<param>/<field>".
std::map<std::string, std::string> optimizer_metadata(const PtValue& tree);

// Where a consolidation writes when no path is given.
std::string default_consolidated_path(const std::string& ckpt_prefix, CheckpointFormat format);

// consolidate_sharded_model_checkpoints for the pt and safetensors
// formats, streaming; UsageError for libtorch.
std::string consolidate_streaming(const std::string& ckpt_prefix, const std::string& ckpt_suffix,
                                  const std::string& save_path, const ConsolidateOptions& options);

// UsageError unless writing the file `path` leaves the checkpoint read
// from `files` (prefix, suffix) intact: `path` must not be one of its files
// (compared by device and inode, so a hard link or another spelling counts
// as the same file) nor a name its prefix and suffix match (a file that
// would join, and break, the set).
void check_output_file(const ShardedCheckpointFiles& files, const std::string& prefix, const std::string& suffix,
                       const std::string& path);

// UsageError unless writing `world_size` rank files under out_prefix (same
// suffix) leaves both checkpoints whole: no output may be an input or be
// named like one, and out_prefix may hold no rank file of another world
// size or of a rank past the new world (two checkpoints under one prefix
// load as neither). Files of this world size that are not inputs (an
// earlier reshard's) are replaced.
void check_output_prefix(const ShardedCheckpointFiles& files, const std::string& prefix, const std::string& suffix,
                         const std::string& out_prefix, int world_size);

// The records of each rank file that inspect does not otherwise show: any
// root entry besides model, shard_metadata, optimizer and tdist, and a
// comm_hook that is not empty; "PATH: NAME (WHAT)" each.
std::vector<std::string> other_records(const ShardedCheckpointFiles& files);

// The tdist tag's list `key` ("buffers", "modules") of rank 0's file.
std::vector<std::string> tag_names(const ShardedCheckpointFiles& files, const char* key);

// What `tdist-ckpt inspect PATH` reads. PATH is a checkpoint's prefix (its
// files are PATH + suffix), or a directory a Checkpointer made
// (checkpointer.h's layout): its root, whose `latest` marker names the
// newest checkpoint first (then the prefix is ROOT/<that folder>/model), or
// one of its step folders, which holds model + suffix files (then
// PATH/model). `from` says which of the two it was, for the user; empty for
// a prefix. A directory that is neither, unless files PATH + suffix exist
// beside it, is a CheckpointError; so is a marker that is not a regular
// file (a link, a FIFO: refused, never followed or waited on), is over 64
// KiB (read no further), holds a line that names no step folder, or names a
// folder that is not a directory in ROOT.
struct InspectTarget {
  std::string prefix;
  std::string from;
};
InspectTarget resolve_inspect_target(const std::string& path, const std::string& suffix);

}  // namespace tdist::checkpoint
