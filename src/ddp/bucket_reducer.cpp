// BucketReducer: bucket memory and .grad placement, launches, write-back.
// The contract (ownership, threading, lifetime) is in bucket_reducer.h.
#include "ddp/bucket_reducer.h"

#include "process_group/async_ops.h"
#include "trace/flight_recorder.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace tdist::detail {

namespace {

// Whether a .grad can stand in for its bucket slot's tensor: a dense
// tensor of the slot's dtype, on its device.
bool same_kind(const at::Tensor& grad, const at::Tensor& slot) {
  return grad.layout() == at::kStrided && grad.scalar_type() == slot.scalar_type() && grad.device() == slot.device();
}

// ... and of its shape, so that it can move into the slot.
bool fits_slot(const at::Tensor& grad, const at::Tensor& slot) {
  return same_kind(grad, slot) && grad.sizes() == slot.sizes();
}

}  // namespace

BucketReducer::BucketReducer(std::shared_ptr<ProcessGroup> pg, std::vector<at::Tensor> params,
                             bool gradient_as_bucket_view, bool symmetric_buckets)
    : pg_(std::move(pg)),
      params_(std::move(params)),
      gradient_as_bucket_view_(gradient_as_bucket_view),
      symmetric_buckets_(symmetric_buckets),
      grads_in_buckets_(gradient_as_bucket_view || symmetric_buckets),
      ready_(params_.size(), false) {}

void BucketReducer::build(const std::vector<std::vector<size_t>>& assignment) {
  std::vector<Bucket> fresh;
  bucket_of_.assign(params_.size(), 0);
  slot_in_bucket_.assign(params_.size(), 0);
  FlatBufferOptions layout;
  layout.symmetric_group = symmetric_buckets_ ? pg_.get() : nullptr;
  layout.view = gradient_as_bucket_view_ ? FlatView::kAlias : FlatView::kOwn;
  for (const auto& members : assignment) {
    Bucket b;
    b.members = members;
    b.pending = members.size();
    std::vector<at::IntArrayRef> shapes;
    for (size_t k = 0; k < members.size(); ++k) {
      shapes.push_back(params_[members[k]].sizes());
      bucket_of_[members[k]] = fresh.size();
      slot_in_bucket_[members[k]] = k;
    }
    b.buffer = FlatBuffer(shapes, params_[members[0]].options().requires_grad(false), layout);
    b.pieces.resize(members.size());
    fresh.push_back(std::move(b));
  }
  buckets_ = std::move(fresh);
  if (gradient_as_bucket_view_) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& view = buckets_[bucket_of_[i]].buffer.view(slot_in_bucket_[i]);
      at::Tensor& grad = params_[i].mutable_grad();
      if (grad.defined()) view.copy_(grad);
      grad = view;
    }
  } else if (grads_in_buckets_) {
    // Gradients that exist move into the new buckets when nothing else
    // holds them (those in the old buckets do: those are gone by now);
    // the others stay undefined until backward makes them.
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& view = buckets_[bucket_of_[i]].buffer.view(slot_in_bucket_[i]);
      at::Tensor& grad = params_[i].mutable_grad();
      if (!grad.defined() || grad.use_count() != 1 || !fits_slot(grad, view)) continue;
      view.copy_(grad);
      grad = view;
    }
  }
}

std::vector<std::vector<size_t>> BucketReducer::assignment() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b.members);
  return out;
}

void BucketReducer::set_hook(CommHook hook) {
  hook_ = std::move(hook);
  builtin_ = Builtin::kNone;
}

void BucketReducer::set_builtin(Builtin kind, std::shared_ptr<ProcessGroup> group) {
  builtin_ = kind;
  builtin_group_ = std::move(group);
}

void BucketReducer::mark_ready(size_t i, bool has_grad) {
  ready_[i] = true;
  Bucket& b = buckets_[bucket_of_[i]];
  const size_t slot = slot_in_bucket_[i];
  const at::Tensor& view = b.buffer.view(slot);
  at::Tensor& grad = params_[i].mutable_grad();
  if (!has_grad && !gradient_as_bucket_view_ && grad.defined() && grad.data_ptr() == view.data_ptr()) {
    // The slot takes part as zeros, but without gradient_as_bucket_view a
    // .grad that got nothing keeps its values: move it out of the bucket.
    grad = grad.clone();
  }
  if (has_grad && grads_in_buckets_ && grad.defined() && grad.data_ptr() != view.data_ptr() &&
      fits_slot(grad, view) && (gradient_as_bucket_view_ || grad.use_count() == 1)) {
    // A .grad outside its slot moves in, to be reduced in place: with
    // gradient_as_bucket_view always; otherwise when nothing else holds
    // it (autograd's fresh one after zero_grad(set_to_none) or in the
    // first backward), so that a tensor the user set as .grad keeps
    // receiving the result.
    view.copy_(grad);
    grad = view;
  }
  if (direct_mode()) {
    // Reduced in place when it can be; else through its slot in flat.
    const bool usable = has_grad && grad.defined() && grad.is_contiguous() && same_kind(grad, view) &&
                        grad.numel() == view.numel();
    if (usable) {
      b.pieces[slot] = grad;
    } else {
      if (has_grad && grad.defined()) view.copy_(grad); else view.zero_();
      b.pieces[slot] = view;
    }
  } else if (!has_grad || !grad.defined()) {
    view.zero_();
  } else if (grad.data_ptr() != view.data_ptr()) {
    view.copy_(grad);
  }
  if (--b.pending > 0) return;
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) launch(next_launch_++);
}

void BucketReducer::launch(size_t index) {
  Bucket& b = buckets_[index];
  const detail::AsyncOpsScope async;  // backward goes on: the worker runs them
  const detail::FrSiteScope site("ddp bucket", static_cast<int>(index));
  if (direct_mode()) {
    b.work = launch_direct(b);
    return;
  }
  if (hook_) {
    std::vector<at::Tensor> members;
    for (size_t m : b.members) members.push_back(params_[m]);
    GradBucket gb(index, index + 1 == buckets_.size(), b.buffer.flat(), b.buffer.views(), std::move(members));
    b.work = hook_(gb);
    if (!b.work) throw UsageError("DistributedDataParallel: the communication hook returned no Work");
  } else {
    b.work = pg_->all_reduce(b.buffer.flat(), {ReduceOp::AVG});
  }
}

// The built-in hooks on the bucket's pieces: the same arithmetic as the
// hooks on a flat buffer (so the same bits), without building it.
std::shared_ptr<Work> BucketReducer::launch_direct(Bucket& b) {
  const auto& group = builtin_group_ ? builtin_group_ : pg_;
  // When every gradient is in its slot (bucket memory), the bucket is one
  // flat tensor: reduce that.
  bool in_slots = true;
  for (size_t s = 0; s < b.pieces.size() && in_slots; ++s) in_slots = b.pieces[s].is_same(b.buffer.view(s));
  auto reduce = [&](const AllreduceOptions& o) {
    return in_slots ? group->all_reduce(b.buffer.flat(), o) : group->all_reduce_coalesced(b.pieces, o);
  };
  switch (builtin_) {
    case Builtin::kNoop:
      return Work::completed({});
    case Builtin::kAllreduce:
      return reduce({ReduceOp::AVG});
    case Builtin::kFp16:
    case Builtin::kBf16: {
      // One collective that narrows, reduces and widens in place: the
      // bits of the hook's cast, all-reduce and cast back.
      AllreduceOptions o;
      o.op = ReduceOp::AVG;
      o.wire_dtype = builtin_ == Builtin::kFp16 ? at::kHalf : at::kBFloat16;
      return reduce(o);
    }
    case Builtin::kNone:
      break;
  }
  throw Error("DistributedDataParallel: no built-in reduction to run");
}

std::vector<std::shared_ptr<Work>> BucketReducer::launched_work() const {
  std::vector<std::shared_ptr<Work>> works;
  for (const auto& b : buckets_) {
    if (b.work) works.push_back(b.work);
  }
  return works;
}

std::string BucketReducer::write_back(const std::vector<char>& globally_used) {
  std::string error;
  const bool direct = direct_mode();
  for (size_t k = 0; k < next_launch_; ++k) {
    Bucket& b = buckets_[k];
    const at::Tensor& flat = b.buffer.flat();
    // A hook may return its result in a tensor of its own.
    const auto result = b.work && !direct ? b.work->result() : std::vector<at::Tensor>{};
    if (!result.empty() && result[0].defined() && result[0].data_ptr() != flat.data_ptr()) {
      if (result[0].numel() != flat.numel()) {
        error = "DistributedDataParallel: the communication hook returned " + std::to_string(result[0].numel()) +
                " elements for bucket " + std::to_string(k) + " of " + std::to_string(flat.numel());
        continue;
      }
      flat.copy_(result[0].reshape({-1}));
    }
    for (size_t s = 0; s < b.members.size(); ++s) {
      const size_t m = b.members[s];
      if (!globally_used[m]) continue;
      const at::Tensor& view = b.buffer.view(s);
      if (direct && !b.pieces[s].is_same(view)) continue;  // reduced in its .grad
      at::Tensor& grad = params_[m].mutable_grad();
      if (!grad.defined()) {
        grad = grads_in_buckets_ ? view : view.clone();
      } else if (grad.data_ptr() != view.data_ptr()) {
        grad.copy_(view);
      }
    }
  }
  return error;
}

void BucketReducer::reset() {
  for (auto& b : buckets_) {
    b.pending = b.members.size();
    b.work.reset();
    for (auto& piece : b.pieces) piece.reset();
  }
  std::fill(ready_.begin(), ready_.end(), false);
  next_launch_ = 0;
}

}  // namespace tdist::detail
