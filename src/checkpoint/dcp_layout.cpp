// What a DCP checkpoint's keys mean (dcp_layout.h).
#include "checkpoint/dcp_layout.h"

#include <algorithm>

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

void add_optimizer(Layout& l, const Item& it, const std::vector<Item::Part>& rest) {
  // By parts: ("state", param, field...) or ("param_groups", i, key...).
  if (rest.size() >= 3 && !rest[0].index) {
    std::vector<Item::Part> tail(rest.begin() + 2, rest.end());
    if (rest[0].key == "state") {
      l.optimizer.push_back({rest[1].key, rest[1].index, joined(tail), &it});
      return;
    }
    if (rest[0].key == "param_groups" && all_digits(rest[1].key)) {
      const size_t g = std::stoul(rest[1].key);
      if (g < 100000) {
        if (l.param_groups.size() <= g) l.param_groups.resize(g + 1);
        l.param_groups[g].options[joined(tail)] = &it;
        return;
      }
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
    if (all_digits(s.middle)) {
      const size_t g = std::stoul(s.middle);
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
      add_optimizer(l, it, {path.begin() + 1, path.end()});
    } else if (path.size() == 1 && l.model_root.empty() && it.tensor) {
      l.model.emplace_back(unwrapped_name(root), &it);
    } else {
      l.other.push_back(&it);
    }
  }
  return l;
}

}  // namespace tdist::checkpoint::dcp
