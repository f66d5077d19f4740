// ShardedUnit: sharding at construction, the gathers, the reductions. The
// contract is in unit.h.
#include "fsdp/unit.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <exception>

#include "process_group/async_ops.h"
#include "tdist/errors.h"
#include "util/check.h"

namespace tdist::detail {

namespace {

constexpr int64_t kAlign = 16;  // elements: every shard and full parameter starts 64-byte aligned (fp32)

std::vector<std::vector<int64_t>> shapes_of(const std::vector<at::Tensor>& params) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& p : params) out.emplace_back(p.sizes().begin(), p.sizes().end());
  return out;
}

// Waits for every work, also after one has failed (the others may still
// be writing into memory the caller is about to free), then rethrows the
// first failure. Every wait has the group's timeout, so this ends.
void wait_all(const std::vector<std::shared_ptr<Work>>& works) {
  std::exception_ptr first;
  for (const auto& w : works) {
    try {
      w->wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// Rows [first, first + n) of a full parameter (the whole of a 0-d one).
at::Tensor rows_of(const at::Tensor& full, const ParamShardLayout& p, int rank) {
  if (p.shape.empty()) return full;
  return full.narrow(0, p.first_row_on(rank), p.rows_on(rank));
}

// Points param at data, which may be of another dtype (mixed precision),
// keeping its gradient accumulator: set_data drops the accumulator on a
// dtype change, and the unit's gradient hooks hang on it. (A sharded
// unit's accumulators were made for the compute dtype, fully_sharded.cpp,
// so compute-dtype gradients reach them unconverted.)
void repoint(at::Tensor& param, const at::Tensor& data) {
  if (param.scalar_type() == data.scalar_type()) {
    param.set_data(data);
  } else {
    param.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
  }
}

at::ScalarType check_params(const std::string& label, const std::vector<std::string>& names,
                            const std::vector<at::Tensor>& params) {
  at::ScalarType dtype = params.empty() ? at::kFloat : params[0].scalar_type();
  for (size_t k = 0; k < params.size(); ++k) {
    const at::Tensor& p = params[k];
    if (p.layout() != at::kStrided) {
      throw UsageError(label + ": parameter '" + names[k] + "' is not a dense tensor; FSDP shards dense parameters");
    }
    if (p.device() != params[0].device()) {
      throw UsageError(label + ": parameter '" + names[k] + "' is on " + p.device().str() + " but '" + names[0] +
                       "' is on " + params[0].device().str() + "; a unit's parameters live on one device (pass "
                       "device_id to move the module there)");
    }
    if (p.scalar_type() != dtype) {
      throw UsageError(label + ": parameter '" + names[k] + "' is " + std::string(c10::toString(p.scalar_type())) +
                       " but '" + names[0] + "' is " + c10::toString(dtype) +
                       "; a unit holds one dtype: wrap the modules of each dtype in units of their own");
    }
  }
  return dtype;
}

}  // namespace

ShardedUnit::ShardedUnit(std::shared_ptr<ProcessGroup> pg, std::string label, std::vector<std::string> names,
                         std::vector<at::Tensor> params, bool shard, bool keep_full,
                         std::optional<at::ScalarType> compute_dtype, std::optional<at::ScalarType> reduce_dtype,
                         std::vector<char> keep_dtype)
    : pg_(std::move(pg)),
      label_(std::move(label)),
      names_(std::move(names)),
      params_(std::move(params)),
      sharded_(shard && pg_->size() > 1),
      shard_rank_(sharded_ ? pg_->rank() : 0),
      layout_(shapes_of(params_), sharded_ ? pg_->size() : 1, kAlign),
      device_(params_.empty() ? c10::Device(c10::kCPU) : params_[0].device()),
      dtype_(check_params(label_, names_, params_)),
      compute_dtype_(compute_dtype.value_or(dtype_)),
      reduce_dtype_(reduce_dtype.value_or(compute_dtype_)),
      cast_(compute_dtype_ != dtype_),
      swaps_(sharded_ || cast_),
      full_(compute_dtype_, swaps_ ? layout_.full_numel() : 0, device_),
      grad_full_(reduce_dtype_, sharded_ ? layout_.full_numel() : 0, device_) {
  keep_full_ = sharded_ && keep_full && !cast_;
  keep_dtype_ = std::move(keep_dtype);
  keep_dtype_.resize(params_.size(), 0);
  at::NoGradGuard no_grad;
  for (const auto& p : params_) {
    trainable_.push_back(p.requires_grad());
    has_frozen_ = has_frozen_ || !p.requires_grad();
    has_trainable_ = has_trainable_ || p.requires_grad();
  }
  if (keep_full_) {
    // The full parameters stay; a shard is this rank's rows of them.
    // In symmetric memory where the group has it: each rank's gather then
    // reads the others' shards straight from their copies.
    full_.adopt(zeroed(layout_.full_numel()));
    for (size_t k = 0; k < params_.size(); ++k) {
      const auto& pl = layout_.param(k);
      if (pl.numel() > 0) full_.tensor_at(pl.offset_in_full, pl.shape).copy_(params_[k]);
      shard_views_.push_back(
          full_.tensor_at(pl.offset_in_full + shard_rank_ * pl.shard_numel(), pl.shard_shape(shard_rank_)));
    }
  } else {
    chunk_ = zeroed(layout_.chunk_numel());
    for (size_t k = 0; k < params_.size(); ++k) {
      const auto& pl = layout_.param(k);
      at::Tensor view = tensor_on(chunk_.storage(), dtype_, pl.offset_in_chunk, pl.shard_shape(shard_rank_));
      if (view.numel() > 0) view.copy_(rows_of(params_[k], pl, shard_rank_));
      shard_views_.push_back(std::move(view));
    }
  }
  set_aside_.resize(params_.size());
  aside_.assign(params_.size(), 0);
  point_at_shards();  // the full tensors the module built are freed here
  state_ = swaps_ ? State::kSharded : State::kFull;
}

ShardedUnit::~ShardedUnit() { drop_in_flight(); }

at::Tensor ShardedUnit::zeroed(int64_t numel) const {
  if (device_.is_cpu()) return pg_->empty_symmetric({numel}, dtype_);  // symmetric where the group has it
  return at::zeros({numel}, at::TensorOptions().dtype(dtype_).device(device_));
}

void ShardedUnit::point_at_shards() {
  for (size_t k = 0; k < params_.size(); ++k) repoint(params_[k], shard_views_[k]);
}

void ShardedUnit::start_unshard(bool exact) {
  if (state_ != State::kSharded) return;
  if (!keep_full_) {
    full_.set_dtype(exact ? dtype_ : compute_dtype_);
    full_.allocate();
  }
  state_ = State::kGathering;
  if (!sharded_) {
    // Mixed precision without sharding: the full parameters in the compute
    // dtype are a local conversion.
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < params_.size(); ++k) {
      const auto& pl = layout_.param(k);
      if (pl.numel() > 0) full_.tensor_at(pl.offset_in_full, pl.shape).copy_(shard_views_[k]);
    }
    return;
  }
  // The all-gather input in the dtype of the output (a converted copy in a
  // pooled block: like the unit's other buffers, it comes and goes with
  // every gather).
  at::Tensor source = chunk_;
  if (full_.dtype() != dtype_ && !keep_full_) {
    source = pooled_empty(full_.dtype(), layout_.chunk_numel(), device_);
    source.copy_(chunk_);
  }
  for (size_t k = 0; k < params_.size(); ++k) {
    const auto& pl = layout_.param(k);
    if (pl.shard_numel() == 0) continue;  // every rank skips it: an empty parameter
    at::Tensor out = full_.tensor_at(pl.offset_in_full, {pl.shard_numel() * layout_.world_size()});
    // With the full parameters kept, this rank's shard is its slot of the
    // output (an all-gather in place).
    at::Tensor in = keep_full_ ? out.narrow(0, shard_rank_ * pl.shard_numel(), pl.shard_numel())
                               : source.narrow(0, pl.offset_in_chunk, pl.shard_numel());
    gathers_.push_back(pg_->all_gather_into_tensor(out, in));
    gather_inputs_.push_back(std::move(in));
  }
}

void ShardedUnit::release_full() {
  if (!keep_full_) full_.release();
}

void ShardedUnit::finish_unshard() {
  if (state_ == State::kFull) return;
  start_unshard();
  try {
    wait_all(gathers_);
  } catch (...) {
    gathers_.clear();
    gather_inputs_.clear();
    release_full();
    state_ = State::kSharded;
    throw;
  }
  gathers_.clear();
  gather_inputs_.clear();
  for (size_t k = 0; k < params_.size(); ++k) {
    const auto& pl = layout_.param(k);
    if (keep_dtype_[k] && full_.dtype() != dtype_) {
      repoint(params_[k], sharded_ ? full_.tensor_at(pl.offset_in_full, pl.shape).to(dtype_) : shard_views_[k]);
    } else {
      repoint(params_[k], full_.tensor_at(pl.offset_in_full, pl.shape));
    }
  }
  state_ = State::kFull;
}

void ShardedUnit::reshard() {
  if (!swaps_ || state_ == State::kSharded) return;
  if (state_ == State::kGathering) {
    // A prefetch nobody used: wait it out (it writes the full storage).
    std::vector<std::shared_ptr<Work>> gathers = std::move(gathers_);
    gathers_.clear();
    state_ = State::kSharded;
    try {
      wait_all(gathers);
    } catch (...) {
      gather_inputs_.clear();
      release_full();
      throw;
    }
    gather_inputs_.clear();
    release_full();
    return;
  }
  point_at_shards();
  release_full();
  state_ = State::kSharded;
}

void ShardedUnit::write_back() {
  TDIST_CHECK(state_ == State::kFull);
  if (!swaps_ || keep_full_) return;  // the shards are the full parameters' rows
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (shard_views_[k].numel() > 0) shard_views_[k].copy_(rows_of(params_[k], layout_.param(k), shard_rank_));
  }
}

void ShardedUnit::save_shards() {
  saved_shards_.clear();
  if (!keep_full_) return;
  for (const auto& v : shard_views_) saved_shards_.push_back(v.clone());
}

void ShardedUnit::restore_shards() {
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < saved_shards_.size(); ++k) shard_views_[k].copy_(saved_shards_[k]);
  saved_shards_.clear();
}

void ShardedUnit::check_params_in_place() const {
  const c10::StorageImpl* expected = keep_full_ || (state_ == State::kFull && swaps_)
                                         ? full_.storage_impl()
                                         : chunk_.storage().unsafeGetStorageImpl();
  for (size_t k = 0; k < params_.size(); ++k) {
    if (state_ == State::kFull && keep_dtype_[k] && full_.dtype() != dtype_) continue;  // a copy of its own
    if (params_[k].storage().unsafeGetStorageImpl() != expected) {
      throw UsageError(label_ + ": parameter '" + names_[k] +
                       "' was replaced after wrapping (module.to(), set_data or loading into the module): FSDP "
                       "shards the parameters it was given, so convert, move and load before wrapping");
    }
  }
}

void ShardedUnit::ensure_grad_buffer() {
  if (grad_full_.allocated()) return;
  grad_full_.allocate();
  grad_full_.tensor_at(0, {layout_.full_numel()}).zero_();
}

void ShardedUnit::set_aside_grad(size_t k) {
  if (!sharded_ || grads_full_ || !trainable_[k] || aside_[k]) return;
  set_aside_[k] = params_[k].grad();
  // Autograd accumulates into a .grad that exists: the full gradient lands
  // in its place in the unit's gradient buffer, the reduce-scatter input.
  ensure_grad_buffer();
  const auto& pl = layout_.param(k);
  params_[k].mutable_grad() = grad_full_.tensor_at(pl.offset_in_full, pl.shape);
  aside_[k] = 1;
}

void ShardedUnit::set_aside_shard_grads() {
  for (size_t k = 0; k < params_.size(); ++k) set_aside_grad(k);
}

at::Tensor ShardedUnit::take_full_grad(size_t k) {
  const auto& pl = layout_.param(k);
  at::Tensor& g = params_[k].mutable_grad();
  at::Tensor region = grad_full_.tensor_at(pl.offset_in_full, {pl.numel()});
  if (!g.defined()) {
    region.zero_();  // .grad was dropped after a no_sync backward: nothing to add
  } else if (g.storage().unsafeGetStorageImpl() != grad_full_.storage_impl()) {
    if (g.numel() != pl.numel()) {
      throw UsageError(label_ + ": the gradient of '" + names_[k] + "' has " + std::to_string(g.numel()) +
                       " elements where the full parameter has " + std::to_string(pl.numel()) +
                       " (was .grad set by hand, or an optimizer stepped during no_sync?)");
    }
    region.copy_(g.reshape({-1}));  // a .grad set by hand, or made after being dropped
  }
  g.reset();
  return grad_full_.tensor_at(pl.offset_in_full, {pl.shard_numel() * layout_.world_size()});
}

void ShardedUnit::start_reduce() {
  TDIST_CHECK(!reduce_.has_value());
  if (!has_trainable_) return;
  at::NoGradGuard no_grad;
  const detail::AsyncOpsScope async;  // backward goes on: the worker runs them
  set_aside_shard_grads();  // a unit whose backward never ran still takes part
  Reduce r;
  if (!sharded_) {
    for (size_t k = 0; k < params_.size(); ++k) {
      if (!trainable_[k] || params_[k].numel() == 0) continue;
      at::Tensor& g = params_[k].mutable_grad();
      if (!g.defined()) g = at::zeros(params_[k].sizes(), at::TensorOptions().dtype(dtype_).device(device_));
      if (!g.is_contiguous()) g = g.contiguous();
      // In reduce_dtype_: a converted copy, converted back when it is done.
      r.inputs.push_back(g.scalar_type() == reduce_dtype_ ? g : g.to(reduce_dtype_));
      r.targets.push_back(k);
    }
    if (!r.inputs.empty()) r.works.push_back(pg_->all_reduce_coalesced(r.inputs, {ReduceOp::AVG}));
    reduce_ = std::move(r);
    return;
  }
  ensure_grad_buffer();
  r.out = pooled_empty(reduce_dtype_, layout_.chunk_numel(), device_);
  for (size_t k = 0; k < params_.size(); ++k) {
    const auto& pl = layout_.param(k);
    if (!trainable_[k] || pl.shard_numel() == 0) continue;
    at::Tensor in = take_full_grad(k);
    r.works.push_back(pg_->reduce_scatter_tensor(r.out.narrow(0, pl.offset_in_chunk, pl.shard_numel()), in,
                                                 {ReduceOp::AVG}));
    r.inputs.push_back(std::move(in));
  }
  reduce_ = std::move(r);
}

bool ShardedUnit::reduce_done() const {
  if (!reduce_) return true;
  for (const auto& w : reduce_->works) {
    if (!w->is_completed()) return false;
  }
  return true;
}

void ShardedUnit::finish_reduce() {
  if (!reduce_) return;
  Reduce r = std::move(*reduce_);
  reduce_.reset();
  wait_all(r.works);
  grads_full_ = false;
  if (!sharded_) {  // reduced in place, or in converted copies
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < r.inputs.size(); ++i) {
      at::Tensor& g = params_[r.targets[i]].mutable_grad();
      if (!r.inputs[i].is_same(g)) g.copy_(r.inputs[i]);
    }
    return;
  }
  r.inputs.clear();
  grad_full_.release();
  at::NoGradGuard no_grad;
  // The shard gradients are views of one pooled chunk, in the shards' dtype
  // (reduced in another: each reduced shard converted into it, the reduced
  // chunk freed after).
  at::Tensor grads = reduce_dtype_ == dtype_ ? r.out : pooled_empty(dtype_, layout_.chunk_numel(), device_);
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!trainable_[k]) continue;
    const auto& pl = layout_.param(k);
    if (!grads.is_same(r.out) && pl.shard_numel() > 0) {
      const auto rows = [&](const at::Tensor& chunk) { return chunk.narrow(0, pl.offset_in_chunk, pl.shard_numel()); };
      rows(grads).copy_(rows(r.out));
    }
    at::Tensor g = tensor_on(grads.storage(), dtype_, pl.offset_in_chunk, shard_views_[k].sizes());
    if (set_aside_[k].defined()) {
      set_aside_[k].add_(g);
      params_[k].mutable_grad() = std::move(set_aside_[k]);
    } else {
      params_[k].mutable_grad() = std::move(g);
    }
    set_aside_[k] = at::Tensor();
    aside_[k] = 0;
  }
}

void ShardedUnit::drop_in_flight() noexcept {
  for (auto& w : gathers_) {
    try {
      w->wait();
    } catch (...) {
    }
  }
  gathers_.clear();
  gather_inputs_.clear();
  if (reduce_) {
    for (auto& w : reduce_->works) {
      try {
        w->wait();
      } catch (...) {
      }
    }
    reduce_.reset();
  }
  if (!grads_full_) {
    for (size_t k = 0; k < params_.size(); ++k) {
      if (aside_[k]) params_[k].mutable_grad() = std::move(set_aside_[k]);
      set_aside_[k] = at::Tensor();
      aside_[k] = 0;
    }
    grad_full_.release();
  }
  if (swaps_ && state_ != State::kSharded) {
    if (state_ == State::kFull) point_at_shards();
    release_full();
    state_ = State::kSharded;
  }
}

}  // namespace tdist::detail
