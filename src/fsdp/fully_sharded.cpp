// FullyShardedCore: a wrapper's construction (which parameters its unit
// owns, the checks across ranks, the broadcast, the sharding) and its
// forward (gather, hooks for backward, free). The contract is in
// include/tdist/fsdp.h; the iteration is the Coordinator's
// (src/fsdp/coordinator.h).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/batchnorm.h>

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "autograd/recompute_phase.h"
#include "ddp/model_check.h"
#include "deferred/deferred.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/coordinator.h"
#include "fsdp/fsdp_state.h"
#include "fsdp/materialize_unit.h"
#include "fsdp/wrapper_groups.h"
#include "process_group/async_ops.h"
#include "tdist/errors.h"
#include "tdist/fsdp.h"
#include "trace/flight_recorder.h"
#include "trace/timeline.h"

namespace tdist::detail {

namespace {

// Which parameters some wrapper shards, each with the unit that owns it and
// the name it has there: a parameter is owned by one unit (a module
// wrapped twice, or a tied parameter two hand-built units both find, is
// refused).
struct Claim {
  std::string label;  // the owning unit's
  std::string name;   // the parameter's name in that unit
};
struct Claims {
  std::mutex mu;
  std::unordered_map<const c10::TensorImpl*, Claim> owner;
};
Claims& claims() {
  static Claims* c = new Claims;  // outlives static destruction
  return *c;
}

bool claimed(const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(claims().mu);
  return claims().owner.count(p.unsafeGetTensorImpl()) > 0;
}

// Claims params (named as in this unit) for the unit `label`, or, if one is
// owned already, claims none and throws a UsageError naming both uses and
// the fix.
void claim(const std::string& label, const std::vector<std::string>& names, const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(claims().mu);
  for (size_t k = 0; k < params.size(); ++k) {
    const auto it = claims().owner.find(params[k].unsafeGetTensorImpl());
    if (it != claims().owner.end()) {
      const Claim other = it->second;
      for (size_t j = 0; j < k; ++j) claims().owner.erase(params[j].unsafeGetTensorImpl());
      throw UsageError(label + ": parameter '" + names[k] + "' is already sharded by another FSDP wrapper (" +
                       other.label + ", which owns it as '" + other.name +
                       "'): a module can be wrapped only once, and a parameter shared by several modules (a tied "
                       "weight) belongs to one unit. If '" + names[k] + "' and '" + other.name +
                       "' are one tensor used in two units, wrap the modules that share it in one unit (an FSDP "
                       "wrapper around all of them), or build the units with auto_wrap_policy, which leaves a "
                       "shared parameter to the wrapper around all its uses");
    }
    claims().owner.emplace(params[k].unsafeGetTensorImpl(), Claim{label, names[k]});
  }
}

void unclaim(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(claims().mu);
  for (const auto& p : params) claims().owner.erase(p.unsafeGetTensorImpl());
}

std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

// The parameters and buffers the unit over `m` owns: those of m and its
// children, each tensor once (a tied parameter under its first name),
// stopping at inner wrappers (they own theirs) except for the parameters
// no wrapper claimed there (auto_wrap_children left a shared one to this
// wrapper), and leaving out those auto_wrap_children defers to a wrapper
// around this one. Names: in the wrapped module (a CheckpointModule's
// "module" step included).
struct Collected {
  std::vector<char> norm;  // per parameter: a BatchNorm's
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<std::string> buffer_names;
  std::vector<at::Tensor> buffers;
  std::vector<torch::nn::Module*> owners;  // the modules with a parameter or buffer of the unit's own, in model order
  std::unordered_set<const c10::TensorImpl*> seen;
};
void collect(torch::nn::Module& m, const std::string& prefix, bool in_inner, Collected& out) {
  const bool norm = dynamic_cast<torch::nn::BatchNorm1dImpl*>(&m) || dynamic_cast<torch::nn::BatchNorm2dImpl*>(&m) ||
                    dynamic_cast<torch::nn::BatchNorm3dImpl*>(&m);
  const auto* left = left_to_outer();
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    const c10::TensorImpl* impl = p.value().unsafeGetTensorImpl();
    if (left && left->count(impl)) continue;
    if (in_inner && claimed(p.value())) continue;
    if (!out.seen.insert(impl).second) continue;
    out.norm.push_back(norm);
    out.names.push_back(join(prefix, p.key()));
    out.params.push_back(p.value());
    if (out.owners.empty() || out.owners.back() != &m) out.owners.push_back(&m);
  }
  if (!in_inner) {
    for (const auto& b : m.named_buffers(/*recurse=*/false)) {
      out.buffer_names.push_back(join(prefix, b.key()));
      out.buffers.push_back(b.value());
      if (out.owners.empty() || out.owners.back() != &m) out.owners.push_back(&m);
    }
  }
  for (const auto& c : m.named_children()) {
    const bool inner = in_inner || dynamic_cast<FullyShardedModule*>(c.value().get()) != nullptr;
    collect(*c.value(), join(prefix, c.key()), inner, out);
  }
}

// Every name of each parameter in m's tree, into wrappers too, in model
// order, without the wrappers' "module" steps.
void registrations(torch::nn::Module& m, const std::string& original,
                   std::unordered_map<const c10::TensorImpl*, std::vector<std::string>>& out) {
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    out[p.value().unsafeGetTensorImpl()].push_back(join(original, p.key()));
  }
  const bool wrapper = dynamic_cast<WrapperModule*>(&m) != nullptr;
  for (const auto& c : m.named_children()) {
    const bool step = wrapper && c.key() == "module";
    registrations(*c.value(), step ? original : join(original, c.key()), out);
  }
}

// Whether rank 0's unit holds values (rank 0 says; collective over pg).
bool rank0_holds_values(ProcessGroup& pg, bool holds) {
  std::vector<at::Tensor> flag{at::tensor({holds ? int64_t{1} : int64_t{0}}, at::kLong)};
  broadcast_from_rank0(pg, flag);
  return flag[0].item<int64_t>() == 1;
}

// Per unit parameter: its first name in model order (without wrapper
// steps) and its other names.
void name_params(torch::nn::Module& module, std::vector<FsdpParamSpec>& specs) {
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> names;
  registrations(module, "", names);
  for (FsdpParamSpec& spec : specs) {
    const auto& all = names.at(spec.param.unsafeGetTensorImpl());
    spec.original_name = all.front();
    spec.aliases.assign(all.begin() + 1, all.end());
  }
}

// The mixed precision of the options, from either form of them.
MixedPrecision resolve_mixed_precision(const FullyShardedDataParallelOptions& o, const std::string& label) {
  MixedPrecision mp = o.mixed_precision;
  const bool xla = o.compute_dtype || o.buffer_dtype || o.fp32_reduce_scatter;
  if (xla) {
    if (mp.param_dtype || mp.reduce_dtype || mp.buffer_dtype) {
      throw UsageError(label + ": mixed precision given twice (mixed_precision and torch_xla's compute_dtype, "
                               "buffer_dtype, fp32_reduce_scatter): give one form");
    }
    mp.param_dtype = o.compute_dtype;
    mp.reduce_dtype = o.fp32_reduce_scatter ? std::optional<at::ScalarType>(at::kFloat) : o.compute_dtype;
    mp.buffer_dtype = o.buffer_dtype;
  }
  for (const auto& t : {mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype}) {
    if (t && !at::isFloatingType(*t)) {
      throw UsageError(label + ": mixed precision dtypes must be floating point, not " + c10::toString(*t));
    }
  }
  return mp;
}

// BatchNorm computes with fp32 weights on bf16 inputs and fp32 running
// statistics, not with bf16 weights: its parameters stay in their dtype,
// unless its buffers were converted to the compute dtype too.
std::vector<char> keep_norm_dtype(const FullyShardedDataParallelOptions& o, std::vector<char> norm) {
  const MixedPrecision& mp = o.mixed_precision;
  if (mp.buffer_dtype && mp.buffer_dtype == mp.param_dtype) norm.assign(norm.size(), 0);
  return norm;
}

// Makes the gradient tracker over `trainable` (indices into params). Under
// mixed precision, a sharded unit's gradients accumulate in its gradient
// buffer, in reduce_dtype, and never in the parameters' dtype: autograd's
// accumulators are made while each parameter that computes in param_dtype
// shows that dtype (and its full shape), or autograd would convert every
// compute-dtype gradient to the parameters' dtype before it accumulates
// (full-size temporaries in every backward, and a second conversion into
// the buffer). Units without sharding (NO_SHARD, one rank) keep theirs:
// their .grad is the parameters' own, accumulated in its dtype.
void make_tracker(FsdpState& s, const std::vector<at::Tensor>& params, const std::vector<char>& keep_dtype,
                  const std::vector<size_t>& trainable) {
  std::vector<at::Tensor> tracked, originals;  // originals[i]: an alias of tracked[i] as it was, if it was re-pointed
  tracked.reserve(trainable.size());
  originals.reserve(trainable.size());
  const std::optional<at::ScalarType> compute = s.options.mixed_precision.param_dtype;
  const bool sharded = s.options.sharding_strategy != ShardingStrategy::NO_SHARD && s.pg->size() > 1;  // as the unit's
  const auto restore = [&] {
    for (size_t i = 0; i < originals.size(); ++i) {
      if (originals[i].defined()) tracked[i].unsafeGetTensorImpl()->shallow_copy_from(originals[i].getIntrusivePtr());
    }
  };
  try {
    for (size_t k : trainable) {
      at::Tensor p = params[k];
      tracked.push_back(p);
      originals.emplace_back();
      if (!sharded || !compute || *compute == p.scalar_type() || keep_dtype[k]) continue;
      // A stand-in of the compute dtype and the full shape (no memory of its own).
      const at::Tensor stand_in = at::empty({}, p.options().dtype(*compute)).expand(p.sizes());
      originals.back() = p.detach();
      p.unsafeGetTensorImpl()->shallow_copy_from(stand_in.getIntrusivePtr());
    }
    // An accumulator made earlier (a graph of the module still held) keeps
    // its metadata: still correct, with autograd's conversion.
    s.tracker.emplace(tracked, s.shared_from_this(), /*with_pre_hooks=*/true);
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

}  // namespace

FullyShardedCore::FullyShardedCore(torch::nn::Module& module, FullyShardedDataParallelOptions options) {
  if (dynamic_cast<FullyShardedModule*>(&module)) {
    throw UsageError("FullyShardedDataParallel: the module is already an FSDP wrapper; wrap the inner module once");
  }
  const DeferredInitPause pause;  // made inside a deferred_init (a unit built in a model's constructor): for real
  const WrapperGroups groups = resolve_groups(options);
  const auto& pg = groups.shard;
  state_ = std::make_shared<FsdpState>();
  FsdpState& s = *state_;
  s.pg = groups.shard;
  s.replicate_pg = groups.replicate;
  s.world_pg = groups.world;
  s.options = std::move(options);
  const ShardingStrategy strategy = s.options.sharding_strategy;
  const bool zero3 = strategy == ShardingStrategy::FULL_SHARD || strategy == ShardingStrategy::HYBRID_SHARD;
  const ReshardAfterForward after_forward = s.options.reshard_after_forward.value_or(ReshardAfterForward(zero3));
  s.reshard_after_forward = strategy != ShardingStrategy::NO_SHARD && after_forward.ranks != 1;
  std::shared_ptr<ProcessGroup> post_forward;  // hpZ: made before any wrapper's group use, in order on every rank
  if (s.reshard_after_forward) post_forward = post_forward_group(s.pg, after_forward.ranks);
  const std::string label = "FullyShardedDataParallel over " + module.name() + " (rank " +
                            std::to_string(s.world_pg->rank()) + ")";
  s.options.mixed_precision = resolve_mixed_precision(s.options, label);
  s.options.compute_dtype.reset();  // resolved into mixed_precision, which the children's options copy
  s.options.buffer_dtype.reset();
  s.options.fp32_reduce_scatter = false;
  auto_wrap_children(module, s.options, label);
  Collected found;
  collect(module, "", false, found);
  const std::vector<std::string>& names = found.names;
  const std::vector<at::Tensor>& params = found.params;
  const std::vector<at::Tensor>& buffers = found.buffers;
  claim(label, names, params);
  try {
    check_same_model(*s.world_pg, names, params, "FullyShardedDataParallel over " + module.name());
    // This unit's tensors only, on its device: a deferred model is made one
    // unit at a time, and device_id never moves the whole model.
    const MaterializedUnit made =
        materialize_unit({names, params, found.buffer_names, buffers, found.owners}, s.options, label);
    // skip_init with sync_module_states: rank 0's values are the load when
    // rank 0 has them (FSDP1's rank-0-only materialization); when rank 0
    // awaits a loader too, only the buffers are broadcast and every rank
    // awaits one. Rank 0 decides, so every rank does alike.
    bool rank0_loaded = false;
    if (s.options.sync_module_states) {
      rank0_loaded = !s.options.skip_init || rank0_holds_values(*s.world_pg, made.unset_params.empty());
      if (rank0_loaded) broadcast_from_rank0(*s.world_pg, params);
      broadcast_from_rank0(*s.world_pg, buffers);
    }
    if (const auto bt = s.options.mixed_precision.buffer_dtype) {
      at::NoGradGuard no_grad;
      for (auto b : buffers) {
        if (b.is_floating_point() && b.scalar_type() != *bt) {
          s.converted_buffers.emplace_back(b.unsafeGetTensorImpl(), b.scalar_type());
          b.set_data(b.to(*bt));
        }
      }
    }
    // The accumulators are made while the parameters are whole: autograd
    // checks every gradient against the shape it recorded then.
    for (size_t k = 0; k < params.size(); ++k) {
      if (params[k].requires_grad()) s.tracked.push_back(k);
    }
    const std::vector<char> keep_dtype = keep_norm_dtype(s.options, found.norm);
    if (!s.tracked.empty()) make_tracker(s, params, keep_dtype, s.tracked);
    std::vector<FsdpParamSpec> specs;
    for (size_t k = 0; k < params.size(); ++k) {
      FsdpParamSpec spec;
      spec.name = names[k];
      spec.param = params[k];
      spec.keep_dtype = k < keep_dtype.size() && keep_dtype[k] != 0;
      specs.push_back(std::move(spec));
    }
    name_params(module, specs);
    UnitOptions unit_options;
    unit_options.shard = s.options.sharding_strategy != ShardingStrategy::NO_SHARD;
    unit_options.keep_full =
        strategy == ShardingStrategy::SHARD_GRAD_OP || strategy == ShardingStrategy::HYBRID_SHARD_ZERO2;
    unit_options.replicate_group = s.replicate_pg;
    unit_options.post_forward_group = post_forward;
    unit_options.compute_dtype = s.options.mixed_precision.param_dtype;
    unit_options.reduce_dtype = s.options.mixed_precision.reduce_dtype;
    s.unit = std::make_unique<ShardedUnit>(pg, label, std::move(specs), unit_options);
    if (!rank0_loaded) s.unit->await_load(made.unset_params);
    // The unit's full copy is free now: give its memory back before the next
    // unit is made (glibc keeps freed blocks of this size in the heap, and
    // the shards allocated meanwhile keep it from reusing them), so that a
    // deferred model's start-up peak is its shards and one unit.
    if (made.deferred) ::malloc_trim(0);
    static std::atomic<int> units_made{0};
    s.unit->set_trace_name(module.name() + " #" + std::to_string(units_made++));
  } catch (...) {
    unclaim(params);
    throw;
  }
  s.own = std::make_shared<Coordinator>();
  if (s.options.skip_init) name_params_in_model(s, module);
}

FullyShardedCore::~FullyShardedCore() {
  if (!state_) return;
  if (state_->unit) {
    std::vector<at::Tensor> params;
    for (const FsdpParam& p : state_->unit->params()) params.push_back(p.param);
    unclaim(params);
  }
  if (state_->own) state_->own->forget_units();  // it refers back to state_
}

const std::shared_ptr<ProcessGroup>& FullyShardedCore::process_group() const { return state_->pg; }
const std::shared_ptr<ProcessGroup>& FullyShardedCore::world_process_group() const { return state_->world_pg; }
const FullyShardedDataParallelOptions& FullyShardedCore::options() const { return state_->options; }

at::Tensor FullyShardedCore::cast_input(const at::Tensor& t) const {
  const MixedPrecision& mp = state_->options.mixed_precision;
  if (!mp.param_dtype || !mp.cast_forward_inputs || !t.defined() || !t.is_floating_point() ||
      t.scalar_type() == *mp.param_dtype) {
    return t;
  }
  return t.to(*mp.param_dtype);
}

void FullyShardedCore::pretty_print(std::ostream& stream) const {
  const ShardedUnit& u = *state_->unit;
  static const char* const kNames[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                       "HYBRID_SHARD_ZERO2"};
  int64_t total = 0;
  int64_t here = 0;
  for (const auto& pl : u.layout().params()) {
    total += pl.numel();
    here += pl.rows_on(u.shard_rank()) * pl.row_numel;
  }
  stream << "tdist::FullyShardedDataParallel(" << kNames[static_cast<int>(state_->options.sharding_strategy)] << ", "
         << u.params().size() << " tensors, " << total << " parameters, " << here << " on this rank)";
}

void FullyShardedCore::begin_forward() {
  FsdpState& s = *state_;
  if (s.summoned) throw UsageError(s.unit->label() + ": forward inside summon_full_params");
  s.unit->check_params_in_place();
  const RecomputePhase phase = recompute_phase();
  if (phase == RecomputePhase::kRecompute) {
    // A checkpointed module around this unit runs its forward again in
    // backward: the unit gathers as for its backward (its gradients come
    // when the checkpoint's backward returns them).
    auto c = s.current.lock();
    if (!c || !s.recorded() || !c->in_backward()) {
      throw UsageError(s.unit->label() +
                       ": checkpoint_module around an outermost FSDP wrapper (its forward ran again in "
                       "backward, outside the iteration): put the checkpoint inside the wrapper, "
                       "FSDP(checkpoint_module(m))");
    }
    c->pre_backward(s);
    s.recomputing = true;
    return;
  }
  s.forward_began_ns = Timeline::active() ? fr_now_ns() : 0;  // 0: no span (off, or paused at its start)
  Coordinator* active = active_coordinator();
  s.is_root = active == nullptr;
  if (s.is_root) {
    active = s.own.get();
    active->begin_iteration();
    if (at::GradMode::is_enabled()) detail::FlightRecorder::get().note_step();  // tdist-run's steps/s
    set_active_coordinator(active);
  }
  try {
    s.current = active->weak_from_this();
    // In a checkpointed forward gradients are off, but they will come.
    if (at::GradMode::is_enabled() || phase == RecomputePhase::kForward) active->record_forward(s);
    active->gather_for_forward(s);
  } catch (...) {
    abort_forward();
    throw;
  }
}

void FullyShardedCore::end_forward(const std::vector<at::Tensor>& outputs, bool training) {
  FsdpState& s = *state_;
  if (s.recomputing) {
    s.recomputing = false;  // stays gathered until its gradients are reduced
    return;
  }
  const bool grad = at::GradMode::is_enabled();
  if (grad) {
    std::weak_ptr<FsdpState> ws = state_;
    std::weak_ptr<Coordinator> wc = s.current;
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      t.register_hook([ws, wc](const at::Tensor&) {
        auto st = ws.lock();
        auto c = wc.lock();
        if (st && c) c->pre_backward(*st);
      });
    }
  }
  // Eval forwards free everything too: a backward after one (rare) gathers
  // again through the hooks above.
  if (!grad || !training) {
    s.unit->reshard();
  } else if (s.reshard_after_forward && !s.is_root) {
    s.unit->reshard_after_forward();  // everything, or all but a post-forward share (hpZ)
  }
  if (s.is_root) set_active_coordinator(nullptr);
  if (Timeline* tl = Timeline::active(); tl && s.forward_began_ns > 0) {
    tl->complete("compute", "forward " + s.unit->trace_name(), s.forward_began_ns, fr_now_ns());
    s.forward_began_ns = 0;
  }
}

void FullyShardedCore::abort_forward() noexcept {
  FsdpState& s = *state_;
  if (s.recomputing) {
    s.recomputing = false;
    return;  // the backward fails; the next forward settles the unit
  }
  if (s.is_root) set_active_coordinator(nullptr);
  try {
    s.unit->reshard();
  } catch (...) {
  }
}

}  // namespace tdist::detail
