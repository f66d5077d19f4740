// State dicts of plain, DDP and FSDP models by the unwrapped model's names.
// The contract is in include/tdist/state_dict.h; the FSDP side (which
// parameters units own, gathering them one unit at a time) is in
// src/fsdp/tree.cpp.
#include "tdist/state_dict.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <functional>
#include <set>
#include <unordered_map>

#include "checkpoint/load_checks.h"
#include "checkpoint/model_entries.h"
#include "util/check.h"

namespace tdist {

namespace {

using checkpoint::Entry;
using checkpoint::entries_of;
using checkpoint::shape_string;
using checkpoint::unique_entries_of;
using checkpoint::Units;
using checkpoint::units_of;

// The state's tensor for each entry (unique_entries_of: a tied tensor once,
// its other names in aliases), checked before anything is copied: the
// state holds the tensor under at least one of its names, with the wanted
// shape; under several names (a tied tensor) the same values, or a
// CheckpointError naming two that differ; with strict, nothing else.
std::vector<const at::Tensor*> match(const char* what, const std::vector<Entry>& entries, const StateDict& state,
                                     bool strict, const std::function<std::vector<int64_t>(const Entry&)>& shape) {
  std::vector<const at::Tensor*> out;
  std::set<std::string> names;
  for (const auto& e : entries) {
    const std::vector<int64_t> want = shape(e);
    const at::Tensor* chosen = nullptr;
    std::string chosen_name;
    for (size_t i = 0; i <= e.aliases.size(); ++i) {
      const std::string& name = i == 0 ? e.name : e.aliases[i - 1];
      names.insert(name);
      const at::Tensor* t = state.find(name);
      if (!t || !t->defined()) continue;
      if (t->sizes() != at::IntArrayRef(want)) {
        throw CheckpointError(std::string(what) + ": '" + name + "' is " + shape_string(t->sizes()) +
                              " in the state but " + shape_string(want) + " in the model");
      }
      if (!chosen) {
        chosen = t;
        chosen_name = name;
      } else if (!t->is_same(*chosen) && !at::equal(t->to(chosen->dtype()), *chosen)) {
        throw CheckpointError(std::string(what) + ": '" + chosen_name + "' and '" + name +
                              "' are one tied parameter in the model but hold different values in the state: "
                              "keep one of them (or make them equal)");
      }
    }
    if (!chosen) {
      std::string also;
      for (const auto& a : e.aliases) also += (also.empty() ? " (nor its tied names '" : "', '") + a;
      if (!also.empty()) also += "')";
      throw CheckpointError(std::string(what) + ": the state has no '" + e.name + "'" + also);
    }
    out.push_back(chosen);
  }
  if (strict) {
    for (const auto& item : state) {
      if (!names.count(item.key())) {
        throw CheckpointError(std::string(what) + ": the state's '" + item.key() + "' is not in the model");
      }
    }
  }
  return out;
}

// A buffer FSDP converted to its buffer_dtype, in the dtype it had (a
// copy); anything else as it is.
class OriginalDtypes {
 public:
  explicit OriginalDtypes(const std::optional<detail::FsdpModel>& fsdp) {
    if (fsdp) dtypes_ = fsdp->converted_buffers();
  }
  at::Tensor operator()(const at::Tensor& t) const {
    const auto it = dtypes_.find(t.unsafeGetTensorImpl());
    return it == dtypes_.end() ? t.detach() : t.detach().to(it->second);
  }

 private:
  std::unordered_map<const c10::TensorImpl*, at::ScalarType> dtypes_;
};

}  // namespace

StateDict full_state_dict(torch::nn::Module& model, bool rank0_only) {
  const std::vector<Entry> entries = entries_of(model);
  const auto fsdp = detail::FsdpModel::of(model);
  const auto pg = fsdp ? fsdp->world_group() : nullptr;  // rank 0 of them all (hybrid sharding: of every replica)
  const Units units = units_of(fsdp);
  const bool keep = !pg || !rank0_only || pg->rank() == 0;
  StateDict out;
  if (keep) {
    for (const auto& e : entries) out.insert(e.name, at::Tensor());
  }
  at::NoGradGuard no_grad;
  // A tied tensor is one tensor under each of its names (as Python's
  // state_dict() hands it out).
  std::unordered_map<const c10::TensorImpl*, at::Tensor> values;
  if (pg) {
    std::unordered_map<std::string, const c10::TensorImpl*> unit_impl;  // by the unit's name for it
    for (const auto& [impl, u] : units) unit_impl.emplace(u.name, impl);
    fsdp->visit_gathered([&](const std::string& name, const at::Tensor& full) {
      if (!keep) return;
      const auto it = unit_impl.find(name);
      TDIST_CHECK(it != unit_impl.end());
      values[it->second] = full.detach().clone();
    });
  }
  if (keep) {
    const OriginalDtypes original(fsdp);
    for (const auto& e : entries) {
      at::Tensor& v = values[e.tensor.unsafeGetTensorImpl()];
      if (!v.defined()) v = original(e.tensor).clone();
      out[e.name] = v;
    }
  }
  return out;
}

void load_full_state_dict(torch::nn::Module& model, const StateDict& state, bool strict) {
  const std::vector<Entry> entries = unique_entries_of(model);
  const auto fsdp = detail::FsdpModel::of(model);
  const Units units = units_of(fsdp);
  if (!units.empty()) fsdp->settle("load_full_state_dict");
  const auto full_shape = [&](const Entry& e) {
    const auto it = units.find(e.tensor.unsafeGetTensorImpl());
    return it != units.end() ? it->second.full_shape : e.tensor.sizes().vec();
  };
  const auto sources = match("load_full_state_dict", entries, state, strict, full_shape);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < entries.size(); ++i) {
    const at::Tensor& src = *sources[i];
    at::Tensor dst = entries[i].tensor;
    const auto it = units.find(dst.unsafeGetTensorImpl());
    dst.copy_(it == units.end() ? src : checkpoint::rows_of(src, it->second));
  }
}

ShardedStateDict sharded_state_dict(torch::nn::Module& model) {
  const std::vector<Entry> entries = unique_entries_of(model);
  ShardedStateDict out;
  const auto fsdp = detail::FsdpModel::of(model);
  if (fsdp) {
    fsdp->settle("sharded_state_dict");
    fsdp->check_loaded();  // never a save of shards made with skip_init and not loaded
    out.metadata = fsdp->metadata();
  }
  const OriginalDtypes original(fsdp);
  for (const auto& e : entries) out.tensors.insert(e.name, original(e.tensor));  // a tied tensor once
  return out;
}

namespace {

// load_sharded_state_dict's checks: the state's tensor for each entry.
std::vector<const at::Tensor*> check_sharded(torch::nn::Module& model, const std::vector<Entry>& entries,
                                             const ShardedStateDict& state, bool strict) {
  ShardMetadata md;
  if (const auto fsdp = detail::FsdpModel::of(model)) {
    fsdp->settle("load_sharded_state_dict");
    md = fsdp->metadata();
  }
  if (state.metadata.world_size != md.world_size || state.metadata.rank != md.rank) {
    throw CheckpointError("load_sharded_state_dict: the state is rank " + std::to_string(state.metadata.rank) +
                          " of " + std::to_string(state.metadata.world_size) + ", the model rank " +
                          std::to_string(md.rank) + " of " + std::to_string(md.world_size) +
                          ": load it at its own world size, or go through a full state dict");
  }
  return match("load_sharded_state_dict", entries, state.tensors, strict,
               [](const Entry& e) { return e.tensor.sizes().vec(); });
}

}  // namespace

void checkpoint::check_sharded_model_state(torch::nn::Module& model, const ShardedStateDict& state) {
  check_sharded(model, unique_entries_of(model), state, /*strict=*/true);
}

void load_sharded_state_dict(torch::nn::Module& model, const ShardedStateDict& state, bool strict) {
  const std::vector<Entry> entries = unique_entries_of(model);
  const auto sources = check_sharded(model, entries, state, strict);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < entries.size(); ++i) entries[i].tensor.detach().copy_(*sources[i]);
}

}  // namespace tdist
