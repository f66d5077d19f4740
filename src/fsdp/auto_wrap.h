// Auto wrapping: the walk that puts the children auto_wrap_policy picks in
// wrappers of their own, before the outer wrapper takes what is left.
#pragma once

#include <torch/nn/module.h>

#include <string>

#include "tdist/fsdp.h"

namespace tdist::detail {

// Walks `root`'s children (not root itself), children first, as the policy
// says, and replaces each module it picks, which must be an entry of a
// torch::nn::Sequential, by options.auto_wrapper_callable's wrapper (or
// FullyShardedDataParallel) in its Sequential. UsageError naming a picked
// module that is not a Sequential entry. Modules already wrapped, and
// their subtrees, are left alone and not counted. label: how errors name
// the outer wrapper.
void auto_wrap_children(torch::nn::Module& root, const FullyShardedDataParallelOptions& options,
                        const std::string& label);

}  // namespace tdist::detail
