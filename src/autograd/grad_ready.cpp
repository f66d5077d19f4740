// GradReadyTracker: the accumulator post hook, the end-of-backward callback
// and the graph walk. The contract is in grad_ready.h.
#include "autograd/grad_ready.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_set>

namespace tdist::detail {

namespace {

struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(std::weak_ptr<GradReadyListener> l, size_t i) : listener(std::move(l)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto l = listener.lock()) l->on_grad_ready(index);
    return outputs;
  }
  std::weak_ptr<GradReadyListener> listener;
  size_t index;
};

struct BeforeHook : torch::autograd::FunctionPreHook {
  BeforeHook(std::weak_ptr<GradReadyListener> l, size_t i) : listener(std::move(l)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto l = listener.lock()) l->before_grad_accumulates(index);
    return grads;
  }
  std::weak_ptr<GradReadyListener> listener;
  size_t index;
};

}  // namespace

GradReadyTracker::GradReadyTracker(const std::vector<at::Tensor>& params, std::weak_ptr<GradReadyListener> listener,
                                   bool with_pre_hooks)
    : listener_(std::move(listener)), arrived_(params.size(), 0) {
  // Hooks after each parameter's gradient accumulation. Autograd holds its
  // accumulators weakly: keep them, or the hooks never fire.
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    acc->add_post_hook(std::make_unique<ReadyHook>(listener_, i));
    if (with_pre_hooks) acc->add_pre_hook(std::make_unique<BeforeHook>(listener_, i));
    accumulators_.push_back(std::move(acc));
  }
}

void GradReadyTracker::arm_end_of_backward() {
  if (armed_) return;
  armed_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([weak = listener_] {
    if (auto l = weak.lock()) l->on_backward_end();
  });
}

void GradReadyTracker::reset() {
  std::fill(arrived_.begin(), arrived_.end(), 0);
  armed_ = false;
}

std::vector<size_t> GradReadyTracker::unreachable_from(const std::vector<at::Tensor>& outputs) const {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    const auto edge = torch::autograd::impl::gradient_edge(t);
    if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& e : node->next_edges()) {
      if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
    }
  }
  std::vector<size_t> out;
  for (size_t k = 0; k < accumulators_.size(); ++k) {
    if (!seen.count(accumulators_[k].get())) out.push_back(k);
  }
  return out;
}

}  // namespace tdist::detail
