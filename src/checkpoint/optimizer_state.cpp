// Optimizer state dicts by parameter name, full (gathered like the
// parameters) and sharded. The contract is in include/tdist/state_dict.h;
// what each optimizer holds is in optimizer_kinds.h.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <unordered_map>

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
  const detail::UnitParam* unit = nullptr;  // the FSDP unit parameter it is, if any
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
at::Tensor gather_rows(ProcessGroup& pg, const at::Tensor& rows, const detail::UnitParam& u) {
  int64_t row_numel = 1;
  for (size_t d = 1; d < u.full_shape.size(); ++d) row_numel *= u.full_shape[d];
  const int64_t full_rows = u.full_shape.empty() ? 1 : u.full_shape[0];
  at::Tensor padded = at::zeros({u.rows_per_rank * row_numel}, rows.options());
  padded.narrow(0, 0, rows.numel()).copy_(rows.reshape({-1}));
  at::Tensor all = at::empty({u.rows_per_rank * row_numel * pg.size()}, rows.options());
  pg.all_gather_into_tensor(all, padded)->wait();
  return all.narrow(0, 0, full_rows * row_numel).view(u.full_shape).clone();
}

// This rank's rows of a whole state tensor.
at::Tensor rows_of(const at::Tensor& full, const detail::UnitParam& u) {
  if (u.full_shape.empty()) return u.rows == 1 ? full : at::empty({0}, full.options());
  return full.narrow(0, u.first_row, u.rows);
}

OptimizerStateDict take(torch::nn::Module& model, torch::optim::Optimizer& opt, bool gather, bool keep,
                        const char* what) {
  const checkpoint::OptimizerKind& kind = checkpoint::kind_of(opt);
  const checkpoint::Units units = checkpoint::units_of(model);
  const auto pg = detail::units_group(model);
  if (pg) detail::settle_units(model, what);
  const auto groups = stepped_params(model, opt, units, what);
  OptimizerStateDict out;
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < groups.size(); ++g) {
    OptimizerParamGroupState group;
    group.options = kind.read_options(opt.param_groups()[g].options());
    for (const auto& s : groups[g]) {
      group.params.push_back(s.name);
      const auto st = opt.state().find(compat::optimizer_state_key(s.param));
      StateDict fields;
      if (st != opt.state().end()) fields = kind.read_state(*st->second);
      StateDict kept;
      for (const auto& f : fields) {
        at::Tensor t = f.value().detach();
        if (gather && s.unit && s.unit->sharded && f.key() != "step") {
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
         const char* what) {
  const checkpoint::OptimizerKind& kind = checkpoint::kind_of(opt);
  const checkpoint::Units units = checkpoint::units_of(model);
  if (detail::units_group(model)) detail::settle_units(model, what);
  const auto groups = stepped_params(model, opt, units, what);
  if (state.param_groups.size() != groups.size()) {
    throw CheckpointError(std::string(what) + ": the state has " + std::to_string(state.param_groups.size()) +
                          " param groups, the optimizer " + std::to_string(groups.size()));
  }
  // Everything checked, and every new state made, before the optimizer changes.
  std::vector<std::pair<compat::OptimizerStateKey, std::unique_ptr<torch::optim::OptimizerParamState>>> made;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (state.param_groups[g].params.size() != groups[g].size()) {
      throw CheckpointError(std::string(what) + ": param group " + std::to_string(g) + " has " +
                            std::to_string(state.param_groups[g].params.size()) + " parameters in the state, " +
                            std::to_string(groups[g].size()) + " in the optimizer");
    }
    for (size_t i = 0; i < groups[g].size(); ++i) {
      const Stepped& s = groups[g][i];
      if (state.param_groups[g].params[i] != s.name) {
        throw CheckpointError(std::string(what) + ": param group " + std::to_string(g) + " holds '" +
                              state.param_groups[g].params[i] + "' in the state where the optimizer has '" + s.name +
                              "'");
      }
      const StateDict* fields = state.state.find(s.name);
      if (!fields) continue;
      const std::vector<int64_t> want = full && s.unit ? s.unit->full_shape : s.param.sizes().vec();
      StateDict mine;
      for (const auto& f : *fields) {
        if (f.key() != "step" && f.value().sizes() != at::IntArrayRef(want)) {
          throw CheckpointError(std::string(what) + ": the " + f.key() + " of '" + s.name + "' is " +
                                shape_string(f.value().sizes()) + " in the state but the parameter is " +
                                shape_string(want));
        }
        const bool slice = full && s.unit && s.unit->sharded && f.key() != "step";
        mine.insert(f.key(), slice ? rows_of(f.value(), *s.unit) : f.value());
      }
      made.emplace_back(compat::optimizer_state_key(s.param), kind.make_state(mine, s.name));
    }
  }
  for (size_t g = 0; g < groups.size(); ++g) kind.write_options(opt.param_groups()[g].options(), state.param_groups[g].options);
  for (auto& [key, st] : made) opt.state()[key] = std::move(st);
}

}  // namespace

OptimizerStateDict full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& opt, bool rank0_only) {
  const auto pg = detail::units_group(model);
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

}  // namespace tdist
