// DistributedSampler: which samples of a dataset this rank trains on, epoch
// by epoch, as PyTorch's torch.utils.data.DistributedSampler chooses them,
// and where a resumed run continues, at this world size or another one.
//
//   tdist::DistributedSampler sampler(dataset_size);          // the default group's rank and size
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);
//     while (auto batch = sampler.next(64)) {                  // this rank's next 64 indices (int64)
//       train_step(x.index_select(0, *batch), y.index_select(0, *batch));
//       checkpointer.maybe_save(++step, sampler.state_dict());  // the position rides in the extras
//     }
//   }
//   // On restart: sampler.load_state_dict(restored->extras), and start the
//   // loop at sampler.epoch(): its set_epoch keeps the restored position.
//
// The order is PyTorch's: the epoch's permutation is torch.randperm(n)
// under a generator seeded with seed + epoch (arange(n) with shuffle off);
// it is padded with its own first indices to a multiple of the world size
// (drop_last off) or cut to one (drop_last on); rank r takes every
// world-size-th index from r. So at one world size the indices equal
// PyTorch's, and every rank gets the same number.
//
// Position: all ranks call next() in step, and each call moves the epoch's
// position on by batch_size × world size samples, the global batch. The
// position (state_dict's "epoch_samples": samples of the epoch handed out
// by all ranks together) does not depend on the world size, so a run
// restarted at another world size (an elastic job that lost or gained a
// node) continues with the first sample no rank has seen: nothing of the
// epoch is skipped or repeated, except that the rest of the epoch is
// padded or cut to the new world size as a fresh epoch would be.
//
// Threading: one sampler per rank, used by one thread. Nothing here is
// collective: ranks agree because they compute the same thing.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace tdist {

struct DistributedSamplerOptions {
  int num_replicas = -1;  // the world size; -1: the default group's size
  int rank = -1;          // -1: the default group's rank
  bool shuffle = true;
  uint64_t seed = 0;      // the same on every rank
  bool drop_last = false;
};

class DistributedSampler {
 public:
  // UsageError for a negative size, a rank outside [0, num_replicas), or
  // -1 with no default group.
  explicit DistributedSampler(int64_t dataset_size, const DistributedSamplerOptions& options = {});

  // Starts epoch `epoch` from its first sample (PyTorch's set_epoch: call
  // it before every pass over the data; an epoch is one pass of next(), and
  // without it every epoch shuffles alike). One exception: right after
  // load_state_dict, the call for the restored epoch keeps the restored
  // position (the resumed loop's first set_epoch).
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }

  // This rank's next batch of at most batch_size indices (int64, on the
  // CPU); nullopt once the epoch is used up. Every rank gets the same
  // number of batches of the same sizes.
  std::optional<at::Tensor> next(int64_t batch_size);
  // Batches of batch_size this rank has left in the epoch (next() returns
  // that many), and how many a whole epoch has at this world size.
  int64_t batches_left(int64_t batch_size) const;
  int64_t batches_per_epoch(int64_t batch_size) const;
  // This rank's remaining indices of the epoch, in order (what PyTorch's
  // iterator yields; the whole epoch right after set_epoch).
  at::Tensor indices() const;
  // This rank's samples in a whole epoch (PyTorch's len(sampler)).
  int64_t num_samples() const;

  // Samples of the epoch handed out so far, by all ranks together.
  int64_t epoch_samples() const { return start_ + taken_ * replicas_; }

  // The position, as tensors (for Checkpointer extras or any state dict):
  // "epoch", "epoch_samples", "dataset_size".
  std::map<std::string, at::Tensor> state_dict() const;
  // Continues from a state_dict saved at any world size (entries under
  // other names are ignored, so a checkpoint's whole extras map can be
  // passed). A state of another dataset size, or without "epoch" and
  // "epoch_samples", is a UsageError saying so.
  void load_state_dict(const std::map<std::string, at::Tensor>& state);

 private:
  // This rank's samples from position `from` to the epoch's (padded or
  // cut) end: every replicas_-th from from + rank.
  int64_t rank_share(int64_t from) const;
  // The indices at positions [from + rank + replicas_ * j] for j in [first, last).
  at::Tensor take(int64_t first, int64_t last) const;

  int64_t size_;
  int replicas_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t epoch_ = 0;
  int64_t start_ = 0;  // the position this rank's share of the epoch begins at
  int64_t taken_ = 0;  // this rank's samples handed out since start_
  bool resumed_ = false;  // load_state_dict ran, and neither next() nor set_epoch since
  mutable at::Tensor order_;  // epoch_'s permutation, made when first needed
  mutable int64_t order_epoch_ = -1;
};

}  // namespace tdist
