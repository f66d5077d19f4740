// A model's tensors by unwrapped names. The contract is in model_entries.h.
#include "checkpoint/model_entries.h"

namespace tdist::checkpoint {

namespace {

std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

void walk(torch::nn::Module& m, const std::string& prefix, std::vector<Entry>& out,
          std::vector<std::string>* modules) {
  for (const auto& p : m.named_parameters(/*recurse=*/false)) out.push_back({join(prefix, p.key()), p.value(), true});
  for (const auto& b : m.named_buffers(/*recurse=*/false)) out.push_back({join(prefix, b.key()), b.value(), false});
  const bool wrapper = dynamic_cast<detail::WrapperModule*>(&m) != nullptr;
  for (const auto& c : m.named_children()) {
    const bool step = !(wrapper && c.key() == "module");
    if (step && modules) modules->push_back(join(prefix, c.key()));
    walk(*c.value(), step ? join(prefix, c.key()) : prefix, out, modules);
  }
}

}  // namespace

std::vector<Entry> entries_of(torch::nn::Module& model) {
  std::vector<Entry> out;
  walk(model, "", out, nullptr);
  return out;
}

std::vector<Entry> unique_entries_of(torch::nn::Module& model) {
  std::vector<Entry> out;
  std::unordered_map<const c10::TensorImpl*, size_t> first;
  for (auto& e : entries_of(model)) {
    const auto [it, fresh] = first.emplace(e.tensor.unsafeGetTensorImpl(), out.size());
    if (fresh) {
      out.push_back(std::move(e));
    } else {
      out[it->second].aliases.push_back(std::move(e.name));
    }
  }
  return out;
}

std::vector<std::string> module_names(torch::nn::Module& model) {
  std::vector<Entry> entries;
  std::vector<std::string> out;
  walk(model, "", entries, &out);
  return out;
}

Units units_of(const std::optional<detail::FsdpModel>& fsdp) {
  Units out;
  if (!fsdp) return out;
  for (const auto& u : fsdp->params()) out.emplace(u.tensor.unsafeGetTensorImpl(), u);
  return out;
}

at::Tensor rows_of(const at::Tensor& full, const detail::FsdpParamRecord& u) {
  if (u.full_shape.empty()) return u.rows == 1 ? full : full.new_empty({0});
  if (u.rows == 0) return full.narrow(0, 0, 0);  // first_row may lie past the end
  return full.narrow(0, u.first_row, u.rows);
}

std::vector<std::vector<std::string>> optimizer_param_names(torch::nn::Module& model, torch::optim::Optimizer& opt) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& e : entries_of(model)) {
    if (e.parameter) names.emplace(e.tensor.unsafeGetTensorImpl(), e.name);
  }
  std::vector<std::vector<std::string>> out;
  for (auto& g : opt.param_groups()) {
    out.emplace_back();
    for (const auto& p : g.params()) {
      const auto it = names.find(p.unsafeGetTensorImpl());
      out.back().push_back(it == names.end() ? std::string() : it->second);
    }
  }
  return out;
}

}  // namespace tdist::checkpoint
