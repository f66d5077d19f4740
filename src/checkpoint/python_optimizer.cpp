// An optimizer's state in Python's Optimizer.state_dict() layout, read and
// written (include/tdist/pretrained.h has the contract).
#include <ATen/ATen.h>

#include "checkpoint/dcp_layout.h"
#include "checkpoint/model_entries.h"
#include "checkpoint/optimizer_kinds.h"
#include "formats/pt_file.h"
#include "checkpoint/tensor_tree.h"
#include "fsdp/fsdp_model.h"
#include "tdist/pretrained.h"
#include "tdist/state_dict.h"

namespace tdist {

namespace {

using checkpoint::PtValue;

bool looks_like_optimizer_state(const PtValue& v) {
  return v.kind() == PtValue::Kind::Dict && v.find("state") != nullptr && v.find("param_groups") != nullptr;
}

const PtValue& optimizer_root(const PtValue& root, const std::string& path) {
  if (looks_like_optimizer_state(root)) return root;
  if (root.kind() == PtValue::Kind::Dict) {
    for (const char* key : {"optimizer", "optim", "optimizer_state_dict"}) {
      const PtValue* v = root.find(key);
      if (v != nullptr && looks_like_optimizer_state(*v)) return *v;
    }
  }
  throw CheckpointError(path + ": not an optimizer's state_dict (a dict of \"state\" and \"param_groups\", at its "
                        "root or under \"optimizer\", \"optim\" or \"optimizer_state_dict\")");
}

// A parameter's index as Python keys it.
int64_t index_of(const PtValue& v, const std::string& what) {
  if (v.kind() == PtValue::Kind::Int && v.as_int() >= 0) return v.as_int();
  throw CheckpointError(what + " is not a parameter's index");
}

}  // namespace

void load_optimizer_state_dict_file(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& opt) {
  checkpoint::PtReader reader(path);
  const PtValue& root = optimizer_root(reader.root(), path);
  const auto groups = checkpoint::optimizer_param_names(model, opt);
  const PtValue& saved_groups = root.at("param_groups");
  if (saved_groups.kind() != PtValue::Kind::List || saved_groups.items().size() != groups.size()) {
    throw CheckpointError(path + ": " + std::to_string(saved_groups.kind() == PtValue::Kind::List ? saved_groups.items().size() : 0) +
                          " param groups, the optimizer has " + std::to_string(groups.size()));
  }
  OptimizerStateDict o;
  o.optimizer = checkpoint::kind_of(opt).name();
  std::map<int64_t, std::string> names;  // by the file's index
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string where = path + ": param_groups[" + std::to_string(g) + "]";
    const PtValue& group = saved_groups.items()[g];
    if (group.kind() != PtValue::Kind::Dict) throw CheckpointError(where + " is not a dict");
    const PtValue& params = group.at("params");
    if (params.kind() != PtValue::Kind::List || params.items().size() != groups[g].size()) {
      throw CheckpointError(where + " has " + std::to_string(params.kind() == PtValue::Kind::List ? params.items().size() : 0) +
                            " parameters, the optimizer's group " + std::to_string(groups[g].size()));
    }
    OptimizerParamGroupState state;
    for (size_t k = 0; k < params.items().size(); ++k) {
      const int64_t i = index_of(params.items()[k], where + ".params[" + std::to_string(k) + "]");
      if (groups[g][k].empty()) throw UsageError("load_optimizer_state_dict_file: the optimizer steps a tensor that is not a parameter of the model");
      if (!names.emplace(i, groups[g][k]).second) throw CheckpointError(where + " lists parameter " + std::to_string(i) + " twice");
      state.params.push_back(groups[g][k]);
    }
    for (const auto& [key, v] : group.entries()) {
      if (key != "params") checkpoint::dcp::add_tdist_option(key, v, state.options, where + "['" + key + "']");
    }
    o.param_groups.push_back(std::move(state));
  }
  checkpoint::TensorReads read(reader);
  for (const auto& [key, fields] : root.at("state").entries()) {
    const std::string where = path + ": state[" + key + "]";
    const bool number = !key.empty() && key.size() < 19 && key.find_first_not_of("0123456789") == std::string::npos;
    const auto it = number ? names.find(std::stoll(key)) : names.end();
    if (it == names.end()) throw CheckpointError(where + ": no parameter of the param groups has that index");
    if (fields.kind() != PtValue::Kind::Dict) throw CheckpointError(where + " is not a dict");
    StateDict s;
    for (const auto& [field, v] : fields.entries()) {
      if (v.is_none()) continue;  // SGD's momentum_buffer without momentum
      if (v.kind() == PtValue::Kind::Tensor) {
        s.insert(field, read(v.as_tensor()));
      } else if (v.kind() == PtValue::Kind::Int || v.kind() == PtValue::Kind::Float) {  // an old PyTorch's step
        s.insert(field, at::scalar_tensor(v.as_float(), at::kDouble));
      } else {
        throw CheckpointError(where + "['" + field + "'] is not a tensor or a number");
      }
    }
    o.state.insert(it->second, std::move(s));
  }
  load_full_optimizer_state_dict(model, opt, o);
}

void save_optimizer_state_dict_file(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& opt) {
  const OptimizerStateDict o = full_optimizer_state_dict(model, opt);
  const auto fsdp = detail::FsdpModel::of(model);
  if (fsdp && fsdp->group()->rank() != 0) return;
  const auto groups = checkpoint::optimizer_param_names(model, opt);
  std::map<std::string, int64_t> index;
  int64_t next = 0;
  for (const auto& g : groups) {
    for (const auto& n : g) index.emplace(n, next++);
  }
  checkpoint::TensorSink sink;
  std::vector<std::pair<int64_t, PtValue>> state;
  for (const auto& p : o.state) {
    std::vector<std::pair<std::string, PtValue>> fields;
    for (const auto& f : p.value()) {
      fields.emplace_back(f.key(), sink.add(f.key() == "step" ? f.value().to(at::kFloat) : f.value().contiguous()));
    }
    state.emplace_back(index.at(p.key()), PtValue::dict(std::move(fields)));
  }
  std::vector<PtValue> param_groups;
  for (size_t g = 0; g < o.param_groups.size(); ++g) {
    auto entries = checkpoint::dcp::python_options(o.optimizer, o.param_groups[g].options);
    std::vector<PtValue> params;
    for (const auto& n : o.param_groups[g].params) params.push_back(PtValue::integer(index.at(n)));
    entries.emplace_back("params", PtValue::list(std::move(params)));
    param_groups.push_back(PtValue::dict(std::move(entries)));
  }
  const PtValue root = PtValue::dict({{"state", PtValue::int_keyed_dict(std::move(state))},
                                      {"param_groups", PtValue::list(std::move(param_groups))}});
  checkpoint::PtWriter w(path);
  sink.write(w, root);
  w.finish();
}

}  // namespace tdist
