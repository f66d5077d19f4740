// A sharded checkpoint's tensors (sharded_files.h) read into LibTorch
// tensors, whole or by rows: what loads into a model use.
//
// Errors: CheckpointError naming the file and the problem.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "checkpoint/sharded_files.h"

namespace tdist::checkpoint {

// The full tensor.
at::Tensor read_full(const ShardedCheckpointFiles& files, const LogicalTensor& t);
// Rows [first, first + rows) of the full tensor (a 0-d one: whole when
// rows is 1, an empty [0] when 0), reading only the pieces that hold them.
at::Tensor read_rows(const ShardedCheckpointFiles& files, const LogicalTensor& t, int64_t first, int64_t rows);

}  // namespace tdist::checkpoint
