// BucketRebuild: DDP's one-time bucket rebuild. During the first
// synchronised iteration it records the order in which gradients arrive;
// before the next forward every rank adopts rank 0's order and reassigns
// the buckets in it (first bucket small, then the cap), once per instance.
//
// Owns: the arrival order and the rebuild's state (due, done).
// Threading: not synchronised; REQUIRES the owner's lock. take_due is a
// collective (a broadcast from rank 0), run on every rank before the same
// forward.
// Lifetime: plain values.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <optional>
#include <vector>

#include "ddp/bucket_assignment.h"
#include "tdist/process_group.h"

namespace tdist::detail {

// What bucket assignment needs of each parameter: its bytes and dtype.
std::vector<ParamInfo> param_infos(const std::vector<at::Tensor>& params);

class BucketRebuild {
 public:
  // The bucket caps, as for the first assignment.
  BucketRebuild(size_t first_cap_bytes, size_t cap_bytes) : first_cap_bytes_(first_cap_bytes), cap_bytes_(cap_bytes) {}
  // A gradient arrived (recorded until the rebuild is due or done).
  void record_arrival(size_t index) {
    if (!rebuilt_ && !due_) arrival_.push_back(index);
  }
  // Forgets this iteration's arrivals.
  void forget_arrivals() { arrival_.clear(); }
  bool done() const { return rebuilt_; }
  // The layout is settled from elsewhere (a checkpoint): no rebuild.
  void mark_done() {
    rebuilt_ = true;
    due_ = false;
    arrival_.clear();
  }
  // After a clean iteration: the rebuild is due, in the arrival order, then
  // whatever never arrived (arrived[i] == 0), last registered first.
  void schedule(const std::vector<char>& arrived);
  // Before a forward, on every rank alike: when the rebuild is due, marks it
  // done and returns the assignment of `params` in rank 0's order (a
  // broadcast over pg); otherwise nothing. Throws CollectiveMismatchError
  // when rank 0's order is not a permutation of the parameters.
  std::optional<std::vector<std::vector<size_t>>> take_due(ProcessGroup& pg, const std::vector<at::Tensor>& params);

 private:
  const size_t first_cap_bytes_, cap_bytes_;
  std::vector<size_t> arrival_;  // until the rebuild: parameters in the order their gradients arrived
  bool due_ = false, rebuilt_ = false;
  std::vector<size_t> arrival_for_rebuild_;
};

}  // namespace tdist::detail
