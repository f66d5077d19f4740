#include "fsdp/materialize_unit.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <optional>

#include "deferred/deferred.h"
#include "tdist/errors.h"

namespace tdist::detail {

namespace {

std::vector<NamedTensor> named(const UnitTensors& u) {
  std::vector<NamedTensor> out;
  for (size_t k = 0; k < u.params.size(); ++k) out.push_back({u.param_names[k], u.params[k]});
  for (size_t k = 0; k < u.buffers.size(); ++k) out.push_back({u.buffer_names[k], u.buffers[k]});
  return out;
}

bool any_meta(const std::vector<NamedTensor>& ts) {
  for (const NamedTensor& t : ts) {
    if (t.tensor.defined() && t.tensor.is_meta()) return true;
  }
  return false;
}

// A module's own parameters and buffers that are still meta.
bool holds_meta(torch::nn::Module& m) {
  for (const auto& p : m.parameters(/*recurse=*/false)) {
    if (p.defined() && p.is_meta()) return true;
  }
  for (const auto& b : m.buffers(/*recurse=*/false)) {
    if (b.defined() && b.is_meta()) return true;
  }
  return false;
}

}  // namespace

namespace {

void replay(const std::vector<NamedTensor>& tensors, const FullyShardedDataParallelOptions& o,
            const std::string& label) {
  try {
    materialize_named(tensors, o.device_id);
  } catch (const UsageError& e) {
    throw UsageError(label + ": " + e.what());
  }
}

// skip_init: the parameters empty (a loader gives them their first
// values), the buffers as their construction made them.
std::vector<size_t> make_params_empty(const UnitTensors& unit, const FullyShardedDataParallelOptions& o,
                                      const std::string& label, c10::Device device) {
  std::vector<NamedTensor> params, buffers;
  std::vector<size_t> unset;
  for (size_t k = 0; k < unit.params.size(); ++k) {
    params.push_back({unit.param_names[k], unit.params[k]});
    if (unit.params[k].defined() && unit.params[k].is_meta()) unset.push_back(k);
  }
  for (size_t k = 0; k < unit.buffers.size(); ++k) buffers.push_back({unit.buffer_names[k], unit.buffers[k]});
  if (any_meta(buffers)) replay(buffers, o, label);
  empty_named(params, device);
  return unset;
}

}  // namespace

MaterializedUnit materialize_unit(const UnitTensors& unit, const FullyShardedDataParallelOptions& o,
                                  const std::string& label) {
  const std::vector<NamedTensor> tensors = named(unit);
  MaterializedUnit out;
  if (!any_meta(tensors)) {
    if (!o.device_id) return out;
    at::NoGradGuard no_grad;
    for (const NamedTensor& t : tensors) {
      if (t.tensor.defined() && t.tensor.device() != *o.device_id) t.tensor.set_data(t.tensor.to(*o.device_id));
    }
    return out;
  }
  out.deferred = true;
  const c10::Device device = o.device_id.value_or(c10::Device(c10::kCPU));
  if (o.skip_init && o.param_init_fn) {
    throw UsageError(label + ": skip_init and param_init_fn are both set: skip_init leaves the parameters for a "
                     "loader, param_init_fn initializes them; choose one");
  }
  if (o.skip_init) {
    out.unset_params = make_params_empty(unit, o, label, device);
  } else if (o.param_init_fn) {
    std::vector<torch::nn::Module*> to_init;
    for (torch::nn::Module* m : unit.owners) {
      if (holds_meta(*m)) to_init.push_back(m);
    }
    empty_named(tensors, device);
    for (torch::nn::Module* m : to_init) o.param_init_fn(*m);
  } else {
    replay(tensors, o, label);
  }
  for (const NamedTensor& t : tensors) {
    if (t.tensor.defined() && t.tensor.is_meta()) {
      throw UsageError(label + ": '" + t.name + "' is still on the meta device after its unit was materialized");
    }
    if (t.tensor.defined() && t.tensor.device() != device && o.device_id) {
      at::NoGradGuard no_grad;
      t.tensor.set_data(t.tensor.to(device));
    }
  }
  return out;
}

}  // namespace tdist::detail
