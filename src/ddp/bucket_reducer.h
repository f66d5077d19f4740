// BucketReducer: DDP's gradient buckets and their reduction. Each bucket is
// a FlatBuffer of its parameters' gradients; as slots become final the
// reducer copies gradients in (or moves .grad into its slot), launches every
// complete bucket in index order (a communication hook, a built-in
// reduction it runs itself, or the plain averaged all-reduce), and after
// the waits writes the results back to .grad.
//
// Owns: the buckets (memory, per-iteration pending counts and Work), the
// registered hook, and which slots are final in this iteration.
// Threading: not synchronised; REQUIRES the owner's lock for every method
// except the Work it hands out, which the owner waits on without the lock.
// Hooks run inside mark_ready, on the backward thread.
// Lifetime: gradients that live in bucket memory keep it alive after a
// rebuild or after the reducer is gone.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "flat/flat_buffer.h"
#include "tdist/ddp.h"

namespace tdist::detail {

class BucketReducer {
 public:
  // params: those that require grad, in registration order.
  // symmetric_buckets: allocate the buckets in pg's symmetric memory and
  // keep the gradients there (as tensors of their own unless
  // gradient_as_bucket_view makes them aliases).
  BucketReducer(std::shared_ptr<ProcessGroup> pg, std::vector<at::Tensor> params, bool gradient_as_bucket_view,
                bool symmetric_buckets);

  // (Re)creates the buckets for `assignment` (parameter indices per bucket,
  // in launch order); gradients that are bucket views move to the new
  // buckets with their values.
  void build(const std::vector<std::vector<size_t>>& assignment);
  std::vector<std::vector<size_t>> assignment() const;

  // ---- the reduction ----
  bool has_hook() const { return static_cast<bool>(hook_); }
  // A user's hook: the reducer hands it each bucket's flat buffer.
  void set_hook(CommHook hook);
  // What the registered hook is when it is a built-in that the reducer
  // runs itself (kNone: none), and the group it reduces over.
  void set_builtin(Builtin kind, std::shared_ptr<ProcessGroup> group);

  // ---- per iteration ----
  // Whether parameter i's slot is final in this iteration.
  bool ready(size_t i) const { return ready_[i]; }
  // Slot i of its bucket is final: copy the gradient in (zeros for a
  // parameter without one) and launch every bucket that is now complete,
  // in index order, so that every rank issues the same sequence.
  void mark_ready(size_t i, bool has_grad);
  // The Work of every launched bucket, to be waited on without the lock.
  std::vector<std::shared_ptr<Work>> launched_work() const;
  // After the waits: the launched buckets' results into .grad, for the
  // parameters some rank used (globally_used[i]). Returns an error for the
  // next forward (a hook's result of the wrong size), or "".
  std::string write_back(const std::vector<char>& globally_used);
  // Forgets this iteration: nothing ready, nothing launched.
  void reset();

 private:
  struct Bucket {
    std::vector<size_t> members;
    FlatBuffer buffer;  // per member, a slot shaped like the parameter
    size_t pending = 0;
    std::shared_ptr<Work> work;
    // Built-in reductions without gradient_as_bucket_view (direct_mode())
    // work on the gradients where they are: per member, its .grad, or its
    // view in flat when there is no usable .grad (none, or not contiguous).
    std::vector<at::Tensor> pieces;
  };

  // Whether the reducer runs the reduction itself on the gradients where
  // they are. With gradient_as_bucket_view they already live in the bucket.
  bool direct_mode() const { return builtin_ != Builtin::kNone && !gradient_as_bucket_view_; }
  void launch(size_t index);
  std::shared_ptr<Work> launch_direct(Bucket& b);

  std::shared_ptr<ProcessGroup> pg_;
  std::vector<at::Tensor> params_;
  const bool gradient_as_bucket_view_;
  const bool symmetric_buckets_;
  // Whether the gradients live in bucket memory: with
  // gradient_as_bucket_view (as views), and on a group with symmetric
  // memory (as tensors of their own), so that the shm backend reduces them
  // where they are, straight between the ranks' copies.
  const bool grads_in_buckets_;

  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_, slot_in_bucket_;

  CommHook hook_;  // empty: all-reduce, averaged
  // What the registered hook is, when it is one of the built-ins that the
  // reducer runs itself (no copy of the gradients into the bucket and back).
  Builtin builtin_ = Builtin::kAllreduce;
  std::shared_ptr<ProcessGroup> builtin_group_;  // its state: the group it reduces over

  std::vector<bool> ready_;  // the parameter's slot in its bucket is final
  size_t next_launch_ = 0;
};

}  // namespace tdist::detail
