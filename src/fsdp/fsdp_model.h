// FsdpModel: the one face the rest of the library (state dicts, sharded
// checkpoints, the Checkpointer, pretrained files) has on a model's FSDP
// wrappers. One record, made from the wrappers' tree when asked for: their
// groups, and every unit parameter, outermost unit first, by its names in
// the unwrapped model with this rank's rows of it. Nothing outside
// src/fsdp sees FsdpState or a ShardedUnit.
//
// Threading: the training thread, between iterations (settle() checks).
// Lifetime: a view of the model's wrappers at the time it was made: make
// it again after wrapping more of the model.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tdist/process_group.h"
#include "tdist/shard_metadata.h"

namespace tdist::detail {

// One parameter of one unit, as the files see it.
struct FsdpParamRecord {
  std::string name;                  // its first name in the unwrapped model
  std::vector<std::string> aliases;  // the other names a tied parameter has there
  at::Tensor tensor;                 // the module's parameter: this rank's rows between iterations
  std::vector<int64_t> full_shape;
  int64_t first_row = 0;      // this rank's rows of the full parameter (all of them without sharding)
  int64_t rows = 0;
  int64_t rows_per_rank = 0;  // every rank's rows, padded (sharded units)
  bool sharded = false;       // false: every rank holds it whole
};

class FsdpModel {
 public:
  // The wrappers in root's tree (root included); nullopt when it holds none.
  static std::optional<FsdpModel> of(torch::nn::Module& root);

  // The units' shard group; under hybrid sharding the group replicating
  // this rank's shards (else null); and both together (every rank of the
  // wrappers: rank 0 of them writes what one rank writes).
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  const std::shared_ptr<ProcessGroup>& replicate_group() const { return replicate_; }
  const std::shared_ptr<ProcessGroup>& world_group() const { return world_; }
  const std::vector<FsdpParamRecord>& params() const { return params_; }
  // The buffers the wrappers converted to a buffer_dtype, with the dtype
  // each had before (state dicts hand them out in that one).
  const std::unordered_map<const c10::TensorImpl*, at::ScalarType>& converted_buffers() const {
    return converted_;
  }
  ShardMetadata metadata() const;

  // Settles the last iteration (every unit sharded, no collective in
  // flight); UsageError inside a forward, a backward or summon_full_params.
  // `what` names the caller in that message.
  void settle(const char* what) const;
  // UsageError naming the first parameter made with skip_init that nothing
  // has written since (unit.h, await_load): before reading the shards
  // without gathering them, as a sharded save does. Every rank decides
  // alike (a loader writes even empty rows), so no rank is left waiting.
  void check_loaded() const;
  // Gathers the units one at a time, outermost first (exact: in the shards'
  // dtype), calls fn(name, full parameter) for each parameter of the unit,
  // and frees it again. Collective: every rank calls it. Settles first.
  void visit_gathered(const std::function<void(const std::string&, const at::Tensor&)>& fn) const;

 private:
  explicit FsdpModel(torch::nn::Module& root) : root_(&root) {}

  torch::nn::Module* root_;
  std::shared_ptr<ProcessGroup> group_, replicate_, world_;
  std::vector<FsdpParamRecord> params_;
  std::unordered_map<const c10::TensorImpl*, at::ScalarType> converted_;
};

}  // namespace tdist::detail
