// ShardedUnit: sharding at construction, the gathers, the reductions. The
// contract is in unit.h.
#include "fsdp/unit.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <exception>

#include "process_group/async_ops.h"
#include "trace/flight_recorder.h"
#include "tdist/errors.h"
#include "util/check.h"

namespace tdist::detail {

namespace {

constexpr int64_t kAlign = 16;  // elements: every shard and full parameter starts 64-byte aligned (fp32)

std::vector<std::vector<int64_t>> shapes_of(const std::vector<FsdpParamSpec>& params) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& p : params) out.emplace_back(p.param.sizes().begin(), p.param.sizes().end());
  return out;
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

// The parameters' dtype; UsageError unless they are dense, on one device,
// of one dtype.
at::ScalarType check_params(const std::string& label, const std::vector<FsdpParamSpec>& params) {
  if (params.empty()) return at::kFloat;
  const FsdpParamSpec& first = params[0];
  const at::ScalarType dtype = first.param.scalar_type();
  for (const auto& spec : params) {
    const at::Tensor& p = spec.param;
    if (p.layout() != at::kStrided) {
      throw UsageError(label + ": parameter '" + spec.name + "' is not a dense tensor; FSDP shards dense parameters");
    }
    if (p.device() != first.param.device()) {
      throw UsageError(label + ": parameter '" + spec.name + "' is on " + p.device().str() + " but '" + first.name +
                       "' is on " + first.param.device().str() + "; a unit's parameters live on one device (pass "
                       "device_id to move the module there)");
    }
    if (p.scalar_type() != dtype) {
      throw UsageError(label + ": parameter '" + spec.name + "' is " + std::string(c10::toString(p.scalar_type())) +
                       " but '" + first.name + "' is " + c10::toString(dtype) +
                       "; a unit holds one dtype: wrap the modules of each dtype in units of their own");
    }
  }
  return dtype;
}

}  // namespace


// ---- made: the shards ---------------------------------------------------------

ShardedUnit::ShardedUnit(std::shared_ptr<ProcessGroup> pg, std::string label, std::vector<FsdpParamSpec> specs,
                         const UnitOptions& options)
    : pg_(std::move(pg)),
      replicate_(options.replicate_group && options.replicate_group->size() > 1 ? options.replicate_group : nullptr),
      label_(std::move(label)),
      sharded_(options.shard && pg_->size() > 1),
      shard_rank_(sharded_ ? pg_->rank() : 0),
      layout_(shapes_of(specs), sharded_ ? pg_->size() : 1, kAlign),
      device_(specs.empty() ? c10::Device(c10::kCPU) : specs[0].param.device()),
      dtype_(check_params(label_, specs)),
      compute_dtype_(options.compute_dtype.value_or(dtype_)),
      reduce_dtype_(options.reduce_dtype.value_or(compute_dtype_)),
      keep_full_(sharded_ && options.keep_full && compute_dtype_ == dtype_),
      full_(compute_dtype_, swaps() ? layout_.full_numel() : 0, device_),
      grad_full_(reduce_dtype_, sharded_ ? layout_.full_numel() : 0, device_) {
  at::NoGradGuard no_grad;
  if (sharded_ && !keep_full_ && options.post_forward_group && options.post_forward_group->size() > 1) {
    post_pg_ = options.post_forward_group;
    post_layout_.emplace(shapes_of(specs), post_pg_->size(), kAlign);
  }
  params_.reserve(specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    FsdpParam p;
    p.name = std::move(specs[k].name);
    p.original_name = std::move(specs[k].original_name);
    p.aliases = std::move(specs[k].aliases);
    p.param = std::move(specs[k].param);
    p.layout = &layout_.param(k);
    p.trainable = p.param.requires_grad();
    p.keep_dtype = specs[k].keep_dtype;
    params_.push_back(std::move(p));
  }
  if (keep_full_) {
    // The full parameters stay; a shard is this rank's rows of them.
    // In symmetric memory where the group has it: each rank's gather then
    // reads the others' shards straight from their copies.
    full_.adopt(zeroed(layout_.full_numel()));
    for (FsdpParam& p : params_) {
      const ParamShardLayout& pl = *p.layout;
      if (pl.numel() > 0) full_of(p).copy_(p.param);
      p.shard = full_.tensor_at(pl.offset_in_full + shard_rank_ * pl.shard_numel(), pl.shard_shape(shard_rank_));
    }
  } else {
    chunk_ = zeroed(layout_.chunk_numel());
    for (FsdpParam& p : params_) {
      const ParamShardLayout& pl = *p.layout;
      p.shard = tensor_on(chunk_.storage(), dtype_, pl.offset_in_chunk, pl.shard_shape(shard_rank_));
      if (p.shard.numel() > 0) p.shard.copy_(rows_of(p.param, pl, shard_rank_));
    }
  }
  point_at_shards();  // the full tensors the module built are freed here
  state_ = swaps() ? State::kSharded : State::kFull;
}

ShardedUnit::~ShardedUnit() { drop_in_flight(); }

void ShardedUnit::await_load(const std::vector<size_t>& indices) {
  for (size_t k : indices) {
    FsdpParam& p = params_.at(k);
    if (p.awaiting_load_at >= 0) continue;
    p.awaiting_load_at = static_cast<int64_t>(p.param._version());
    ++awaiting_;
  }
}

void ShardedUnit::check_awaiting() {
  for (FsdpParam& p : params_) {
    if (p.awaiting_load_at < 0) continue;
    if (static_cast<int64_t>(p.param._version()) != p.awaiting_load_at) {
      p.awaiting_load_at = -1;
      --awaiting_;
      continue;
    }
    throw UsageError(label_ + ": '" + (p.model_name.empty() ? p.name : p.model_name) +
                     "' was made with skip_init and nothing has written it since: load the model's weights "
                     "(load_pretrained, load_full_state_dict, load_sharded_checkpoint, a Checkpointer's restore) "
                     "before a forward or a save; a name the loaded files lack stays unset");
  }
}

bool ShardedUnit::has_frozen() const {
  return std::any_of(params_.begin(), params_.end(), [](const FsdpParam& p) { return !p.trainable; });
}

bool ShardedUnit::has_trainable() const {
  return std::any_of(params_.begin(), params_.end(), [](const FsdpParam& p) { return p.trainable; });
}

at::Tensor ShardedUnit::zeroed(int64_t numel) const {
  if (device_.is_cpu()) return pg_->empty_symmetric({numel}, dtype_);  // symmetric where the group has it
  return at::zeros({numel}, at::TensorOptions().dtype(dtype_).device(device_));
}

at::Tensor ShardedUnit::full_of(const FsdpParam& p) const {
  return full_.tensor_at(p.layout->offset_in_full, p.layout->shape);
}

at::Tensor ShardedUnit::padded_full_of(const FsdpParam& p) const {
  return full_.tensor_at(p.layout->offset_in_full, {p.layout->shard_numel() * layout_.world_size()});
}

void ShardedUnit::point_at_shards() {
  for (FsdpParam& p : params_) repoint(p.param, p.shard);
}

// ---- unshard: one all-gather ------------------------------------------------------

void ShardedUnit::launch_unshard(bool exact) {
  const detail::FrSiteScope site(trace_name_);
  // A post-forward chunk serves when the shards have not changed since it
  // was taken (an optimizer step moves the version counters).
  const bool from_post = post_ && !exact && post_->versions == param_versions();
  if (!from_post) post_.reset();
  if (!keep_full_) {
    full_.set_dtype(exact ? dtype_ : compute_dtype_);
    full_.allocate();
  }
  state_ = State::kGathering;
  if (!sharded_) {
    // Mixed precision without sharding: the full parameters in the compute
    // dtype are a local conversion.
    at::NoGradGuard no_grad;
    for (const FsdpParam& p : params_) {
      if (p.layout->numel() > 0) full_of(p).copy_(p.shard);
    }
    return;
  }
  // The all-gather input in the dtype of the output (a converted copy in a
  // pooled block: like the unit's other buffers, it comes and goes with
  // every gather).
  if (from_post) {
    gather_ = launch_post_forward_gather();
    return;
  }
  at::Tensor converted;
  if (full_.dtype() != dtype_ && !keep_full_) {
    converted = pooled_empty(full_.dtype(), layout_.chunk_numel(), device_);
    converted.copy_(chunk_);
  }
  const at::Tensor& source = converted.defined() ? converted : chunk_;
  std::vector<at::Tensor> outs, ins;
  for (const FsdpParam& p : params_) {
    if (p.empty()) continue;  // every rank skips it: an empty parameter
    const int64_t n = p.layout->shard_numel();
    outs.push_back(padded_full_of(p));
    // With the full parameters kept, this rank's shard is its slot of the
    // output (an all-gather in place).
    ins.push_back(keep_full_ ? outs.back().narrow(0, shard_rank_ * n, n)
                             : source.narrow(0, p.layout->offset_in_chunk, n));
  }
  gather_ = launch_gather(*pg_, std::move(outs), std::move(ins), std::move(converted));
}

// The post-forward layout's rows of every parameter sit at the start of its
// padded region in the full storage (k divides the group's size, so the k
// ranks' padded rows are no more than the group's): each rank's piece of
// the chunk gathers there, within the k ranks.
GatherRecord ShardedUnit::launch_post_forward_gather() {
  const detail::FrSiteScope site(trace_name_);
  const ShardLayout& post = *post_layout_;
  at::Tensor chunk = std::move(post_->chunk);
  post_.reset();
  std::vector<at::Tensor> outs, ins;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t n = post.param(i).shard_numel();
    if (n == 0) continue;
    outs.push_back(padded_full_of(params_[i]).narrow(0, 0, n * post.world_size()));
    ins.push_back(chunk.narrow(0, post.param(i).offset_in_chunk, n));
  }
  return launch_gather(*post_pg_, std::move(outs), std::move(ins), std::move(chunk));
}

int64_t ShardedUnit::param_versions() const {
  int64_t sum = 0;
  for (const FsdpParam& p : params_) sum += static_cast<int64_t>(p.param._version());
  return sum;
}

void ShardedUnit::start_unshard(bool exact) {
  check_loaded();
  if (state_ != State::kSharded) return;
  try {
    launch_unshard(exact);
  } catch (...) {
    // Nothing was queued (a refused op or a failed allocation): sharded again.
    gather_.reset();
    release_full();
    state_ = State::kSharded;
    throw;
  }
}

void ShardedUnit::finish_unshard() {
  check_loaded();
  if (state_ == State::kFull) return;
  start_unshard();
  if (gather_) {
    const GatherRecord g = std::move(*gather_);
    gather_.reset();
    try {
      g.wait();
    } catch (...) {
      release_full();
      state_ = State::kSharded;
      throw;
    }
  }
  for (FsdpParam& p : params_) {
    if (p.keep_dtype && full_.dtype() != dtype_) {
      repoint(p.param, sharded_ ? full_of(p).to(dtype_) : p.shard);  // a copy in its own dtype
    } else {
      repoint(p.param, full_of(p));
    }
  }
  state_ = State::kFull;
}

void ShardedUnit::unshard(bool exact) {
  check_loaded();
  if (exact && !sharded_ && state_ == State::kSharded) return;  // the shards are whole and exact
  start_unshard(exact);
  finish_unshard();
}

// ---- reshard ------------------------------------------------------------------------

void ShardedUnit::release_full() {
  if (!keep_full_) full_.release();
}

void ShardedUnit::reshard() {
  post_.reset();
  if (!swaps() || state_ == State::kSharded) return;
  if (state_ == State::kGathering) {
    // A prefetch nobody used: wait it out (it writes the full storage).
    std::optional<GatherRecord> g = std::move(gather_);
    gather_.reset();
    state_ = State::kSharded;
    try {
      if (g) g->wait();
    } catch (...) {
      release_full();
      throw;
    }
    release_full();
    return;
  }
  point_at_shards();
  release_full();
  state_ = State::kSharded;
}

void ShardedUnit::reshard_after_forward() {
  if (!post_pg_ || state_ != State::kFull) {
    reshard();
    return;
  }
  const ShardLayout& post = *post_layout_;
  const int64_t me = post_pg_->rank();
  PostForward pf;
  {
    at::NoGradGuard no_grad;
    pf.chunk = pooled_empty(full_.dtype(), post.chunk_numel(), device_);
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t n = post.param(i).shard_numel();
      if (n == 0) continue;
      pf.chunk.narrow(0, post.param(i).offset_in_chunk, n).copy_(padded_full_of(params_[i]).narrow(0, me * n, n));
    }
  }
  reshard();
  pf.versions = param_versions();  // as the parameters stand on their shards
  post_ = std::move(pf);
}

// ---- summon_full_params ---------------------------------------------------------------

void ShardedUnit::write_back() {
  TDIST_CHECK(state_ == State::kFull);
  if (!swaps() || keep_full_) return;  // the shards are the full parameters' rows
  at::NoGradGuard no_grad;
  for (FsdpParam& p : params_) {
    if (p.shard.numel() > 0) p.shard.copy_(rows_of(p.param, *p.layout, shard_rank_));
  }
}

void ShardedUnit::save_shards() {
  for (FsdpParam& p : params_) p.saved_shard = keep_full_ ? p.shard.clone() : at::Tensor();
}

void ShardedUnit::restore_shards() {
  at::NoGradGuard no_grad;
  for (FsdpParam& p : params_) {
    if (p.saved_shard.defined()) p.shard.copy_(p.saved_shard);
    p.saved_shard = at::Tensor();
  }
}

void ShardedUnit::check_params_in_place() const {
  const c10::StorageImpl* expected = keep_full_ || (state_ == State::kFull && swaps())
                                         ? full_.storage_impl()
                                         : chunk_.storage().unsafeGetStorageImpl();
  for (const FsdpParam& p : params_) {
    if (state_ == State::kFull && p.keep_dtype && full_.dtype() != dtype_) continue;  // a copy of its own
    if (p.param.storage().unsafeGetStorageImpl() != expected) {
      throw UsageError(label_ + ": parameter '" + p.name +
                       "' was replaced after wrapping (module.to(), set_data or loading into the module): FSDP "
                       "shards the parameters it was given, so convert, move and load before wrapping");
    }
  }
}

// ---- backward: gradients accumulate in the full buffer ------------------------------

void ShardedUnit::ensure_grad_buffer() {
  if (grad_full_.allocated()) return;
  grad_full_.allocate();
  grad_full_.tensor_at(0, {layout_.full_numel()}).zero_();
}

void ShardedUnit::set_aside_grad(size_t k) {
  FsdpParam& p = params_[k];
  if (!sharded_ || grads_full_ || !p.trainable || p.grad_set_aside) return;
  p.grad_before = p.param.grad();
  if (late_grad_buffer_) {
    // Autograd makes (or takes) a tensor of its own; start_reduce copies it
    // into the buffer.
    p.param.mutable_grad() = at::Tensor();
    p.grad_set_aside = true;
    return;
  }
  // Autograd accumulates into a .grad that exists: the full gradient lands
  // in its place in the unit's gradient buffer, the reduce-scatter input.
  ensure_grad_buffer();
  p.param.mutable_grad() = grad_full_.tensor_at(p.layout->offset_in_full, p.layout->shape);
  p.grad_set_aside = true;
}

void ShardedUnit::set_aside_shard_grads() {
  for (size_t k = 0; k < params_.size(); ++k) set_aside_grad(k);
}

at::Tensor ShardedUnit::take_full_grad(FsdpParam& p) {
  const ParamShardLayout& pl = *p.layout;
  at::Tensor& g = p.param.mutable_grad();
  at::Tensor region = grad_full_.tensor_at(pl.offset_in_full, {pl.numel()});
  if (!g.defined()) {
    region.zero_();  // .grad was dropped after a no_sync backward: nothing to add
  } else if (g.is_sparse() || g.storage().unsafeGetStorageImpl() != grad_full_.storage_impl()) {
    if (g.numel() != pl.numel()) {
      throw UsageError(label_ + ": the gradient of '" + p.name + "' has " + std::to_string(g.numel()) +
                       " elements where the full parameter has " + std::to_string(pl.numel()) +
                       " (was .grad set by hand, or an optimizer stepped during no_sync?)");
    }
    // Autograd's own tensor (late_grad_buffer: sparse from an embedding,
    // else in the parameter's layout), a .grad set by hand, or one made
    // after being dropped; copied in the parameter's shape.
    at::Tensor dst = region.view(pl.shape);
    if (g.is_sparse()) {
      dst.zero_();
      dst.add_(g);
    } else {
      dst.copy_(g.reshape(pl.shape));
    }
  }
  g.reset();
  return grad_full_.tensor_at(pl.offset_in_full, {pl.shard_numel() * layout_.world_size()});
}

// ---- reduce: one reduce-scatter (or all-reduce) ---------------------------------------

void ShardedUnit::start_reduce() {
  const detail::FrSiteScope site(trace_name_);
  TDIST_CHECK(!reduce_.has_value());
  if (!has_trainable()) return;
  at::NoGradGuard no_grad;
  const detail::AsyncOpsScope async;  // backward goes on: the worker runs them
  set_aside_shard_grads();  // a unit whose backward never ran still takes part
  if (!sharded_) {
    std::vector<at::Tensor> inputs;
    std::vector<FsdpParam*> targets;
    for (FsdpParam& p : params_) {
      if (!p.trainable || p.param.numel() == 0) continue;
      at::Tensor& g = p.param.mutable_grad();
      if (!g.defined()) g = at::zeros(p.param.sizes(), at::TensorOptions().dtype(dtype_).device(device_));
      if (!g.is_contiguous()) g = g.contiguous();
      // In reduce_dtype_: a converted copy, converted back when it is done.
      if (reduce_zeros_) g.zero_();
      inputs.push_back(g.scalar_type() == reduce_dtype_ ? g : g.to(reduce_dtype_));
      targets.push_back(&p);
    }
    // Hybrid sharding over shard groups of one: the replicas hold it all.
    ProcessGroup& group = replicate_ && pg_->size() == 1 ? *replicate_ : *pg_;
    reduce_ = launch_all_reduce(group, std::move(inputs), std::move(targets));
    return;
  }
  ensure_grad_buffer();
  at::Tensor out = pooled_empty(reduce_dtype_, layout_.chunk_numel(), device_);
  std::vector<at::Tensor> outs, ins;
  for (FsdpParam& p : params_) {
    if (!p.trainable || p.empty()) continue;
    ins.push_back(take_full_grad(p));
    if (reduce_zeros_) ins.back().zero_();
    outs.push_back(out.narrow(0, p.layout->offset_in_chunk, p.layout->shard_numel()));
  }
  reduce_ = launch_reduce_scatter(*pg_, replicate_, std::move(out), std::move(outs), std::move(ins));
}

void ShardedUnit::finish_reduce() {
  if (!reduce_) return;
  const ReduceRecord r = std::move(*reduce_);
  reduce_.reset();
  r.wait();
  grads_full_ = false;
  if (!sharded_) {
    finish_reduce_unsharded(r);
    return;
  }
  grad_full_.release();
  at::NoGradGuard no_grad;
  // The shard gradients are views of one pooled chunk, in the shards' dtype
  // (reduced in another: each reduced shard converted into it, the reduced
  // chunk freed after).
  at::Tensor grads = reduce_dtype_ == dtype_ ? r.out : pooled_empty(dtype_, layout_.chunk_numel(), device_);
  for (FsdpParam& p : params_) {
    if (!p.trainable) continue;
    const ParamShardLayout& pl = *p.layout;
    if (!grads.is_same(r.out) && !p.empty()) {
      grads.narrow(0, pl.offset_in_chunk, pl.shard_numel()).copy_(r.out.narrow(0, pl.offset_in_chunk, pl.shard_numel()));
    }
    at::Tensor g = tensor_on(grads.storage(), dtype_, pl.offset_in_chunk, p.shard.sizes());
    if (p.grad_before.defined()) {
      p.grad_before.add_(g);
      p.param.mutable_grad() = std::move(p.grad_before);
    } else {
      p.param.mutable_grad() = std::move(g);
    }
    p.grad_before = at::Tensor();
    p.grad_set_aside = false;
  }
}

void ShardedUnit::finish_reduce_unsharded(const ReduceRecord& r) {
  // Reduced in place, or in converted copies.
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < r.inputs.size(); ++i) {
    at::Tensor& g = r.targets[i]->param.mutable_grad();
    if (!r.inputs[i].is_same(g)) g.copy_(r.inputs[i]);
  }
}

// ---- after a failure ------------------------------------------------------------------

void ShardedUnit::drop_in_flight() noexcept {
  if (gather_) gather_->drop_quietly();
  gather_.reset();
  if (reduce_) reduce_->drop_quietly();
  reduce_.reset();
  if (!grads_full_) {
    for (FsdpParam& p : params_) {
      if (p.grad_set_aside) p.param.mutable_grad() = std::move(p.grad_before);
      p.grad_before = at::Tensor();
      p.grad_set_aside = false;
    }
    grad_full_.release();
  }
  if (swaps() && state_ != State::kSharded) {
    if (state_ == State::kFull) point_at_shards();
    release_full();
    state_ = State::kSharded;
  }
}

}  // namespace tdist::detail
