// DDP communication hooks: replace the plain all-reduce of a gradient bucket.
//
//   ddp->register_comm_hook(world, tdist::fp16_compress_hook);      // state, hook
//   ddp->register_comm_hook([](tdist::GradBucket& b) { ... });     // or any callable
//
// A hook gets the bucket and returns a Work whose result()[0] is the reduced
// (averaged) flat buffer; it may chain asynchronous steps with Work::then().
// Hooks run on the thread that runs backward; the chained steps on the
// process group's worker thread (they must not wait on that group's work).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "tdist/process_group.h"

namespace tdist {

class GradBucket {
 public:
  GradBucket(size_t index, bool is_last, at::Tensor buffer, std::vector<at::Tensor> gradients,
             std::vector<at::Tensor> parameters)
      : index_(index), is_last_(is_last), buffer_(std::move(buffer)), gradients_(std::move(gradients)),
        parameters_(std::move(parameters)) {}

  size_t index() const { return index_; }
  // The last bucket of the iteration (launched last).
  bool is_last() const { return is_last_; }
  // The flat buffer of all the bucket's gradients, back to back.
  const at::Tensor& buffer() const { return buffer_; }
  // Replaces the buffer handed to later steps (e.g. a compressed copy); the
  // reducer still reads the hook's result from the returned Work.
  void set_buffer(at::Tensor buffer) { buffer_ = std::move(buffer); }
  // Per-parameter views of the gradients in buffer(), shaped like the parameters.
  const std::vector<at::Tensor>& gradients() const { return gradients_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }

 private:
  size_t index_;
  bool is_last_;
  at::Tensor buffer_;
  std::vector<at::Tensor> gradients_;
  std::vector<at::Tensor> parameters_;
};

using CommHook = std::function<std::shared_ptr<Work>(GradBucket&)>;

// ---- built-in hooks (state: the process group; null means the default) ----

// The plain all-reduce, averaged over the group: DDP's default.
std::shared_ptr<Work> allreduce_hook(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket);
// Cast to float16 (bfloat16), all-reduce, divide by the group size, cast back.
std::shared_ptr<Work> fp16_compress_hook(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket);
std::shared_ptr<Work> bf16_compress_hook(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket);
// Returns the buffer unreduced: for measuring what communication costs.
// Training with it is wrong by design.
std::shared_ptr<Work> noop_hook(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket);

// Wraps any hook so that it sees a float16 (bfloat16) copy of the bucket,
// and its result is cast back to the gradients' dtype.
using StatefulHook = std::function<std::shared_ptr<Work>(const std::shared_ptr<ProcessGroup>&, GradBucket&)>;
StatefulHook fp16_compress_wrapper(StatefulHook hook);
StatefulHook bf16_compress_wrapper(StatefulHook hook);

}  // namespace tdist
