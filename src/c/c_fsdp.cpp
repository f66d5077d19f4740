// The C ABI's FSDP: fully_shard per unit and the unit's calls
// (include/tdist/c/tdist.h).
#include <torch/nn/module.h>

#include <functional>
#include <optional>
#include <set>
#include <sstream>

#include "c/c_model.h"
#include "process_group/agree.h"

using namespace tdist;
using namespace tdist::c;

namespace {

std::optional<at::ScalarType> dtype_or_unset(int d) {
  if (d == -1) return std::nullopt;
  return dtype_of(d);
}

ShardingStrategy strategy_of(int s) {
  switch (s) {
    case TDIST_FULL_SHARD: return ShardingStrategy::FULL_SHARD;
    case TDIST_SHARD_GRAD_OP: return ShardingStrategy::SHARD_GRAD_OP;
    case TDIST_NO_SHARD: return ShardingStrategy::NO_SHARD;
    case TDIST_HYBRID_SHARD: return ShardingStrategy::HYBRID_SHARD;
    case TDIST_HYBRID_SHARD_ZERO2: return ShardingStrategy::HYBRID_SHARD_ZERO2;
  }
  usage("unknown sharding strategy " + std::to_string(s));
}

FullyShardedDataParallelOptions fsdp_options(const tdist_fsdp_options* given, tdist_pg* pg) {
  const tdist_fsdp_options options = given_or_default(given, tdist_fsdp_options_init, "tdist_fsdp_options");
  const tdist_fsdp_options* c = &options;
  FullyShardedDataParallelOptions o;
  if (pg) o.process_group = live(pg, "process group")->pg;
  o.sharding_strategy = strategy_of(c->sharding_strategy);
  if (c->reshard_after_forward < -1) usage("reshard_after_forward is " + std::to_string(c->reshard_after_forward));
  if (c->reshard_after_forward == 0) o.reshard_after_forward = ReshardAfterForward(false);
  if (c->reshard_after_forward == 1) o.reshard_after_forward = ReshardAfterForward(true);
  if (c->reshard_after_forward > 1) o.reshard_after_forward = ReshardAfterForward(c->reshard_after_forward);
  o.mixed_precision.param_dtype = dtype_or_unset(c->param_dtype);
  o.mixed_precision.reduce_dtype = dtype_or_unset(c->reduce_dtype);
  o.mixed_precision.buffer_dtype = dtype_or_unset(c->buffer_dtype);
  o.mixed_precision.cast_forward_inputs = c->cast_forward_inputs != 0;
  o.backward_prefetch = c->backward_prefetch ? BackwardPrefetch::BACKWARD_PRE : BackwardPrefetch::NONE;
  o.forward_prefetch = c->forward_prefetch != 0;
  o.sync_module_states = c->sync_module_states != 0;
  if (c->hybrid_shard_size < 0) usage("hybrid_shard_size is negative");
  if (c->hybrid_shard_size > 0) {
    if (o.sharding_strategy != ShardingStrategy::HYBRID_SHARD &&
        o.sharding_strategy != ShardingStrategy::HYBRID_SHARD_ZERO2) {
      usage("hybrid_shard_size is for the hybrid strategies");
    }
    const auto base = o.process_group ? o.process_group : default_group();
    if (!base) usage("no process group: call tdist_init_process_group first");
    const int k = c->hybrid_shard_size;
    if (base->size() % k != 0) {
      usage("hybrid_shard_size " + std::to_string(k) + " does not divide the group's " +
            std::to_string(base->size()) + " ranks");
    }
    o.sharding_groups.assign(static_cast<size_t>(base->size() / k), {});
    for (int r = 0; r < base->size(); ++r) o.sharding_groups[static_cast<size_t>(r / k)].push_back(r);
  }
  return o;
}

FsdpUnit& unit_of(tdist_fsdp* u) { return *live(u, "FSDP unit")->unit; }

// Every rank's tdist_fully_shard must be the same call (path, options,
// the unit's tensors): a mismatch found later by a collective would end
// the group. One small all_gather over the unit's group.
void agree_on_unit(const std::string& path, const tdist_fsdp_options* given, tdist_pg* pg,
                   torch::nn::Module& target) {
  const tdist_fsdp_options o = given_or_default(given, tdist_fsdp_options_init, "tdist_fsdp_options");
  std::ostringstream d;
  d << "path '" << path << "', strategy " << o.sharding_strategy << ", reshard_after_forward "
    << o.reshard_after_forward << ", dtypes " << o.param_dtype << "/" << o.reduce_dtype << "/" << o.buffer_dtype
    << ", cast " << o.cast_forward_inputs << ", prefetch " << o.backward_prefetch << "/" << o.forward_prefetch
    << ", sync " << o.sync_module_states << ", hybrid " << o.hybrid_shard_size << ", tensors";
  // The unit's own tensors: not those of inner units (already shards, of
  // different sizes on different ranks).
  std::function<void(torch::nn::Module&, const std::string&)> own = [&](torch::nn::Module& m, const std::string& at) {
    for (const auto& t : m.named_parameters(false)) d << " " << at << t.key() << t.value().sizes() << t.value().scalar_type();
    for (const auto& c : m.named_children()) {
      if (!dynamic_cast<FsdpUnit*>(c.value().get())) own(*c.value(), at + c.key() + ".");
    }
  };
  own(target, "");
  const auto base = pg ? live(pg, "process group")->pg : default_group();
  if (!base) usage("no process group: call tdist_init_process_group first");
  const auto all = tdist::detail::all_gather_bytes(*base, d.str(), std::nullopt);
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] != all[0]) {
      usage("rank " + std::to_string(r) + "'s call differs from rank 0's: " + all[r].substr(0, 400) + " against " +
            all[0].substr(0, 400));
    }
  }
}

// The unit over the submodule at `path` ("": the root), made and put in
// its place in the tree.
tdist_fsdp* shard_at(const std::shared_ptr<Model>& model, const std::string& p, tdist_pg* pg,
                     const tdist_fsdp_options* o) {
  if (model->top != model->root) usage("the root is wrapped already: shard the inner units first, the root last");
  const auto steps = split_path(p);
  std::shared_ptr<FsdpUnit> unit;
  if (steps.empty()) {
    agree_on_unit(p, o, pg, *model->root);
    unit = std::make_shared<FsdpUnit>(model->root, fsdp_options(o, pg));
    model->top = unit;
  } else {
    ModulePtr parent = model->root;
    for (size_t i = 0; i + 1 < steps.size(); ++i) {
      parent = child_of(parent, steps[i]);
      if (!parent) usage("the module has no submodule '" + p + "'");
      if (dynamic_cast<FsdpUnit*>(parent.get())) {
        usage("'" + p + "' is inside a sharded unit: shard the inner units first, then the outer ones");
      }
    }
    ModulePtr target = child_of(parent, steps.back());
    if (!target) usage("the module has no submodule '" + p + "'");
    if (dynamic_cast<FsdpUnit*>(target.get())) usage("'" + p + "' is sharded already");
    agree_on_unit(p, o, pg, *target);
    unit = std::make_shared<FsdpUnit>(target, fsdp_options(o, pg));
    unwrap(parent)->replace_module(steps.back(), unit);
  }
  unit->train(model->root->is_training());
  return handle(new tdist_fsdp{model, std::move(unit)});
}

// The tensors a module holds, its inner units' aside.
void own_tensors(torch::nn::Module& m, std::set<const c10::TensorImpl*>& out) {
  for (const auto& t : m.named_parameters(false)) out.insert(t.value().unsafeGetTensorImpl());
  for (const auto& c : m.named_children()) {
    if (!dynamic_cast<FsdpUnit*>(c.value().get())) own_tensors(*unwrap(c.value()), out);
  }
}

// The path of the deepest submodule (not yet a unit) whose parameters,
// its inner units' aside, are exactly `want`.
std::string path_of_tensors(const Model& model, const std::set<const c10::TensorImpl*>& want) {
  std::optional<std::string> found;
  std::function<void(const ModulePtr&, const std::string&)> visit = [&](const ModulePtr& node, const std::string& at) {
    std::set<const c10::TensorImpl*> have;
    own_tensors(*unwrap(node), have);
    if (have == want) found = at;
    for (const auto& c : unwrap(node)->named_children()) {
      if (!dynamic_cast<FsdpUnit*>(c.value().get())) visit(c.value(), at.empty() ? c.key() : at + "." + c.key());
    }
  };
  visit(model.root, "");
  if (!found) {
    usage("no submodule holds exactly these " + std::to_string(want.size()) +
          " tensors (its inner units' aside): a unit is a submodule, as the names given to tdist_module_new "
          "make them (\"layers.0.weight\" is in \"layers.0\")");
  }
  return *found;
}

}  // namespace

extern "C" {

void tdist_fsdp_options_init(tdist_fsdp_options* o) {
  if (!o) return;
  *o = tdist_fsdp_options{sizeof(tdist_fsdp_options), TDIST_FULL_SHARD, -1, -1, -1, -1, 1, 1, 0, 1, 0};
}

tdist_status tdist_fully_shard(tdist_module* m, const char* path, tdist_pg* pg, const tdist_fsdp_options* o,
                               tdist_fsdp** out) {
  return guarded("tdist_fully_shard", [&] {
    out_check(out);
    const auto& model = live(m, "module")->model;
    if (!path) usage("the path is NULL (\"\" is the root)");
    *out = shard_at(model, path, pg, o);
  });
}

tdist_status tdist_fully_shard_tensors(tdist_module* m, const tdist_tensor* params, size_t n, tdist_pg* pg,
                                       const tdist_fsdp_options* o, tdist_fsdp** out) {
  return guarded("tdist_fully_shard_tensors", [&] {
    out_check(out);
    const auto& model = live(m, "module")->model;
    std::set<const c10::TensorImpl*> want;
    for (const at::Tensor& t : tensors(params, n, "parameter")) want.insert(t.unsafeGetTensorImpl());
    if (want.size() != n) usage("a tensor is given twice");
    *out = shard_at(model, want.empty() ? std::string() : path_of_tensors(*model, want), pg, o);
  });
}

tdist_status tdist_fsdp_pre_forward(tdist_fsdp* u) {
  return guarded("tdist_fsdp_pre_forward", [&] { unit_of(u).pre_forward(); });
}

tdist_status tdist_fsdp_post_forward(tdist_fsdp* u, const tdist_tensor* outputs, size_t n) {
  return guarded("tdist_fsdp_post_forward", [&] { unit_of(u).post_forward(tensors(outputs, n, "output")); });
}

tdist_status tdist_fsdp_abort_forward(tdist_fsdp* u) {
  return guarded("tdist_fsdp_abort_forward", [&] { unit_of(u).abort_forward(); });
}

tdist_status tdist_fsdp_cast_input(tdist_fsdp* u, tdist_tensor input, tdist_tensor* out) {
  return guarded("tdist_fsdp_cast_input", [&] {
    out_check(out);
    *out = new_tensor(unit_of(u).fsdp_core().cast_input(tensor(input, "input")));
  });
}

tdist_status tdist_fsdp_clip_grad_norm(tdist_fsdp* u, double max_norm, double norm_type, double* total_norm) {
  return guarded("tdist_fsdp_clip_grad_norm", [&] {
    if (!total_norm) usage("the output pointer is NULL");
    *total_norm = tdist::detail::clip_grad_norm(unit_of(u), max_norm, norm_type);
  });
}

tdist_status tdist_fsdp_set_requires_gradient_sync(tdist_fsdp* u, int on, int recurse) {
  return guarded("tdist_fsdp_set_requires_gradient_sync",
                 [&] { tdist::detail::set_requires_gradient_sync(unit_of(u), on != 0, recurse != 0); });
}

tdist_status tdist_fsdp_set_reshard_after_backward(tdist_fsdp* u, int on, int recurse) {
  return guarded("tdist_fsdp_set_reshard_after_backward",
                 [&] { tdist::detail::set_reshard_after_backward(unit_of(u), on != 0, recurse != 0); });
}

tdist_status tdist_fsdp_reshard(tdist_fsdp* u) {
  return guarded("tdist_fsdp_reshard", [&] { tdist::detail::reshard_units(unit_of(u)); });
}

tdist_status tdist_fsdp_set_join_step(tdist_fsdp* u, int (*step)(void* user), void* user) {
  return guarded("tdist_fsdp_set_join_step", [&] {
    if (!step) usage("the step is NULL");
    unit_of(u).set_join_step([step, user] {
      if (step(user) != 0) throw Error("the join step (tdist_fsdp_set_join_step) returned nonzero");
    });
  });
}

tdist_status tdist_fsdp_free(tdist_fsdp* u) {
  return guarded("tdist_fsdp_free", [&] { release(u, "FSDP unit"); });
}

}  // extern "C"
