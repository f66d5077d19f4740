#include "tdist/comm_hooks.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "process_group/group_or_default.h"

namespace tdist {

namespace {


// The compressed copy of a buffer, reused from one iteration to the next:
// fresh memory for it every time costs more than the conversion itself
// (page faults). Keyed by the original's storage, held weakly, so that a
// buffer that is freed (e.g. buckets rebuilt) drops its copy.
at::Tensor compression_buffer(const at::Tensor& original, at::ScalarType dtype) {
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    const void* data;
    int64_t numel;
    at::ScalarType dtype;
    at::Tensor buffer;
  };
  static std::mutex mu;
  static std::vector<Entry> cache;
  std::lock_guard<std::mutex> lock(mu);
  const void* data = original.data_ptr();
  for (const Entry& e : cache) {
    if (e.data == data && e.numel == original.numel() && e.dtype == dtype && !e.storage.expired() &&
        e.storage._unsafe_get_target() == original.storage().unsafeGetStorageImpl()) {
      return e.buffer;
    }
  }
  cache.erase(std::remove_if(cache.begin(), cache.end(), [](const Entry& e) { return e.storage.expired(); }),
              cache.end());
  at::Tensor buffer = at::empty({original.numel()}, original.options().dtype(dtype));
  cache.push_back({original.storage().getWeakStorageImpl(), data,
                   original.numel(), dtype, buffer});
  return buffer;
}

// Casts the bucket to `dtype`, runs `inner` on the copy, and writes the
// result back into the original buffer's dtype.
std::shared_ptr<Work> compressed(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket, at::ScalarType dtype,
                                 const StatefulHook& inner) {
  at::Tensor original = bucket.buffer();
  at::Tensor small;
  if (original.is_contiguous()) {
    small = compression_buffer(original, dtype).view(original.sizes());
    small.copy_(original);
  } else {
    small = original.to(dtype);
  }
  bucket.set_buffer(small);
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
  auto g = detail::group_or_default(group, "communication hook");
  at::Tensor t = bucket.buffer();
  // Divide first, as PyTorch's hook does, so that reduced-precision buffers
  // cannot overflow in the sum; AVG does that on floating buffers in one go.
  return g->all_reduce(t, {ReduceOp::AVG});
}

namespace {

// fp16/bf16_compress_hook: a float32 bucket goes as one all-reduce that
// narrows and widens in place (AllreduceOptions::wire_dtype), the same bits
// as casting, all-reducing the copy and casting back, which other buffers
// still do.
std::shared_ptr<Work> compress_hook(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket,
                                    at::ScalarType dtype) {
  at::Tensor t = bucket.buffer();
  if (t.scalar_type() != at::kFloat || !t.is_contiguous()) return compressed(group, bucket, dtype, allreduce_hook);
  AllreduceOptions o;
  o.op = ReduceOp::AVG;
  o.wire_dtype = dtype;
  return detail::group_or_default(group, "communication hook")->all_reduce(t, o);
}

}  // namespace

std::shared_ptr<Work> fp16_compress_hook(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket) {
  return compress_hook(group, bucket, at::kHalf);
}

std::shared_ptr<Work> bf16_compress_hook(const std::shared_ptr<ProcessGroup>& group, GradBucket& bucket) {
  return compress_hook(group, bucket, at::kBFloat16);
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
