// A model's tensors as state dicts see them: every parameter and buffer by
// its name in the unwrapped model (the "module" steps of FSDP, DDP and
// checkpoint_module wrappers left out), and which of them FSDP units own.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "checkpoint/checkpoint_tree.h"  // shape_string
#include "fsdp/fsdp_model.h"
#include "tdist/fsdp.h"

namespace tdist::checkpoint {

struct Entry {
  std::string name;   // in the unwrapped model
  at::Tensor tensor;  // the model's own (a unit's parameter: this rank's rows)
  bool parameter = true;
  std::vector<std::string> aliases = {};  // unique_entries_of: the tensor's other names, in model order
};

// Each module's parameters, then its buffers, then its children's.
std::vector<Entry> entries_of(torch::nn::Module& model);

// The same, each tensor once (by TensorImpl) under its first name, the
// names it is also registered under (a tied parameter) in `aliases`.
std::vector<Entry> unique_entries_of(torch::nn::Module& model);

// Every submodule's name in the unwrapped model (parents first), those
// without tensors too.
std::vector<std::string> module_names(torch::nn::Module& model);

// The units' parameters by TensorImpl (empty without FSDP).
using Units = std::unordered_map<const c10::TensorImpl*, detail::FsdpParamRecord>;
Units units_of(const std::optional<detail::FsdpModel>& fsdp);

// The names of the parameters `opt` steps, group by group in its order
// (Python's optimizer state dicts number them so); "" for a tensor that
// is not one of the model's parameters.
std::vector<std::vector<std::string>> optimizer_param_names(torch::nn::Module& model, torch::optim::Optimizer& opt);

// This rank's rows of a whole tensor shaped like the unit parameter u:
// rows [first_row, first_row + rows) (none on a rank that holds none; a 0-d
// one whole on the rank holding it, an empty [0] elsewhere), the shape
// the parameter has between iterations.
at::Tensor rows_of(const at::Tensor& full, const detail::FsdpParamRecord& u);

}  // namespace tdist::checkpoint
