// PowerSGD gradient compression (Vogels et al., NeurIPS 2019) as DDP
// communication hooks, with PyTorch's hyperparameters and defaults.
//
//   tdist::PowerSGDOptions o;
//   o.matrix_approximation_rank = 2;
//   o.start_powerSGD_iter = 10;
//   auto state = std::make_shared<tdist::PowerSGDState>(group, o);
//   ddp->register_comm_hook(state, tdist::powerSGD_hook);      // or batched_powerSGD_hook
//
// Each gradient matrix M (a >= 2-D gradient viewed as rows x rest) is sent
// as two thin matrices: P = M Q (all-reduced, orthogonalised), then
// Q = M^T P (all-reduced, averaged); the approximation is P Q^T. The part
// the approximation missed (error feedback) is added to the next step's
// gradient, and Q is reused as the next step's starting point (warm start).
//
// Checkpoints: save_sharded_checkpoint stores the state (iteration, RNG,
// statistics, error feedback and Q memories) in each rank's file when
// ShardedCheckpointOptions::comm_hook_state is set, and
// load_sharded_checkpoint checks and loads it back. The process group is
// not saved: to resume, build a state with the new run's group and the
// same options, load the checkpoint into it, then register the hook:
//
//   auto state = std::make_shared<tdist::PowerSGDState>(group, o);
//   tdist::ShardedCheckpointOptions c;  c.comm_hook_state = state;
//   tdist::load_sharded_checkpoint(prefix, *group, *ddp, &opt, c);
//   ddp->register_comm_hook(state, tdist::powerSGD_hook);
//
// state_dict() / load_state_dict() give the same state as plain values,
// for checkpoints of one's own. save() / load() put it into LibTorch's
// archives; an archive's loader (InputArchive::load_from) runs the
// TorchScript code a file carries, so load() only archives you trust.
#pragma once

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>

#include "tdist/comm_hooks.h"

namespace tdist {

struct PowerSGDOptions {
  // The rank r of the approximation (min'd with each matrix's sides).
  int64_t matrix_approximation_rank = 1;
  // Plain all-reduce for this many iterations first. Must be > 1 when
  // error feedback or warm start is on: DDP rebuilds its buckets after the
  // first iteration, and these memories are kept per bucket.
  int64_t start_powerSGD_iter = 1000;
  // A matrix is compressed only if it shrinks at least this much:
  // (rows + cols) * r * min_compression_rate < rows * cols.
  double min_compression_rate = 2;
  bool use_error_feedback = true;
  bool warm_start = true;
  // Added to column norms in the orthogonalisation. With 0, a zero column
  // stays zero (instead of becoming NaN).
  double orthogonalization_epsilon = 0;
  uint64_t random_seed = 0;
  // Compression statistics go to the log every this many iterations.
  int64_t compression_stats_logging_frequency = 10000;
  // Matrices of one shape in a bucket are multiplied as one batch.
  bool batch_tensors_with_same_shape = false;
};

struct CompressionStats {
  // Elements (and bytes) of the gradients PowerSGD handled, before and
  // after compression, summed over the compressed iterations.
  int64_t numel_before = 0, numel_after = 0;
  int64_t bytes_before = 0, bytes_after = 0;
  double compression_rate = 0;  // numel_before / numel_after (0 before any)
  // Every byte this rank handed to all-reduce, warm-up iterations included.
  int64_t bytes_communicated = 0;
  // Steps that fell back to plain all-reduce because of a non-finite gradient.
  int64_t nonfinite_fallbacks = 0;
};

// A PowerSGDState as plain values: what a checkpoint stores.
struct PowerSGDStateDict {
  PowerSGDOptions options;
  int64_t iter = 0;
  std::string rng;  // the generator's state as std::mt19937_64 writes it (operator<<)
  int64_t next_stats_report = 0;
  CompressionStats stats;  // compression_rate is derived, not stored
  struct Bucket {
    at::Tensor error;  // error feedback [numel] (undefined: none yet)
    at::Tensor q;      // Q memory: [numel] (powerSGD_hook) or [side, r] (batched) (undefined: none)
  };
  std::map<size_t, Bucket> buckets;  // by GradBucket::index()
};

class PowerSGDState {
 public:
  // group: the group to reduce over (null: the default group, looked up
  // when the hook runs).
  PowerSGDState(std::shared_ptr<ProcessGroup> group, PowerSGDOptions options = {});

  const PowerSGDOptions& options() const { return options_; }
  // Iterations seen so far (counted at the last bucket of each).
  int64_t iter() const;
  CompressionStats compression_stats() const;
  // A copy of bucket `index`'s error-feedback memory (what the last
  // compressed step left out), or an undefined tensor.
  at::Tensor error_feedback(size_t index) const;

  // The state as values (the tensors are copies).
  PowerSGDStateDict state_dict() const;
  // Checks everything before it changes anything: UsageError when `state`
  // was written with different options (matrix_approximation_rank,
  // start_powerSGD_iter, min_compression_rate, use_error_feedback,
  // warm_start, orthogonalization_epsilon, batch_tensors_with_same_shape;
  // the others may differ and keep this state's values), or holds a
  // negative count, a random state that does not parse, or a memory that
  // is not a floating-point tensor of the shape above. The memories are
  // copied as they are (device, dtype); the hooks move them to the
  // bucket's device and working dtype when they next use them.
  void load_state_dict(const PowerSGDStateDict& state);

  void save(torch::serialize::OutputArchive& archive) const;
  // Raises UsageError when the archive was written with different options.
  // The archive must be trusted: see above.
  void load(torch::serialize::InputArchive& archive);

  struct Bucket;  // per-bucket memories, private to powersgd.cpp

 private:
  friend struct PowerSGDAccess;
  std::shared_ptr<ProcessGroup> group_;
  PowerSGDOptions options_;
  mutable std::mutex mu_;
  int64_t iter_ = 0;
  std::mt19937_64 rng_;
  std::map<size_t, std::shared_ptr<Bucket>> buckets_;
  CompressionStats stats_;
  int64_t next_stats_report_ = 0;
};

// Per-gradient compression: every >= 2-D gradient worth compressing gets
// its own P and Q; the rest travel uncompressed in one all-reduce. Three
// all-reduces per bucket (uncompressed, all Ps, all Qs).
std::shared_ptr<Work> powerSGD_hook(const std::shared_ptr<PowerSGDState>& state, GradBucket& bucket);
// The whole bucket as one square matrix (zero-padded): two all-reduces per
// bucket, for any bucket size.
std::shared_ptr<Work> batched_powerSGD_hook(const std::shared_ptr<PowerSGDState>& state, GradBucket& bucket);

}  // namespace tdist
