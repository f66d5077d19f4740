// What DDP and FSDP do to a model at construction: check that every rank
// of the group holds the same parameters (names, shapes, dtypes, in the
// same order), and give every rank rank 0's values.
//
// Owns: nothing. Threading: collectives, on the caller's thread, in the
// same place on every rank.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "tdist/process_group.h"

namespace tdist::detail {

// Throws UsageError naming the first parameter where a rank's model differs
// from the group's first rank's; `who` starts the message.
void check_same_model(ProcessGroup& pg, const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                      const std::string& who = "DistributedDataParallel");

// Overwrites every tensor with rank 0's values (in place, without
// recording autograd history); empty tensors are skipped.
void broadcast_from_rank0(ProcessGroup& pg, const std::vector<at::Tensor>& tensors);
// The same from `root`.
void broadcast_from(ProcessGroup& pg, const std::vector<at::Tensor>& tensors, int root);

}  // namespace tdist::detail
