// Optimizer state dicts by parameter name, full (gathered like the
// parameters) and sharded. The contract is in include/tdist/state_dict.h;
// what each optimizer holds is in optimizer_kinds.h.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <set>
#include <unordered_map>

#include "checkpoint/load_checks.h"
#include "checkpoint/model_entries.h"
#include "checkpoint/optimizer_kinds.h"
#include "tdist/state_dict.h"
#include "util/torch_compat.h"

namespace tdist {

namespace {

using checkpoint::shape_string;

// Every parameter `opt` steps, by group, with its name in the model.
struct Stepped {
  std::string name;
  at::Tensor param;
  const detail::FsdpParamRecord* unit = nullptr;  // the FSDP unit parameter it is, if any
};

std::vector<std::vector<Stepped>> stepped_params(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                                 const checkpoint::Units& units, const char* what) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& e : checkpoint::entries_of(model)) {
    if (e.parameter) names.emplace(e.tensor.unsafeGetTensorImpl(), e.name);
  }
  std::vector<std::vector<Stepped>> groups;
  for (auto& g : opt.param_groups()) {
    groups.emplace_back();
    for (const auto& p : g.params()) {
      const auto it = names.find(p.unsafeGetTensorImpl());
      if (it == names.end()) {
        throw UsageError(std::string(what) + ": the optimizer steps a tensor that is not a parameter of the model");
      }
      const auto u = units.find(p.unsafeGetTensorImpl());
      groups.back().push_back({it->second, p, u == units.end() ? nullptr : &u->second});
    }
  }
  return groups;
}

// A unit parameter's state tensor (this rank's rows), whole: every rank's
// rows all-gathered (padded to the same count), the padding cut off.
at::Tensor gather_rows(ProcessGroup& pg, const at::Tensor& rows, const detail::FsdpParamRecord& u) {
  int64_t row_numel = 1;
  for (size_t d = 1; d < u.full_shape.size(); ++d) row_numel *= u.full_shape[d];
  const int64_t full_rows = u.full_shape.empty() ? 1 : u.full_shape[0];
  at::Tensor padded = at::zeros({u.rows_per_rank * row_numel}, rows.options());
  padded.narrow(0, 0, rows.numel()).copy_(rows.reshape({-1}));
  at::Tensor all = at::empty({u.rows_per_rank * row_numel * pg.size()}, rows.options());
  pg.all_gather_into_tensor(all, padded)->wait();
  return all.narrow(0, 0, full_rows * row_numel).view(u.full_shape).clone();
}


// Which of a kind's fields a state holds, as bits in the order seen, so
// that ranks can check they agree before gathering them.
int64_t field_mask(const StateDict& fields) {
  static const char* const kNames[] = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                                       "square_avg", "grad_avg", "sum"};
  int64_t mask = 0;
  for (size_t i = 0; i < sizeof(kNames) / sizeof(kNames[0]); ++i) {
    if (fields.contains(kNames[i])) mask |= int64_t{1} << i;
  }
  return mask;
}

OptimizerStateDict take(torch::nn::Module& model, torch::optim::Optimizer& opt, bool gather, bool keep,
                        const char* what) {
  const checkpoint::OptimizerKind& kind = checkpoint::kind_of(opt);
  const auto fsdp = detail::FsdpModel::of(model);
  const checkpoint::Units units = checkpoint::units_of(fsdp);
  const auto pg = fsdp ? fsdp->group() : nullptr;
  if (fsdp) fsdp->settle(what);
  const auto groups = stepped_params(model, opt, units, what);
  OptimizerStateDict out;
  out.optimizer = kind.name();
  if (pg && !gather) {
    out.world_size = pg->size();
    out.rank = pg->rank();
  }
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < groups.size(); ++g) {
    OptimizerParamGroupState group;
    group.options = kind.read_options(opt.param_groups()[g].options());
    for (const auto& s : groups[g]) {
      group.params.push_back(s.name);
      const auto st = opt.state().find(compat::optimizer_state_key(s.param));
      StateDict fields;
      if (st != opt.state().end()) fields = kind.read_state(*st->second);
      const bool gathered = gather && s.unit && s.unit->sharded;
      if (gathered) {
        // Every rank must gather the same fields: a rank whose state differs
        // fails them all, here, instead of pairing the wrong gathers.
        const int64_t mask = field_mask(fields);
        at::Tensor both = at::tensor({mask, -mask}, at::kLong);
        pg->all_reduce(both, {ReduceOp::MAX})->wait();
        if (both[0].item<int64_t>() != -both[1].item<int64_t>()) {
          throw CheckpointError(std::string(what) + ": the ranks hold different optimizer state for '" + s.name +
                                "' (some stepped it, some did not?)");
        }
      }
      StateDict kept;
      for (const auto& f : fields) {
        at::Tensor t = f.value().detach();
        if (gathered && f.key() != "step") {
          t = gather_rows(*pg, t, *s.unit);  // a copy
        } else if (gather) {
          t = t.clone();  // the full state is a copy, as full_state_dict's
        }
        kept.insert(f.key(), t);
      }
      if (keep && !kept.is_empty()) out.state.insert(s.name, std::move(kept));
    }
    if (keep) out.param_groups.push_back(std::move(group));
  }
  return out;
}

void put(torch::nn::Module& model, torch::optim::Optimizer& opt, const OptimizerStateDict& state, bool full,
         const char* what, bool apply = true, bool adopt = false) {
  const checkpoint::OptimizerKind& kind = checkpoint::kind_of(opt);
  const auto fsdp = detail::FsdpModel::of(model);
  const checkpoint::Units units = checkpoint::units_of(fsdp);
  const auto pg = fsdp ? fsdp->group() : nullptr;
  if (fsdp) fsdp->settle(what);
  const auto groups = stepped_params(model, opt, units, what);
  const auto fail = [&](const std::string& why) { throw CheckpointError(std::string(what) + ": " + why); };
  if (!state.optimizer.empty() && state.optimizer != kind.name()) {
    fail("the state is " + state.optimizer + "'s, the optimizer " + kind.name());
  }
  if (!full) {
    const int world = pg ? pg->size() : 1, rank = pg ? pg->rank() : 0;
    if (state.world_size != world || state.rank != rank) {
      fail("the state is rank " + std::to_string(state.rank) + " of " + std::to_string(state.world_size) +
           ", the model rank " + std::to_string(rank) + " of " + std::to_string(world) +
           ": load it at its own world size, or go through a full state dict");
    }
  }
  if (state.param_groups.size() != groups.size()) {
    fail("the state has " + std::to_string(state.param_groups.size()) + " param groups, the optimizer " +
         std::to_string(groups.size()));
  }
  // Everything checked, and every new state made, before the optimizer changes.
  std::vector<std::pair<compat::OptimizerStateKey, std::unique_ptr<torch::optim::OptimizerParamState>>> made;
  std::vector<compat::OptimizerStateKey> cleared;  // parameters the state has nothing for
  std::set<std::string> stepped;
  std::set<const void*> adopted;  // storages given to a state: never two states on one
  for (size_t g = 0; g < groups.size(); ++g) {
    if (state.param_groups[g].params.size() != groups[g].size()) {
      fail("param group " + std::to_string(g) + " has " + std::to_string(state.param_groups[g].params.size()) +
           " parameters in the state, " + std::to_string(groups[g].size()) + " in the optimizer");
    }
    for (size_t i = 0; i < groups[g].size(); ++i) {
      const Stepped& s = groups[g][i];
      stepped.insert(s.name);
      if (state.param_groups[g].params[i] != s.name) {
        fail("param group " + std::to_string(g) + " holds '" + state.param_groups[g].params[i] +
             "' in the state where the optimizer has '" + s.name + "'");
      }
      const StateDict* fields = state.state.find(s.name);
      if (!fields) {
        cleared.push_back(compat::optimizer_state_key(s.param));
        continue;
      }
      const std::vector<int64_t> want = full && s.unit ? s.unit->full_shape : s.param.sizes().vec();
      StateDict mine;
      for (const auto& f : *fields) {
        if (f.key() != "step" && f.value().sizes() != at::IntArrayRef(want)) {
          fail("the " + f.key() + " of '" + s.name + "' is " + shape_string(f.value().sizes()) +
               " in the state but the parameter is " + shape_string(want));
        }
        const bool slice = full && s.unit && s.unit->sharded && f.key() != "step";
        at::Tensor t = slice ? checkpoint::rows_of(f.value(), *s.unit) : f.value();
        if (adopt && t.defined()) {  // only a whole storage of its own becomes the state
          const bool whole = t.is_contiguous() && t.storage_offset() == 0 && t.storage().nbytes() == t.nbytes();
          if (!whole || !adopted.insert(t.storage().data()).second) t = t.clone();
        }
        mine.insert(f.key(), t);
      }
      made.emplace_back(compat::optimizer_state_key(s.param),
                        kind.make_state(mine, s.name, apply ? s.param : at::Tensor(), adopt));
    }
  }
  for (const auto& item : state.state) {
    if (!stepped.count(item.key())) fail("the state's '" + item.key() + "' is no parameter the optimizer steps");
  }
  if (!apply) return;
  for (size_t g = 0; g < groups.size(); ++g) {
    kind.write_options(opt.param_groups()[g].options(), state.param_groups[g].options);
  }
  for (const auto& key : cleared) opt.state().erase(key);
  for (auto& [key, st] : made) opt.state()[key] = std::move(st);
}

}  // namespace

OptimizerStateDict full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& opt, bool rank0_only) {
  const auto fsdp = detail::FsdpModel::of(model);
  const auto pg = fsdp ? fsdp->world_group() : nullptr;  // rank 0 of them all (hybrid sharding: of every replica)
  const bool keep = !pg || !rank0_only || pg->rank() == 0;
  return take(model, opt, /*gather=*/true, keep, "full_optimizer_state_dict");
}

void load_full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                    const OptimizerStateDict& state) {
  put(model, opt, state, /*full=*/true, "load_full_optimizer_state_dict");
}

OptimizerStateDict sharded_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& opt) {
  return take(model, opt, /*gather=*/false, /*keep=*/true, "sharded_optimizer_state_dict");
}

void load_sharded_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                       const OptimizerStateDict& state) {
  put(model, opt, state, /*full=*/false, "load_sharded_optimizer_state_dict");
}

namespace checkpoint {
void check_sharded_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                   const OptimizerStateDict& state) {
  put(model, opt, state, /*full=*/false, "load_sharded_optimizer_state_dict", /*apply=*/false);
}
void adopt_sharded_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                   const OptimizerStateDict& state) {
  put(model, opt, state, /*full=*/false, "load_sharded_optimizer_state_dict", /*apply=*/true, /*adopt=*/true);
}
}  // namespace checkpoint

}  // namespace tdist
