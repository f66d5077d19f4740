// The C ABI's model, DDP, FSDP and Join (include/tdist/c/tdist.h).
#include <torch/nn/module.h>

#include <cstdio>
#include <functional>
#include <sstream>

#include "c/c_model.h"
#include "process_group/agree.h"
#include "tdist/comm_hooks.h"
#include "tdist/powersgd.h"

using namespace tdist;
using namespace tdist::c;

namespace tdist::c {

DdpWrapper::DdpWrapper(std::shared_ptr<torch::nn::Module> module, DistributedDataParallelOptions options)
    : module_(register_module("module", std::move(module))), core_(*module_, std::move(options)) {}

void DdpWrapper::pre_forward() {
  Join::notify_join_context(*this);
  core_.before_forward(active_join());
}

void DdpWrapper::post_forward(const std::vector<at::Tensor>& outputs) {
  if (core_.wants_outputs()) core_.after_forward(outputs);
}

FsdpUnit::FsdpUnit(std::shared_ptr<torch::nn::Module> module, FullyShardedDataParallelOptions options)
    : module_(register_module("module", std::move(module))), core_(*module_, std::move(options)) {}

void FsdpUnit::pre_forward() {
  if (in_forward_) usage("tdist_fsdp_pre_forward twice without tdist_fsdp_post_forward");
  Join::notify_join_context(*this);
  core_.begin_forward();
  in_forward_ = true;
}

void FsdpUnit::post_forward(const std::vector<at::Tensor>& outputs) {
  if (!in_forward_) usage("tdist_fsdp_post_forward without tdist_fsdp_pre_forward");
  in_forward_ = false;
  try {
    core_.end_forward(outputs, is_training());
  } catch (...) {
    core_.abort_forward();
    throw;
  }
}

std::unique_ptr<JoinHook> FsdpUnit::join_hook(const JoinOptions& options) {
  return tdist::detail::fsdp_join_hook(*this, join_step_, options);
}

}  // namespace tdist::c

namespace {

using ModulePtr = std::shared_ptr<torch::nn::Module>;

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(path);
  while (std::getline(in, part, '.')) {
    if (part.empty()) usage("'" + path + "' has an empty step");
    parts.push_back(part);
  }
  if (!path.empty() && path.back() == '.') usage("'" + path + "' has an empty step");
  return parts;
}

// The module a wrapper (DDP, an FSDP unit) stands for.
ModulePtr unwrap(ModulePtr m) {
  while (dynamic_cast<tdist::detail::WrapperModule*>(m.get())) {
    const auto kids = m->named_children();
    const ModulePtr* inner = kids.find("module");
    if (!inner) break;
    m = *inner;
  }
  return m;
}

ModulePtr child_of(const ModulePtr& node, const std::string& name) {
  const auto kids = unwrap(node)->named_children();
  const ModulePtr* c = kids.find(name);
  return c ? *c : nullptr;
}

// The submodule for the steps of a name (made when missing with make).
ModulePtr walk(ModulePtr node, const std::vector<std::string>& steps, size_t n, bool make, const std::string& path) {
  for (size_t i = 0; i < n; ++i) {
    ModulePtr next = child_of(node, steps[i]);
    if (!next) {
      if (!make) usage("the module has no submodule '" + path + "'");
      if (unwrap(node)->named_parameters(false).find(steps[i]) || unwrap(node)->named_buffers(false).find(steps[i])) {
        usage("'" + steps[i] + "' in '" + path + "' is a tensor and a module");
      }
      next = unwrap(node)->register_module(steps[i], std::make_shared<torch::nn::Module>("tdist::c::Module"));
    }
    node = std::move(next);
  }
  return node;
}

void add_tensors(Model& model, const char* const* ns, const tdist_tensor* ts, size_t n, bool buffers) {
  const auto keys = names(ns, n, "names");
  const auto values = tensors(ts, n, buffers ? "buffer" : "parameter");
  for (size_t i = 0; i < n; ++i) {
    const auto steps = split_path(keys[i]);
    if (steps.empty()) usage("names[" + std::to_string(i) + "] is empty");
    ModulePtr owner = walk(model.root, steps, steps.size() - 1, true, keys[i]);
    const std::string& leaf = steps.back();
    if (child_of(owner, leaf)) usage("'" + keys[i] + "' is a module and a tensor");
    if (owner->named_parameters(false).find(leaf) || owner->named_buffers(false).find(leaf)) {
      usage("'" + keys[i] + "' is given twice (names[" + std::to_string(i) + "])");
    }
    if (!buffers && !values[i].is_leaf()) {
      usage("parameter '" + keys[i] + "' is not a leaf tensor (the result of an op): give the tensor the optimizer "
            "steps (made with requires_grad, or detached)");
    }
    if (buffers) {
      owner->register_buffer(steps.back(), values[i]);
    } else {
      owner->register_parameter(steps.back(), values[i], values[i].requires_grad());
    }
  }
}

Model& model_of(tdist_module* m) { return *live(m, "module")->model; }

void require_unwrapped(const Model& model, const char* what) {
  if (model.top != model.root) usage(std::string("the module is wrapped already (") + what + " takes a plain one)");
}

// The caller's options struct (checked to be this header's), or the
// defaults its init function sets.
template <typename O>
O given_or_default(const O* o, void (*init)(O*), const char* what) {
  if (!o) {
    O d;
    init(&d);
    return d;
  }
  if (o->struct_size != sizeof(O)) {
    usage(std::string(what) + ".struct_size is " + std::to_string(o->struct_size) + ", this tdist's is " +
          std::to_string(sizeof(O)) + " (call " + what + "_init; rebuild the binding against this header)");
  }
  return *o;
}

DistributedDataParallelOptions ddp_options(const tdist_ddp_options* given, tdist_pg* pg) {
  const tdist_ddp_options options = given_or_default(given, tdist_ddp_options_init, "tdist_ddp_options");
  const tdist_ddp_options* c = &options;
  DistributedDataParallelOptions o;
  if (pg) o.process_group = live(pg, "process group")->pg;
  if (!(c->bucket_cap_mb > 0) || !(c->first_bucket_cap_mb > 0)) usage("the bucket caps must be positive numbers");
  o.bucket_cap_mb = c->bucket_cap_mb;
  o.first_bucket_cap_mb = c->first_bucket_cap_mb;
  o.broadcast_buffers = c->broadcast_buffers != 0;
  o.find_unused_parameters = c->find_unused_parameters != 0;
  o.gradient_as_bucket_view = c->gradient_as_bucket_view != 0;
  o.static_graph = c->static_graph != 0;
  return o;
}

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

}  // namespace

extern "C" {

tdist_status tdist_module_new(const char* const* names, const tdist_tensor* params, size_t n, tdist_module** out) {
  return guarded("tdist_module_new", [&] {
    out_check(out);
    auto model = std::make_shared<Model>();
    model->root = std::make_shared<torch::nn::Module>("tdist::c::Module");
    model->top = model->root;
    add_tensors(*model, names, params, n, /*buffers=*/false);
    *out = handle(new tdist_module{std::move(model)});
  });
}

tdist_status tdist_module_add_buffers(tdist_module* m, const char* const* names, const tdist_tensor* buffers,
                                      size_t n) {
  return guarded("tdist_module_add_buffers", [&] {
    Model& model = model_of(m);
    require_unwrapped(model, "tdist_module_add_buffers");
    add_tensors(model, names, buffers, n, /*buffers=*/true);
  });
}

tdist_status tdist_module_set_training(tdist_module* m, int training) {
  return guarded("tdist_module_set_training", [&] { model_of(m).top->train(training != 0); });
}

tdist_status tdist_module_free(tdist_module* m) {
  return guarded("tdist_module_free", [&] { release(m, "module"); });
}

void tdist_ddp_options_init(tdist_ddp_options* o) {
  if (!o) return;
  const DistributedDataParallelOptions d;
  *o = tdist_ddp_options{sizeof(tdist_ddp_options), d.bucket_cap_mb, d.first_bucket_cap_mb, d.broadcast_buffers,
                         d.find_unused_parameters, d.gradient_as_bucket_view, d.static_graph};
}

tdist_status tdist_ddp_new(tdist_module* m, tdist_pg* pg, const tdist_ddp_options* o, tdist_ddp** out) {
  return guarded("tdist_ddp_new", [&] {
    out_check(out);
    const auto& model = live(m, "module")->model;
    require_unwrapped(*model, "tdist_ddp_new");
    for (const auto& sub : model->root->modules()) {
      if (dynamic_cast<FsdpUnit*>(sub.get())) usage("the module has FSDP units: DDP takes a module without");
    }
    auto ddp = std::make_shared<DdpWrapper>(model->root, ddp_options(o, pg));
    ddp->train(model->root->is_training());
    model->top = ddp;
    *out = handle(new tdist_ddp{model, std::move(ddp)});
  });
}

tdist_status tdist_ddp_pre_forward(tdist_ddp* d) {
  return guarded("tdist_ddp_pre_forward", [&] { live(d, "DDP")->ddp->pre_forward(); });
}

tdist_status tdist_ddp_post_forward(tdist_ddp* d, const tdist_tensor* outputs, size_t n) {
  return guarded("tdist_ddp_post_forward", [&] { live(d, "DDP")->ddp->post_forward(tensors(outputs, n, "output")); });
}

tdist_status tdist_ddp_set_require_sync(tdist_ddp* d, int require_sync) {
  return guarded("tdist_ddp_set_require_sync",
                 [&] { live(d, "DDP")->ddp->data_parallel().set_require_sync(require_sync != 0); });
}

tdist_status tdist_ddp_register_comm_hook(tdist_ddp* d, const char* hook, tdist_pg* group) {
  return guarded("tdist_ddp_register_comm_hook", [&] {
    auto& core = live(d, "DDP")->ddp->data_parallel();
    if (!hook) usage("the hook name is NULL");
    const auto g = group ? live(group, "process group")->pg : core.process_group();
    const std::string name(hook);
    if (name == "allreduce") return core.register_comm_hook(g, allreduce_hook);
    if (name == "fp16") return core.register_comm_hook(g, fp16_compress_hook);
    if (name == "bf16") return core.register_comm_hook(g, bf16_compress_hook);
    if (name == "noop") return core.register_comm_hook(g, noop_hook);
    if (name == "powersgd" || name.rfind("powersgd:", 0) == 0) {
      PowerSGDOptions po;
      if (name != "powersgd") {
        long long r = 0, start = 0;
        char tail = 0;
        if (std::sscanf(name.c_str(), "powersgd:%lld:%lld%c", &r, &start, &tail) != 2 || r < 1 || start < 2) {
          usage("'" + name + "' is not powersgd:RANK:START_ITER (RANK >= 1, START_ITER >= 2)");
        }
        po.matrix_approximation_rank = r;
        po.start_powerSGD_iter = start;
      }
      auto state = std::make_shared<PowerSGDState>(g, po);
      return core.register_comm_hook([state](GradBucket& b) { return powerSGD_hook(state, b); });
    }
    usage("unknown comm hook '" + name + "' (allreduce, fp16, bf16, noop, powersgd, powersgd:RANK:START_ITER)");
  });
}

tdist_status tdist_ddp_free(tdist_ddp* d) {
  return guarded("tdist_ddp_free", [&] { release(d, "DDP"); });
}

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
    if (model->top != model->root) usage("the root is wrapped already: shard the inner units first, the root last");
    const std::string p(path);
    const auto steps = split_path(p);
    std::shared_ptr<FsdpUnit> unit;
    if (steps.empty()) {
      agree_on_unit(p, o, pg, *model->root);
      unit = std::make_shared<FsdpUnit>(model->root, fsdp_options(o, pg));
      model->top = unit;
    } else {
      ModulePtr node = model->root;
      for (size_t i = 0; i + 1 < steps.size() && node; ++i) {
        node = child_of(node, steps[i]);
        if (dynamic_cast<FsdpUnit*>(node.get())) {
          usage("'" + p + "' is inside a sharded unit: shard the inner units first, then the outer ones");
        }
      }
      ModulePtr parent = walk(model->root, steps, steps.size() - 1, false, p);
      ModulePtr target = child_of(parent, steps.back());
      if (!target) usage("the module has no submodule '" + p + "'");
      if (dynamic_cast<FsdpUnit*>(target.get())) usage("'" + p + "' is sharded already");
      agree_on_unit(p, o, pg, *target);
      unit = std::make_shared<FsdpUnit>(target, fsdp_options(o, pg));
      unwrap(parent)->replace_module(steps.back(), unit);
    }
    unit->train(model->root->is_training());
    *out = handle(new tdist_fsdp{model, std::move(unit)});
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

struct tdist_join {
  std::vector<std::shared_ptr<torch::nn::Module>> joinables;  // outlive the Join
  std::unique_ptr<Join> join;
};

extern "C" {

tdist_status tdist_join_new(tdist_ddp* const* ddps, size_t n_ddp, tdist_fsdp* const* fsdps, size_t n_fsdp,
                            int divide_by_initial_world_size, tdist_join** out) {
  return guarded("tdist_join_new", [&] {
    out_check(out);
    if ((!ddps && n_ddp > 0) || (!fsdps && n_fsdp > 0)) usage("a joinable array is NULL");
    if (n_ddp + n_fsdp == 0) usage("no joinables");
    auto j = std::make_unique<tdist_join>();
    std::vector<Joinable*> joinables;
    for (size_t i = 0; i < n_ddp; ++i) {
      auto& ddp = live(ddps[i], "DDP")->ddp;
      j->joinables.push_back(ddp);
      joinables.push_back(ddp.get());
    }
    for (size_t i = 0; i < n_fsdp; ++i) {
      auto& unit = live(fsdps[i], "FSDP unit")->unit;
      j->joinables.push_back(unit);
      joinables.push_back(unit.get());
    }
    JoinOptions o;
    o.divide_by_initial_world_size = divide_by_initial_world_size != 0;
    j->join = std::make_unique<Join>(std::move(joinables), o);
    *out = handle(j.release());
  });
}

tdist_status tdist_join_join(tdist_join* j) {
  return guarded("tdist_join_join", [&] { live(j, "join")->join->join(); });
}

// Ends the Join: join() first when it has not run (collective).
tdist_status tdist_join_free(tdist_join* j) {
  return guarded("tdist_join_free", [&] {
    Join* join = live(j, "join")->join.release();
    release(j, "join");
    delete join;  // ~Join runs join() when it has not run, and may throw: guarded reports it
  });
}

}  // extern "C"
