// The check DDP runs at construction: every rank of the group holds the
// same parameters (names, shapes, dtypes, in the same order).
//
// Owns: nothing. Threading: a collective (two all_gathers), on the
// caller's thread, in the same place on every rank.
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

}  // namespace tdist::detail
