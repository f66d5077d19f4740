#include <map>
#include <mutex>

#include "comm/backend.h"
#include "comm/op_label.h"

namespace tdist::comm {

// The backends built into this copy of tdist (builtin.cpp).
void add_builtin_backends(std::map<std::string, BackendFactory>& factories);

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, BackendFactory> factories;
};

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;  // never destroyed: usable from static destructors
    add_builtin_backends(reg->factories);
    return reg;
  }();
  return *r;
}

}  // namespace

void register_backend(const std::string& name, BackendFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.factories[name] = std::move(factory);
}

bool has_backend(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.factories.count(name) > 0;
}

std::vector<std::string> backend_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (const auto& [k, v] : r.factories) names.push_back(k);
  return names;
}

std::unique_ptr<Backend> create_backend(const std::string& name, const BackendContext& ctx) {
  BackendFactory f;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(name);
    if (it == r.factories.end()) {
      std::string known;
      for (const auto& [k, v] : r.factories) known += (known.empty() ? "" : ", ") + k;
      throw UsageError("unknown backend '" + name + "'; this build of tdist has: " + known);
    }
    f = it->second;
  }
  return f(ctx);
}

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kAllToAll: return "all_to_all";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kSymmetricAlloc: return "empty_symmetric";
  }
  return "unknown_op";
}

std::string describe_op(const OpDesc& d) {
  const auto kind = static_cast<OpKind>(d.kind);
  std::string s = op_kind_name(kind);
  s += "(";
  switch (kind) {
    case OpKind::kAllReduce:
    case OpKind::kReduce:
    case OpKind::kReduceScatter:
      s += std::string(dtype_name(static_cast<DataType>(d.dtype))) + " x " + std::to_string(d.count) + ", " +
           reduce_op_name(static_cast<ReduceOp>(d.reduce_op));
      break;
    case OpKind::kBarrier: break;
    default: s += std::to_string(d.count) + " bytes"; break;
  }
  if (d.root >= 0) s += ", root " + std::to_string(d.root);
  s += ")";
  return s;
}

std::string describe(const OpDesc& d) { return describe_op(d) + " #" + std::to_string(op_label_or(d.seq + 1)); }

}  // namespace tdist::comm
