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
//    "comm_hook":      None, or a PowerSGD hook's state (check_comm_hook below):
//                      {"kind": "PowerSGD", "version": 1,
//                       "options": {"matrix_approximation_rank", "start_powerSGD_iter",
//                                   "min_compression_rate", "use_error_feedback", "warm_start",
//                                   "orthogonalization_epsilon", "random_seed" (as int64),
//                                   "compression_stats_logging_frequency",
//                                   "batch_tensors_with_same_shape"},
//                       "iter", "rng": std::mt19937_64's text, "next_stats_report",
//                       "stats": {"numel_before", "numel_after", "bytes_before", "bytes_after",
//                                 "bytes_communicated", "nonfinite_fallbacks"},
//                       "buckets": [{"index", "error": 1-d tensor or None,
//                                    "q": 1-d or 2-d tensor or None}]}
//                      (tdist before this layout stored a uint8 tensor holding a LibTorch
//                      archive, which is refused: its loader runs code from the file),
//    "tdist":          {"format": 1, "kind": "sharded", "save_id", "world_size", "rank",
//                       "buffers": [names of the model's buffers],
//                       "modules": [names of every submodule, parents first],
//                       "ddp_buckets": None, or DDP's rebuilt bucket layout (parameter indices)}}
// A consolidated file holds "model" and "optimizer" (full, by name) and
// "tdist": {"format": 1, "kind": "consolidated"}.
//
// This part needs c10 only (the checkpoint tools use it without LibTorch);
// tensor_tree.h puts LibTorch tensors into such trees.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "formats/pt_file.h"
#include "tdist/shard_metadata.h"

namespace tdist::checkpoint {

constexpr int64_t kFormatVersion = 1;

// Hands out storage keys ("0", "1", ...) for tensor values of a tree
// (contiguous, whole storages); the caller writes their bytes in the order
// tensor_keys says.
class StorageKeys {
 public:
  PtValue add(c10::ScalarType dtype, std::vector<int64_t> shape);

 private:
  int64_t next_ = 0;
};

// The storage keys of root's tensors in the order they are pickled (and
// so must be written).
std::vector<std::string> tensor_keys(const PtValue& root);

PtValue metadata_value(const ShardMetadata& md);
ShardMetadata metadata_from(const PtValue& v);

// A fresh save_id: random, non-negative (one save's files carry one).
int64_t new_save_id();
// A rank file's "tdist" record (the layout above).
PtValue sharded_record(int64_t save_id, int world_size, int rank, PtValue buffers, PtValue modules,
                       PtValue ddp_buckets);

// An optimizer tree with other state: the same groups and kind, the state
// from `state` (names -> fields -> values made by the sink).
PtValue optimizer_tree(const PtValue& like, PtValue state, int world_size, int rank);

// What a rank file's "comm_hook" record holds, its layout checked (every
// key there and no other, of its kind and range; a tensor's dtype and
// dimensions, its bytes when read). CheckpointError naming the field
// ("comm_hook.buckets[2].q: ...") otherwise. Nothing in it is executed.
constexpr size_t kMaxRngText = 16 << 10;  // "rng": std::mt19937_64 writes about 6.5 KB
enum class CommHookRecord { none, legacy_archive, powersgd };
CommHookRecord check_comm_hook(const PtValue* record);

// An optimizer tree ("optimizer" of a rank or consolidated file) checked
// for what the loads and tools take from it besides the state's tensors:
// "optimizer" a string, "world_size" >= 1 and 0 <= "rank" < it,
// "param_groups" a list of dicts of finite numbers (or bools) and a
// "params" list of strings, "state" a dict of dicts of tensors.
// CheckpointError "<where>.param_groups[0].lr: ..." otherwise.
void check_optimizer_tree(const PtValue& v, const std::string& where = "optimizer");

// "[2, 3]", for messages.
std::string shape_string(c10::IntArrayRef shape);

// Lookups with the file in the message: "<path>: <what>".
// (The key is a string_view: a std::string made from a literal would be a
// temporary, which GCC 13's -Wdangling-reference takes for what the result
// refers to.)
const PtValue& field(const PtValue& v, std::string_view key, const std::string& path);

}  // namespace tdist::checkpoint
