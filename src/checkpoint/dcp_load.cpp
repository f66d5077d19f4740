// A DCP checkpoint into this rank's model and optimizer state (dcp_load.h).
#include "checkpoint/dcp_load.h"

#include <ATen/ATen.h>

#include <map>
#include <set>
#include <unordered_map>

#include "checkpoint/dcp_layout.h"
#include "formats/dcp_reader.h"
#include "checkpoint/model_entries.h"
#include "checkpoint/optimizer_kinds.h"
#include "checkpoint/sharded_files.h"
#include "tdist/errors.h"

namespace tdist::checkpoint {

namespace {

// The item's rows [first, first + rows) (FSDP's rows of a unit
// parameter), or all of it.
at::Tensor read_item(const DcpReader& r, const dcp::Item& it, const detail::FsdpParamRecord* unit) {
  if (unit != nullptr && unit->sharded) {  // a 0-d one: whole on the rank holding it, [0] elsewhere
    at::Tensor t = at::empty(rows_shape(it.size, unit->rows), at::TensorOptions().dtype(it.dtype));
    if (unit->rows > 0) r.read_rows(it, unit->first_row, unit->rows, t.data_ptr());  // a rank past the rows: none
    return t;
  }
  at::Tensor t = at::empty(it.size, at::TensorOptions().dtype(it.dtype));
  r.read_box(it, std::vector<int64_t>(it.size.size(), 0), it.size, t.data_ptr());
  return t;
}

class Stager {
 public:
  Stager(const std::string& dir, ProcessGroup& pg, torch::nn::Module& model)
      : reader_(dir), layout_(dcp::classify(reader_.metadata())), pg_(pg), model_(model),
        fsdp_(detail::FsdpModel::of(model)), where_("the DCP checkpoint " + dir) {
    if (fsdp_) {
      for (const auto& u : fsdp_->params()) units_.emplace(u.name, u);
    }
  }

  DcpStaged run(torch::optim::Optimizer* optimizer) {
    DcpStaged s;
    s.save_id = static_cast<int64_t>(reader_.metadata().fingerprint >> 1);
    s.model.metadata = fsdp_ ? fsdp_->metadata() : ShardMetadata{};
    stage_model(s.model);
    if (optimizer) s.optimizer = stage_optimizer(*optimizer);
    return s;
  }

 private:
  DcpReader reader_;
  dcp::Layout layout_;
  ProcessGroup& pg_;
  torch::nn::Module& model_;
  std::optional<detail::FsdpModel> fsdp_;
  std::map<std::string, detail::FsdpParamRecord> units_;
  std::string where_;

  const detail::FsdpParamRecord* unit(const std::string& name) const {
    const auto u = units_.find(name);
    return u == units_.end() ? nullptr : &u->second;
  }

  void stage_model(ShardedStateDict& out) {
    std::map<std::string, const dcp::Item*> saved;
    for (const auto& [name, item] : layout_.model) {
      if (!saved.emplace(name, item).second) throw CheckpointError(where_ + " holds '" + name + "' twice");
    }
    if (saved.empty()) throw CheckpointError(where_ + " holds no model tensors (keys under \"model\" or at the top)");
    std::set<std::string> names;
    for (const auto& e : unique_entries_of(model_)) {
      names.insert(e.name);
      names.insert(e.aliases.begin(), e.aliases.end());
      auto it = saved.find(e.name);
      for (size_t i = 0; i < e.aliases.size() && it == saved.end(); ++i) it = saved.find(e.aliases[i]);
      if (it == saved.end()) throw CheckpointError(where_ + " has no '" + e.name + "'");
      const detail::FsdpParamRecord* u = unit(e.name);
      const std::vector<int64_t> full = u ? u->full_shape : e.tensor.sizes().vec();
      if (it->second->size != full) {
        throw CheckpointError(where_ + ": '" + e.name + "' is " + shape_string(it->second->size) + " there but " +
                              shape_string(full) + " in the model");
      }
      at::Tensor t = read_item(reader_, *it->second, u);
      if (t.scalar_type() != e.tensor.scalar_type() && t.is_floating_point() && e.tensor.is_floating_point()) {
        t = t.to(e.tensor.scalar_type());
      }
      out.tensors.insert(e.name, t);
    }
    for (const auto& [name, item] : saved) {
      if (!names.count(name)) throw CheckpointError(where_ + ": its '" + name + "' is not in the model");
    }
  }

  OptimizerStateDict stage_optimizer(torch::optim::Optimizer& opt) {
    if (layout_.optimizer_root.empty()) {
      throw CheckpointError(where_ + " holds no optimizer state (keys under \"optim\" or \"optimizer\")");
    }
    const auto groups = optimizer_param_names(model_, opt);
    std::vector<std::string> by_index;
    for (const auto& g : groups) by_index.insert(by_index.end(), g.begin(), g.end());
    OptimizerStateDict o;
    o.optimizer = kind_of(opt).name();  // Python's state does not name its class
    o.world_size = fsdp_ ? pg_.size() : 1;
    o.rank = fsdp_ ? pg_.rank() : 0;
    for (const dcp::OptimizerEntry& e : layout_.optimizer) {
      std::string param = dcp::unwrapped_name(e.param);
      if (e.by_index) {
        const size_t i = std::stoul(e.param);
        if (i >= by_index.size()) {
          throw CheckpointError(where_ + ": optimizer state of parameter " + e.param + ", but the optimizer steps " +
                                std::to_string(by_index.size()));
        }
        param = by_index[i];
      }
      if (!e.item->tensor) throw CheckpointError(where_ + ": optimizer state '" + e.item->fqn + "' is not a tensor");
      const detail::FsdpParamRecord* u = unit(param);
      const bool rows = u && u->sharded && e.field != "step" && e.item->size == u->full_shape;
      at::Tensor t = read_item(reader_, *e.item, rows ? u : nullptr);
      if (!o.state.contains(param)) o.state.insert(param, StateDict());
      o.state[param].insert(e.field, t);
    }
    for (size_t g = 0; g < layout_.param_groups.size(); ++g) o.param_groups.push_back(group(g, by_index));
    if (!layout_.param_options.empty()) o.param_groups = flattened_groups(groups);
    return o;
  }

  // A flattened optimizer state dict keeps each parameter's options: each
  // of the optimizer's groups takes its first parameter's.
  std::vector<OptimizerParamGroupState> flattened_groups(const std::vector<std::vector<std::string>>& groups) {
    std::map<std::string, const std::map<std::string, const dcp::Item*>*> by_name;
    for (const auto& [param, options] : layout_.param_options) by_name[dcp::unwrapped_name(param)] = &options;
    std::vector<OptimizerParamGroupState> out;
    for (const auto& names : groups) {
      OptimizerParamGroupState g;
      g.params = names;
      const auto it = names.empty() ? by_name.end() : by_name.find(names[0]);
      if (it == by_name.end()) {
        throw CheckpointError(where_ + ": no param group options for '" + (names.empty() ? "" : names[0]) + "'");
      }
      for (const auto& [key, item] : *it->second) {
        if (item->tensor || key == "params") continue;
        dcp::add_tdist_option(key, reader_.read_value(*item), g.options, where_ + ": param_groups." + names[0] + "." + key);
      }
      out.push_back(std::move(g));
    }
    return out;
  }

  OptimizerParamGroupState group(size_t g, const std::vector<std::string>& by_index) {
    OptimizerParamGroupState out;
    for (const auto& [key, item] : layout_.param_groups[g].options) {
      const std::string what = where_ + ": param_groups[" + std::to_string(g) + "]['" + key + "']";
      if (item->tensor) {  // an option kept as a tensor (lr, with capturable)
        if (item->size.empty() && key != "params") {
          out.options[key] = read_item(reader_, *item, nullptr).item<double>();
        }
        continue;
      }
      const PtValue v = reader_.read_value(*item);
      if (key == "params") {
        if (v.kind() != PtValue::Kind::List && v.kind() != PtValue::Kind::Tuple) throw CheckpointError(what + " is not a list");
        for (const PtValue& p : v.items()) {
          if (p.kind() == PtValue::Kind::String) {
            out.params.push_back(dcp::unwrapped_name(p.as_string()));
          } else if (p.kind() == PtValue::Kind::Int && p.as_int() >= 0 &&
                     static_cast<uint64_t>(p.as_int()) < by_index.size()) {
            out.params.push_back(by_index[static_cast<size_t>(p.as_int())]);
          } else {
            throw CheckpointError(what + " holds something not a parameter's name or index");
          }
        }
      } else {
        dcp::add_tdist_option(key, v, out.options, what);
      }
    }
    return out;
  }
};

}  // namespace

DcpStaged stage_dcp(const std::string& dir, ProcessGroup& pg, torch::nn::Module& model,
                    torch::optim::Optimizer* optimizer) {
  return Stager(dir, pg, model).run(optimizer);
}

}  // namespace tdist::checkpoint
