// Auto wrapping: the walk that puts the children auto_wrap_policy picks in
// wrappers of their own, before the outer wrapper takes what is left.
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <unordered_set>

#include "tdist/fsdp.h"

namespace tdist::detail {

// Walks `root`'s children (not root itself), children first, as the policy
// says, and replaces each module it picks, which must be an entry of a
// torch::nn::Sequential, by options.auto_wrapper_callable's wrapper (or
// FullyShardedDataParallel) in its Sequential. UsageError naming a picked
// module that is not a Sequential entry. Modules already wrapped, and
// their subtrees, are left alone and not counted. label: how errors name
// the outer wrapper.
//
// Tied and shared parameters: a parameter that a picked module's subtree
// shares with modules of root's tree outside it (a tensor registered in
// both, e.g. an LM head's weight that is the embedding's) is left out of
// the picked module's unit: the wrapper covering every use owns it (the
// outer wrapper's collect takes it, unclaimed, from inside the inner
// wrappers too), so the lowest unit around all its uses holds it once.
void auto_wrap_children(torch::nn::Module& root, const FullyShardedDataParallelOptions& options,
                        const std::string& label);

// While auto_wrap_children builds a picked module's wrapper: the
// parameters (by TensorImpl) that wrapper must leave to an outer one; null
// otherwise. Thread-local (wrappers are built on the constructing thread).
const std::unordered_set<const c10::TensorImpl*>* left_to_outer();

}  // namespace tdist::detail
