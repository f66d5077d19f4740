#include "tdist/comm_hooks.h"

#include <ATen/ATen.h>

namespace tdist {

namespace {

std::shared_ptr<ProcessGroup> group_or_default(const std::shared_ptr<ProcessGroup>& group) {
  auto g = group ? group : default_group();
  if (!g) throw UsageError("communication hook: no process group given and no default group");
  return g;
}

// Casts the bucket to `dtype`, runs `inner` on the copy, and writes the
// result back into the original buffer's dtype.
std::shared_ptr<Work> compressed(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket, at::ScalarType dtype,
                                 const StatefulHook& inner) {
  at::Tensor original = bucket.buffer();
  bucket.set_buffer(original.to(dtype));
  auto work = inner(group, bucket);
  if (!work) throw UsageError("communication hook: the wrapped hook returned no Work");
  return work->then([original](Work& w) {
    const auto result = w.result();
    if (result.empty()) throw Error("communication hook: the wrapped hook produced no tensor");
    original.copy_(result[0].view(original.sizes()));
    return std::vector<at::Tensor>{original};
  });
}

}  // namespace

std::shared_ptr<Work> allreduce_hook(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket) {
  auto g = group_or_default(group);
  at::Tensor t = bucket.buffer();
  // Divide first, as PyTorch's hook does, so that reduced-precision buffers
  // cannot overflow in the sum; AVG does that on floating buffers in one go.
  return g->all_reduce(t, {ReduceOp::AVG});
}

std::shared_ptr<Work> fp16_compress_hook(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket) {
  return compressed(group, bucket, at::kHalf, allreduce_hook);
}

std::shared_ptr<Work> bf16_compress_hook(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket) {
  return compressed(group, bucket, at::kBFloat16, allreduce_hook);
}

std::shared_ptr<Work> noop_hook(const std::shared_ptr<ProcessGroup>&, GradBucket& bucket) {
  return Work::completed({bucket.buffer()});
}

StatefulHook fp16_compress_wrapper(StatefulHook hook) {
  return [hook = std::move(hook)](const std::shared_ptr<ProcessGroup>& g, GradBucket& b) {
    return compressed(g, b, at::kHalf, hook);
  };
}

StatefulHook bf16_compress_wrapper(StatefulHook hook) {
  return [hook = std::move(hook)](const std::shared_ptr<ProcessGroup>& g, GradBucket& b) {
    return compressed(g, b, at::kBFloat16, hook);
  };
}

}  // namespace tdist
