// The operations over every wrapper of a model: clip_grad_norm_, no_sync,
// get_shard_metadata, summon_full_params. Declared in include/tdist/fsdp.h.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <functional>
#include <limits>

#include "fsdp/coordinator.h"
#include "fsdp/fsdp_state.h"
#include "fsdp/wrapper_tree.h"
#include "tdist/errors.h"
#include "tdist/fsdp.h"

namespace tdist::detail {

std::string join_name(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

void walk_wrappers(torch::nn::Module& m, const std::string& path, const std::string& original,
                   std::vector<WrapperVisit>& out) {
  auto* w = dynamic_cast<FullyShardedModule*>(&m);
  if (w) out.push_back({*w->fsdp_core().state(), path, original});
  const bool wrapper = dynamic_cast<WrapperModule*>(&m) != nullptr;  // FSDP, CheckpointModule
  for (const auto& c : m.named_children()) {
    const bool wrapped = wrapper && c.key() == "module";
    walk_wrappers(*c.value(), join_name(path, c.key()), wrapped ? original : join_name(original, c.key()), out);
  }
}

namespace {

std::vector<WrapperVisit> wrappers(torch::nn::Module& root) {
  std::vector<WrapperVisit> out;
  walk_wrappers(root, "", "", out);
  if (out.empty()) throw UsageError("FullyShardedDataParallel: the module holds no FSDP wrapper");
  return out;
}

}  // namespace

std::vector<WrapperVisit> settled_wrappers(torch::nn::Module& root, const char* what) {
  if (active_coordinator()) throw UsageError(std::string(what) + " inside a forward");
  const auto all = wrappers(root);
  Coordinator& c = *all[0].state.own;
  if (c.in_backward()) throw UsageError(std::string(what) + " during a backward");
  for (const auto& v : all) {
    if (v.state.summoned) throw UsageError(std::string(what) + ": inside summon_full_params");
  }
  c.settle();
  for (const auto& v : all) v.state.unit->reshard();  // units kept or prefetched outside the last forward
  return all;
}

double clip_grad_norm(torch::nn::Module& root, double max_norm, double norm_type) {
  if (!(max_norm >= 0)) throw UsageError("clip_grad_norm_: max_norm must be >= 0");
  const bool inf = std::isinf(norm_type);
  if (!inf && !(norm_type > 0)) throw UsageError("clip_grad_norm_: norm_type must be positive or infinity");
  const auto all = wrappers(root);
  auto pg = all[0].state.pg;
  // Sharded units: every rank adds its shards. Units every rank holds whole
  // (NO_SHARD, or a world of one): rank 0 adds them, once.
  double local = 0;
  std::vector<at::Tensor> grads;
  for (const auto& v : all) {
    if (v.state.pg.get() != pg.get()) {
      throw UsageError("clip_grad_norm_: the wrappers of one model must share one process group");
    }
    const ShardedUnit& u = *v.state.unit;
    const bool counts = u.sharded() || pg->rank() == 0;
    for (const FsdpParam& p : u.params()) {
      const at::Tensor& g = p.param.grad();
      if (!p.trainable || !g.defined()) continue;
      grads.push_back(g);
      if (!counts || g.numel() == 0) continue;
      const at::Tensor gd = g.to(at::kDouble);
      if (inf) {
        local = std::max(local, gd.abs().max().item<double>());
      } else {
        local += gd.abs().pow(norm_type).sum().item<double>();
      }
    }
  }
  at::Tensor total = at::tensor({local}, at::kDouble);
  pg->all_reduce(total, {inf ? ReduceOp::MAX : ReduceOp::SUM})->wait();
  const double norm = inf ? total.item<double>() : std::pow(total.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    at::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coef);
  }
  return norm;
}

namespace {

// The states a control applies to: root's own wrapper, or with recurse
// every wrapper in its tree.
std::vector<FsdpState*> targets(torch::nn::Module& root, bool recurse) {
  std::vector<FsdpState*> out;
  for (const auto& v : wrappers(root)) {
    out.push_back(&v.state);
    if (!recurse) break;  // the first is root's own
  }
  return out;
}

std::vector<std::weak_ptr<FsdpState>> states_of(const std::vector<std::shared_ptr<FullyShardedModule>>& modules,
                                                const char* what) {
  std::vector<std::weak_ptr<FsdpState>> out;
  for (const auto& m : modules) {
    if (!m) throw UsageError(std::string(what) + ": a null module in the list");
    out.push_back(m->fsdp_core().state());
  }
  return out;
}

}  // namespace

void set_requires_gradient_sync(torch::nn::Module& root, bool on, bool recurse) {
  for (FsdpState* s : targets(root, recurse)) s->requires_gradient_sync = on;
}

void set_reshard_after_backward(torch::nn::Module& root, bool on, bool recurse) {
  for (FsdpState* s : targets(root, recurse)) s->reshard_after_backward = on;
}

void set_modules_to_prefetch(torch::nn::Module& root, const std::vector<std::shared_ptr<FullyShardedModule>>& modules,
                             bool forward) {
  FsdpState& s = *targets(root, false)[0];
  auto states = states_of(modules, forward ? "set_modules_to_forward_prefetch" : "set_modules_to_backward_prefetch");
  (forward ? s.forward_prefetch_units : s.backward_prefetch_units) = std::move(states);
}

void reshard_units(torch::nn::Module& root) { settled_wrappers(root, "reshard"); }

namespace {

// Runs the user's step with every unit of the tree reducing zeros.
class FsdpJoinHook : public JoinHook {
 public:
  FsdpJoinHook(torch::nn::Module& root, std::function<void()> step) : root_(root), step_(std::move(step)) {}
  void main_hook() override {
    // Every unit reduces zeros for the step's length, however it ends.
    struct ZerosWhileAlive {
      std::vector<WrapperVisit> all;
      explicit ZerosWhileAlive(torch::nn::Module& root) : all(wrappers(root)) { set(true); }
      ~ZerosWhileAlive() { set(false); }
      void set(bool on) {
        for (const auto& v : all) v.state.unit->set_reduce_zeros(on);
      }
    } zeros(root_);
    step_();
  }

 private:
  torch::nn::Module& root_;
  std::function<void()> step_;
};

}  // namespace

std::unique_ptr<JoinHook> fsdp_join_hook(torch::nn::Module& root, std::function<void()> step,
                                         const JoinOptions& options) {
  if (!step && !options.throw_on_early_termination) {  // throwing, the hooks never run
    throw UsageError(
        "Join: FullyShardedDataParallel needs set_join_step(step) first: every rank owns a shard of the "
        "parameters, so a rank that has joined must go on stepping its shard with the others");
  }
  if (!options.divide_by_initial_world_size) {
    throw UsageError("Join: FullyShardedDataParallel averages over the initial world size only "
                     "(divide_by_initial_world_size = false is for DistributedDataParallel)");
  }
  return std::make_unique<FsdpJoinHook>(root, std::move(step));
}

void set_require_sync(torch::nn::Module& root, bool on) { wrappers(root)[0].state.own->require_sync = on; }
bool require_sync(torch::nn::Module& root) { return wrappers(root)[0].state.own->require_sync; }

void name_params_in_model(FsdpState& state, torch::nn::Module& module) {
  std::vector<WrapperVisit> all{{state, "", ""}};
  walk_wrappers(module, "", "", all);  // the inner wrappers
  for (const auto& v : all) {
    ShardedUnit& u = *v.state.unit;
    for (size_t k = 0; k < u.params().size(); ++k) {
      u.set_model_name(k, join_name(v.original_path, u.params()[k].original_name));
    }
  }
}

ShardMetadata shard_metadata(torch::nn::Module& root) {
  const auto all = wrappers(root);
  ShardMetadata md;
  md.world_size = all[0].state.pg->size();
  md.rank = all[0].state.pg->rank();
  for (const auto& v : all) {
    const ShardedUnit& u = *v.state.unit;
    ShardedUnitInfo info;
    info.prefix = v.path;
    info.sharded = u.sharded();
    const int world = u.layout().world_size();
    for (size_t k = 0; k < u.params().size(); ++k) {
      const auto& pl = u.layout().param(k);
      ShardedParamInfo p;
      p.name = join_name(join_name(v.path, "module"), u.params()[k].name);
      p.original_name = join_name(v.original_path, u.params()[k].original_name);
      for (const auto& a : u.params()[k].aliases) p.aliases.push_back(join_name(v.original_path, a));
      p.shape = pl.shape;
      p.shard_shape = pl.shard_shape(u.shard_rank());
      p.numel = pl.numel();
      p.first_row = pl.first_row_on(u.shard_rank());
      p.rows_per_rank = pl.rows_per_rank;
      p.padding_rows = pl.rows_per_rank * world - pl.rows;
      p.requires_grad = u.params()[k].trainable;
      info.params.push_back(std::move(p));
    }
    md.units.push_back(std::move(info));
  }
  return md;
}

void begin_summon(torch::nn::Module& root, bool writeback) {
  const auto all = settled_wrappers(root, "summon_full_params");  // guards do not nest
  size_t done = 0;
  try {
    for (; done < all.size(); ++done) {
      if (!writeback) all[done].state.unit->save_shards();
      all[done].state.unit->unshard(/*exact=*/true);
      all[done].state.summoned = true;
    }
  } catch (...) {
    for (size_t i = 0; i < done; ++i) {
      all[i].state.summoned = false;
      all[i].state.unit->drop_in_flight();
    }
    throw;
  }
}

void end_summon(torch::nn::Module& root, bool writeback) noexcept {
  try {
    for (const auto& v : wrappers(root)) {
      if (!v.state.summoned) continue;
      v.state.summoned = false;
      if (writeback && v.state.unit->unsharded()) v.state.unit->write_back();
      v.state.unit->reshard();
      if (!writeback) v.state.unit->restore_shards();
    }
  } catch (...) {
  }
}

}  // namespace tdist::detail
