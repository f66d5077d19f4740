// The C ABI's model (c_model.h): the binding's module tree, and the DDP
// and FSDP wrappers whose forward the binding runs between their calls.
#include "c/c_model.h"

#include <sstream>

namespace tdist::c {

DdpWrapper::DdpWrapper(std::shared_ptr<torch::nn::Module> module, DistributedDataParallelOptions options)
    : module_(register_module("module", std::move(module))), core_(*module_, std::move(options)) {}

void DdpWrapper::pre_forward() {
  Join::notify_join_context(*this);
  core_.before_forward(active_join());
}

void DdpWrapper::post_forward(const std::vector<at::Tensor>& outputs) {
  if (core_.wants_outputs()) core_.after_forward(outputs);
}

FsdpUnit::FsdpUnit(std::shared_ptr<torch::nn::Module> module, FullyShardedDataParallelOptions options)
    : module_(register_module("module", std::move(module))), core_(*module_, std::move(options)) {}

void FsdpUnit::pre_forward() {
  if (in_forward_) usage("tdist_fsdp_pre_forward twice without tdist_fsdp_post_forward");
  Join::notify_join_context(*this);
  core_.begin_forward();
  in_forward_ = true;
}

void FsdpUnit::post_forward(const std::vector<at::Tensor>& outputs) {
  if (!in_forward_) usage("tdist_fsdp_post_forward without tdist_fsdp_pre_forward");
  in_forward_ = false;
  try {
    core_.end_forward(outputs, is_training());
  } catch (...) {
    core_.abort_forward();
    throw;
  }
}

std::unique_ptr<JoinHook> FsdpUnit::join_hook(const JoinOptions& options) {
  return tdist::detail::fsdp_join_hook(*this, join_step_, options);
}


std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(path);
  while (std::getline(in, part, '.')) {
    if (part.empty()) usage("'" + path + "' has an empty step");
    parts.push_back(part);
  }
  if (!path.empty() && path.back() == '.') usage("'" + path + "' has an empty step");
  return parts;
}

// The module a wrapper (DDP, an FSDP unit) stands for.
ModulePtr unwrap(ModulePtr m) {
  while (dynamic_cast<tdist::detail::WrapperModule*>(m.get())) {
    const auto kids = m->named_children();
    const ModulePtr* inner = kids.find("module");
    if (!inner) break;
    m = *inner;
  }
  return m;
}

ModulePtr child_of(const ModulePtr& node, const std::string& name) {
  const auto kids = unwrap(node)->named_children();
  const ModulePtr* c = kids.find(name);
  return c ? *c : nullptr;
}

namespace {
// The submodule at the first n steps of a name, made where missing.
ModulePtr made_submodule(ModulePtr node, const std::vector<std::string>& steps, size_t n, const std::string& path) {
  for (size_t i = 0; i < n; ++i) {
    ModulePtr next = child_of(node, steps[i]);
    if (!next) {
      if (unwrap(node)->named_parameters(false).find(steps[i]) || unwrap(node)->named_buffers(false).find(steps[i])) {
        usage("'" + steps[i] + "' in '" + path + "' is a tensor and a module");
      }
      next = unwrap(node)->register_module(steps[i], std::make_shared<torch::nn::Module>("tdist::c::Module"));
    }
    node = std::move(next);
  }
  return node;
}
}  // namespace

void add_tensors(Model& model, const char* const* ns, const tdist_tensor* ts, size_t n, bool buffers) {
  const auto keys = names(ns, n, "names");
  const auto values = tensors(ts, n, buffers ? "buffer" : "parameter");
  for (size_t i = 0; i < n; ++i) {
    const auto steps = split_path(keys[i]);
    if (steps.empty()) usage("names[" + std::to_string(i) + "] is empty");
    ModulePtr owner = made_submodule(model.root, steps, steps.size() - 1, keys[i]);
    const std::string& leaf = steps.back();
    if (child_of(owner, leaf)) usage("'" + keys[i] + "' is a module and a tensor");
    if (owner->named_parameters(false).find(leaf) || owner->named_buffers(false).find(leaf)) {
      usage("'" + keys[i] + "' is given twice (names[" + std::to_string(i) + "])");
    }
    if (!buffers && !values[i].is_leaf()) {
      usage("parameter '" + keys[i] + "' is not a leaf tensor (the result of an op): give the tensor the optimizer "
            "steps (made with requires_grad, or detached)");
    }
    if (buffers) {
      owner->register_buffer(steps.back(), values[i]);
    } else {
      owner->register_parameter(steps.back(), values[i], values[i].requires_grad());
    }
  }
}

Model& model_of(tdist_module* m) { return *live(m, "module")->model; }

void require_unwrapped(const Model& model, const char* what) {
  if (model.top != model.root) usage(std::string("the module is wrapped already (") + what + " takes a plain one)");
}

}  // namespace tdist::c
