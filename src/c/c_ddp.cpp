// The C ABI's module calls, DDP and Join (include/tdist/c/tdist.h).
#include <torch/nn/module.h>

#include <cstdio>

#include "c/c_model.h"
#include "tdist/comm_hooks.h"
#include "tdist/powersgd.h"

using namespace tdist;
using namespace tdist::c;

namespace {

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
