// What a DCP checkpoint's keys mean (dcp_layout.h).
#include "checkpoint/dcp_layout.h"

#include <algorithm>

#include "tdist/errors.h"

namespace tdist::checkpoint::dcp {

namespace {

bool is_optimizer_root(const std::string& s) { return s == "optim" || s == "optimizer"; }

bool all_digits(const std::string& s) {
  return !s.empty() && s.size() < 10 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The parts after the root, as one dotted string when the save flattened
// them (no planner data, or a flattened optimizer state dict), split at
// the first and last dot: "state.l1.weight.exp_avg" -> state, l1.weight, exp_avg.
struct Split {
  std::string head, middle, last;
  bool ok = false;
};
Split split3(const std::string& s) {
  Split r;
  const size_t a = s.find('.'), b = s.rfind('.');
  if (a == std::string::npos || b == a) return r;
  r.head = s.substr(0, a);
  r.middle = s.substr(a + 1, b - a - 1);
  r.last = s.substr(b + 1);
  r.ok = !r.middle.empty() && !r.last.empty();
  return r;
}

// `flat`: the planner data gives the rest as one string, which the save's
// optimizer state dict had as one key: flatten_optimizer_state_dict's
// "state.<param>.<field>" and "param_groups.<param>.<key>".
// A param group's index, when it is one and below `most` (a group holds a
// key of its own at least, so no more groups than keys: a hostile index
// never sizes a vector).
bool group_index(const std::string& s, size_t most, size_t* g) {
  if (!all_digits(s)) return false;
  *g = std::stoul(s);
  return *g < most;
}

void add_optimizer(Layout& l, const Item& it, const std::vector<Item::Part>& rest, bool flat, size_t most) {
  // By parts: ("state", param, field...) or ("param_groups", i, key...).
  if (rest.size() >= 3 && !rest[0].index) {
    std::vector<Item::Part> tail(rest.begin() + 2, rest.end());
    if (rest[0].key == "state") {
      l.optimizer.push_back({rest[1].key, rest[1].index, joined(tail), &it});
      return;
    }
    size_t g = 0;
    if (rest[0].key == "param_groups" && group_index(rest[1].key, most, &g)) {
      if (l.param_groups.size() <= g) l.param_groups.resize(g + 1);
      l.param_groups[g].options[joined(tail)] = &it;
      return;
    }
  }
  // Flattened into one string.
  const Split s = split3(joined(rest));
  if (s.ok && s.head == "state") {
    l.optimizer.push_back({s.middle, false, s.last, &it});
    return;
  }
  if (s.ok && s.head == "param_groups") {
    const size_t dot = s.middle.find('.');
    if (flat) {
      l.param_options[s.middle][s.last] = &it;
      return;
    }
    size_t g = 0;
    if (group_index(s.middle, most, &g)) {
      if (l.param_groups.size() <= g) l.param_groups.resize(g + 1);
      l.param_groups[g].options[s.last] = &it;
      return;
    }
    if (dot == std::string::npos || !all_digits(s.middle.substr(0, dot))) {
      l.param_options[s.middle][s.last] = &it;
      return;
    }
  }
  l.other.push_back(&it);
}

}  // namespace

std::string unwrapped_name(const std::string& name) {
  static const char* const kWrappers[] = {"_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."};
  std::string out;
  size_t at = 0;
  if (name.rfind("module.", 0) == 0) at = 7;
  while (at < name.size()) {
    bool dropped = false;
    for (const char* w : kWrappers) {
      const std::string ws = w;
      if (name.compare(at, ws.size(), ws) == 0) {
        at += ws.size();
        dropped = true;
        break;
      }
    }
    if (dropped) continue;
    const size_t dot = name.find('.', at);
    const size_t end = dot == std::string::npos ? name.size() : dot + 1;
    out.append(name, at, end - at);
    at = end;
  }
  return out;
}

Layout classify(const Metadata& m) {
  Layout l;
  const bool has_model_root = std::any_of(m.items.begin(), m.items.end(), [](const Item& it) {
    return it.path.size() >= 2 && it.path[0].key == "model" && !it.path[0].index;
  });
  const bool planned = std::any_of(m.items.begin(), m.items.end(), [](const Item& it) { return it.path.size() >= 2; });
  if (has_model_root) l.model_root = "model";
  for (const Item& it : m.items) {
    std::vector<Item::Part> path = it.path;
    if (!planned && path.size() == 1) {  // no planner data: split the root off the key
      const std::string& k = path[0].key;
      const size_t dot = k.find('.');
      if (dot != std::string::npos && (k.compare(0, dot, "model") == 0 || is_optimizer_root(k.substr(0, dot)))) {
        path = {{k.substr(0, dot), false}, {k.substr(dot + 1), false}};
        if (path[0].key == "model") l.model_root = "model";
      }
    }
    const std::string& root = path[0].key;
    if (path.size() >= 2 && root == "model" && !path[0].index) {
      if (it.tensor) {
        l.model.emplace_back(unwrapped_name(joined({path.begin() + 1, path.end()})), &it);
      } else {
        l.other.push_back(&it);
      }
    } else if (path.size() >= 2 && is_optimizer_root(root)) {
      l.optimizer_root = root;
      add_optimizer(l, it, {path.begin() + 1, path.end()}, planned && path.size() == 2, m.items.size());
    } else if (path.size() == 1 && l.model_root.empty() && it.tensor) {
      l.model.emplace_back(unwrapped_name(root), &it);
    } else {
      l.other.push_back(&it);
    }
  }
  return l;
}

std::vector<std::pair<std::string, PtValue>> python_options(const std::string& kind,
                                                            const std::map<std::string, double>& options) {
  static const std::map<std::string, std::vector<std::string>> keys = {
      {"Adam", {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable",
                "fused", "decoupled_weight_decay"}},
      {"SGD", {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "differentiable",
               "fused"}},
      {"RMSprop", {"lr", "alpha", "eps", "weight_decay", "momentum", "centered", "capturable", "foreach", "maximize",
                   "differentiable"}},
      {"Adagrad", {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "foreach", "maximize",
                   "differentiable", "fused"}}};
  const auto k = keys.find(kind == "AdamW" ? "Adam" : kind);
  if (k == keys.end()) throw UsageError("no PyTorch param group keys for the optimizer '" + kind + "'");
  const auto num = [&](const char* name) {
    const auto it = options.find(name);
    return it == options.end() ? PtValue::none() : PtValue::floating(it->second);
  };
  const auto flag = [&](const char* name) {
    const auto it = options.find(name);
    return PtValue::boolean(it != options.end() && it->second != 0);
  };
  std::vector<std::pair<std::string, PtValue>> out;
  for (const std::string& key : k->second) {
    PtValue v;
    if (key == "betas") {
      v = PtValue::tuple({num("beta1"), num("beta2")});
    } else if (key == "amsgrad" || key == "nesterov" || key == "centered") {
      v = flag(key.c_str());
    } else if (key == "decoupled_weight_decay") {
      v = PtValue::boolean(kind == "AdamW");
    } else if (key == "maximize" || key == "capturable" || key == "differentiable") {
      v = PtValue::boolean(false);
    } else if (key == "foreach" || key == "fused") {
      v = PtValue::none();
    } else {
      v = num(key.c_str());
    }
    out.emplace_back(key, std::move(v));
  }
  return out;
}

namespace {
bool number(const PtValue& v, double* out) {
  switch (v.kind()) {
    case PtValue::Kind::Bool: *out = v.as_bool() ? 1 : 0; return true;
    case PtValue::Kind::Int: *out = static_cast<double>(v.as_int()); return true;
    case PtValue::Kind::Float: *out = v.as_float(); return true;
    default: return false;
  }
}
}  // namespace

void add_tdist_option(const std::string& key, const PtValue& v, std::map<std::string, double>& options,
                      const std::string& where) {
  if (v.is_none()) return;
  if (key == "betas") {
    double b1, b2;
    if ((v.kind() != PtValue::Kind::Tuple && v.kind() != PtValue::Kind::List) || v.items().size() != 2 ||
        !number(v.items()[0], &b1) || !number(v.items()[1], &b2)) {
      throw CheckpointError(where + " is not two numbers");
    }
    options["beta1"] = b1;
    options["beta2"] = b2;
    return;
  }
  static const char* const kNumbers[] = {"lr", "eps", "weight_decay", "momentum", "dampening", "alpha",
                                         "lr_decay", "initial_accumulator_value", "amsgrad", "nesterov", "centered"};
  double x;
  if (!number(v, &x)) {  // another's key with another kind of value: none of tdist's business
    if (std::find(std::begin(kNumbers), std::end(kNumbers), key) != std::end(kNumbers)) {
      throw CheckpointError(where + " is not a number");
    }
    return;
  }
  if (key == "maximize" && x != 0) throw CheckpointError(where + " is True: tdist's optimizers do not maximize");
  options[key] = x;  // the optimizer's kind keeps those it knows
}

std::string kind_of_state(const std::vector<std::string>& fields, bool decoupled_weight_decay) {
  const auto has = [&](const char* f) { return std::find(fields.begin(), fields.end(), f) != fields.end(); };
  if (has("exp_avg") || has("exp_avg_sq")) return decoupled_weight_decay ? "AdamW" : "Adam";
  if (has("square_avg")) return "RMSprop";
  if (has("sum")) return "Adagrad";
  if (has("momentum_buffer")) return "SGD";
  return "";
}

}  // namespace tdist::checkpoint::dcp
