// The layout of tdist's .pt checkpoint files as PtValue trees, and back.
//
// A per-rank file of a sharded checkpoint ({prefix}_rank-{r}-of-{w}.pt):
//   {"model":          {name: tensor},   this rank's rows of FSDP parameters, everything else whole
//    "shard_metadata": {"world_size", "rank", "units": [{"prefix", "sharded",
//                       "params": [{"name", "original_name", "shape", "shard_shape", "numel",
//                                   "first_row", "rows_per_rank", "padding_rows", "requires_grad"}]}]},
//    "optimizer":      None, or {"optimizer": kind, "world_size", "rank",
//                       "state": {param: {field: tensor}},
//                       "param_groups": [{option: number, ..., "params": [names]}]},
//    "comm_hook":      None, or a uint8 tensor (a torch::serialize archive: the hook's state),
//    "tdist":          {"format": 1, "kind": "sharded", "save_id", "world_size", "rank",
//                       "buffers": [names of the model's buffers],
//                       "modules": [names of every submodule, parents first],
//                       "ddp_buckets": None, or DDP's rebuilt bucket layout (parameter indices)}}
// A consolidated file holds "model" and "optimizer" (full, by name) and
// "tdist": {"format": 1, "kind": "consolidated"}.
//
// Tensors go into a tree through a TensorSink, which hands out storage keys
// and remembers how to produce each tensor when its turn comes to be
// written: so a writer can stream them (one in memory at a time).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/pt_file.h"
#include "tdist/state_dict.h"

namespace tdist::checkpoint {

constexpr int64_t kFormatVersion = 1;

class TensorSink {
 public:
  using Make = std::function<at::Tensor()>;
  // A tensor value of that dtype and shape whose bytes `make` will produce.
  PtValue add(at::ScalarType dtype, std::vector<int64_t> shape, Make make);
  // A tensor in memory.
  PtValue add(const at::Tensor& t);
  // Writes root (built from this sink's values) and every tensor, in the
  // order root pickles them; finish() is the caller's.
  void write(PtWriter& writer, const PtValue& root);

 private:
  std::vector<std::pair<std::string, Make>> pending_;
};

// The storage keys of root's tensors in the order they are pickled (and
// so must be written).
std::vector<std::string> tensor_keys(const PtValue& root);

PtValue metadata_value(const ShardMetadata& md);
ShardMetadata metadata_from(const PtValue& v);

PtValue optimizer_value(const OptimizerStateDict& s, TensorSink& sink);
// Everything but the tensors' bytes: the state's tensors are read with
// `read` (given the ref).
OptimizerStateDict optimizer_from(const PtValue& v, const std::function<at::Tensor(const PtTensorRef&)>& read);
// An optimizer tree with other state: the same groups and kind, the state
// from `state` (names -> fields -> values made by the sink).
PtValue optimizer_tree(const PtValue& like, PtValue state, int world_size, int rank);

// Lookups with the file in the message: "<path>: <what>".
const PtValue& field(const PtValue& v, const std::string& key, const std::string& path);

}  // namespace tdist::checkpoint
