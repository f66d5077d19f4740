// What FSDP's get_shard_metadata() reports and sharded checkpoints carry:
// how each parameter's rows are spread over the ranks. Plain structs, free
// of LibTorch, so that the checkpoint tools can read them without it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tdist {

// What get_shard_metadata() reports: enough to put the full parameters
// back together from every rank's shards (the checkpoint code reads it).
struct ShardedParamInfo {
  std::string name;           // in the wrapped model (as named_parameters() says)
  std::string original_name;  // the same without the wrappers' "module." steps
  std::vector<int64_t> shape;        // full
  std::vector<int64_t> shard_shape;  // this rank's
  int64_t numel = 0;                 // full
  int64_t first_row = 0;             // the shard's first row in the full parameter
  int64_t rows_per_rank = 0;         // every rank's shard is this many rows, padded
  int64_t padding_rows = 0;          // rows_per_rank * world_size - rows
  bool requires_grad = true;
  // A tied parameter's other original names, in model order (in memory
  // only: checkpoint files carry the model's names themselves).
  std::vector<std::string> aliases = {};
};
struct ShardedUnitInfo {
  std::string prefix;  // where the wrapper sits in the model ("" for the outermost)
  bool sharded = true;  // false for NO_SHARD units (every rank holds everything)
  std::vector<ShardedParamInfo> params;
};
struct ShardMetadata {
  int world_size = 1;
  int rank = 0;
  std::vector<ShardedUnitInfo> units;  // the wrappers in the model, outermost first
};

}  // namespace tdist
