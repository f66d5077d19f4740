// The files of one sharded checkpoint, read together: found by prefix and
// suffix pattern, checked as a set (ranks 0..w-1 each once, one world size,
// one save, consistent metadata), and each logical tensor (a model entry,
// an optimizer state field) streamed in order, 1 MiB at a time, from the
// ranks' pieces (stream_full).
//
// Only the directories and pickles are read when the set is opened; the
// tensors' bytes when asked for (their CRC checked then). Needs c10 only;
// sharded_tensors.h reads the tensors into LibTorch tensors.
//
// Errors: CheckpointError naming the file and the problem.
// Threading: one thread per object.
#pragma once

#include <c10/core/ScalarType.h>

#include <memory>
#include <string>
#include <vector>

#include "formats/pt_file.h"
#include "tdist/shard_metadata.h"

namespace tdist::checkpoint {

// One tensor of the checkpoint as the whole model sees it.
struct LogicalTensor {
  std::string name;                     // the model entry, or "<param>/<field>" of the optimizer
  std::string param;                    // optimizer: the parameter; model: the name
  std::string field;                    // optimizer: the state field; model: empty
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;           // full
  bool sharded = false;                 // split by rows over the ranks (else whole in rank 0's file)
  std::vector<const PtTensorRef*> pieces;  // per rank (sharded), or rank 0's alone
  int64_t bytes() const;
};

// The files a prefix and suffix pattern name: each '*' of the suffix
// matches digits, the first the rank and the second (if any) the world size.
std::string rank_file_path(const std::string& prefix, const std::string& suffix, int rank, int world_size);

// Every file the prefix and suffix name, with the rank and (-1 without a
// second '*') world size its name says. UsageError for a suffix whose '*'
// could not be told apart from its neighbours.
struct RankFile {
  int64_t rank = 0, world_size = -1;
  std::string path;
};
std::vector<RankFile> find_rank_files(const std::string& prefix, const std::string& suffix);

// Whether `path` is a name the prefix and suffix match (find_rank_files
// would list it once it exists), both directories resolved.
bool is_rank_file_name(const std::string& prefix, const std::string& suffix, const std::string& path);

// The shape of `rows` rows of a tensor of shape `full` (a 0-d one: [] for
// its one row, [0] for none).
std::vector<int64_t> rows_shape(const std::vector<int64_t>& full, int64_t rows);

// CheckpointError unless `ref` is a whole, contiguous storage from offset 0
// (what tdist writes; the streaming readers copy storages as they are).
void check_whole(const PtTensorRef& ref, const std::string& path, const std::string& name);

class ShardedCheckpointFiles {
 public:
  ShardedCheckpointFiles(const std::string& prefix, const std::string& suffix);
  ~ShardedCheckpointFiles();

  int world_size() const { return static_cast<int>(readers_.size()); }
  const std::vector<std::string>& paths() const { return paths_; }
  const ShardMetadata& metadata() const { return metadata_; }  // rank 0's
  const std::vector<LogicalTensor>& model() const { return model_; }
  bool has_optimizer() const { return !optimizer_tree_->is_none(); }
  const std::vector<LogicalTensor>& optimizer() const { return optimizer_; }
  // Rank 0's optimizer tree (kind, groups; its state is rank 0's pieces).
  const PtValue& optimizer_tree() const { return *optimizer_tree_; }
  const PtReader& reader(int rank) const { return *readers_[static_cast<size_t>(rank)]; }
  int64_t save_id() const { return save_id_; }

  // The full tensor's bytes, in order (rank 0's piece first), handed to
  // `sink` 1 MiB at a time; each piece's CRC is checked after its last
  // byte is handed over, so until the call returns what the sink got is
  // unverified (keep nothing of it on an exception).
  void stream_full(const LogicalTensor& t, const PtReader::ByteSink& sink) const;

 private:
  void check_set();
  void index_model();
  void index_optimizer();
  LogicalTensor logical(const std::string& name, const std::string& param, const std::string& field,
                        bool sharded, const std::vector<int64_t>& full_shape,
                        const std::vector<const PtValue*>& per_rank) const;

  std::vector<std::string> paths_;
  std::vector<std::unique_ptr<PtReader>> readers_;
  ShardMetadata metadata_;
  std::vector<LogicalTensor> model_, optimizer_;
  const PtValue* optimizer_tree_ = nullptr;
  int64_t save_id_ = 0;
};

}  // namespace tdist::checkpoint
