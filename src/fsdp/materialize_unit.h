// Makes one unit's tensors real on the unit's device before it is sharded
// (docs/deferred-init.md): deferred ones are replayed as their module's
// construction made them, or, with a param_init_fn, made empty and handed
// to it module by module; real ones are moved to device_id. Only this
// unit's tensors: the full copy lives until the unit shards it, before the
// next unit is made.
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "tdist/fsdp.h"

namespace tdist::detail {

struct UnitTensors {
  const std::vector<std::string>& param_names;
  const std::vector<at::Tensor>& params;
  const std::vector<std::string>& buffer_names;
  const std::vector<at::Tensor>& buffers;
  const std::vector<torch::nn::Module*>& owners;  // the modules holding them, in model order
};

struct MaterializedUnit {
  bool deferred = false;            // any of them was
  std::vector<size_t> unset_params;  // skip_init: the parameters made empty, awaiting a loader
};

// UsageError naming a tensor still meta afterwards (param_init_fn left
// it). With skip_init the deferred parameters are made empty (their
// buffers are replayed: small, and often not in a model's files).
MaterializedUnit materialize_unit(const UnitTensors& unit, const FullyShardedDataParallelOptions& options,
                                  const std::string& label);

}  // namespace tdist::detail
