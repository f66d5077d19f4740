// The streaming half of the checkpoint tools (include/tdist/checkpoint_tools.h):
// what needs c10 only, so that tdist-ckpt runs without LibTorch.
// consolidate.cpp adds the libtorch format on top.
#pragma once

#include <string>
#include <vector>

#include "checkpoint/sharded_files.h"
#include "tdist/checkpoint_tools.h"

namespace tdist::checkpoint {

// Where a consolidation writes when no path is given.
std::string default_consolidated_path(const std::string& ckpt_prefix, CheckpointFormat format);

// consolidate_sharded_model_checkpoints for the pt and safetensors
// formats, streaming; UsageError for libtorch.
std::string consolidate_streaming(const std::string& ckpt_prefix, const std::string& ckpt_suffix,
                                  const std::string& save_path, const ConsolidateOptions& options);

// The tdist tag's list `key` ("buffers", "modules") of rank 0's file.
std::vector<std::string> tag_names(const ShardedCheckpointFiles& files, const char* key);

}  // namespace tdist::checkpoint
