// The FSDP wrappers of a model, found by walking its module tree: what the
// operations over a whole model (tree.cpp) and its face (fsdp_model.cpp)
// start from. Internal to src/fsdp.
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace tdist::detail {

struct FsdpState;

struct WrapperVisit {
  FsdpState& state;
  std::string path;           // the wrapper in the wrapped model
  std::string original_path;  // the same without the wrappers' "module" steps
};

std::string join_name(const std::string& a, const std::string& b);
// Every wrapper under m (m included), outermost first, appended to out.
void walk_wrappers(torch::nn::Module& m, const std::string& path, const std::string& original,
                   std::vector<WrapperVisit>& out);
// The wrappers of root between iterations (the state dicts' and summon's
// precondition), their iteration settled; UsageError when root holds none,
// or inside a forward, a backward or a summon (`what` names the caller).
std::vector<WrapperVisit> settled_wrappers(torch::nn::Module& root, const char* what);

}  // namespace tdist::detail
