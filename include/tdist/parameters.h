// A module's parameters with each tensor once.
//
// LibTorch's Module::parameters() lists a parameter registered under two
// names (a tied one: GPT-2's lm_head.weight is its transformer.wte.weight)
// twice, and an optimizer built on that list steps it twice per step.
// Python's Module.parameters() lists it once; so does this:
//
//   torch::optim::AdamW opt(tdist::unique_parameters(*model), 3e-4);
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <unordered_set>
#include <vector>

namespace tdist {

inline std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module, bool recurse = true) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters(recurse)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

}  // namespace tdist
