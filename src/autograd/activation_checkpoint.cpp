// checkpoint_module's autograd side: the node that drops the activations
// and re-runs the forward in backward. The contract is in
// include/tdist/activation_checkpoint.h.
//
// The parameters are inputs of the node, next to the tensor arguments: the
// backward computes their gradients with autograd::grad over the re-run
// (which accumulates nothing) and returns them, so that they reach the
// parameters' accumulators in the outer backward. A nested backward() that
// accumulated them itself would run DDP's and FSDP's gradient hooks inside
// a graph task of its own, whose end is not the end of the real backward.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/core/ivalue.h>

#include <mutex>

#include "autograd/recompute_phase.h"
#include "tdist/activation_checkpoint.h"
#include "tdist/errors.h"

namespace tdist::detail {

namespace {

thread_local RecomputePhase t_phase = RecomputePhase::kNone;

// The random-number state of every device the inputs live on (CPU always).
struct RngStates {
  std::vector<at::Generator> gens;
  std::vector<at::Tensor> states;

  static RngStates capture(const std::vector<at::Tensor>& inputs) {
    RngStates r;
    r.add(at::detail::getDefaultCPUGenerator());
    for (const auto& t : inputs) {
      if (t.device().is_cpu()) continue;
      at::Generator g = at::globalContext().defaultGenerator(t.device());
      bool seen = false;
      for (const auto& h : r.gens) seen = seen || h == g;
      if (!seen) r.add(g);
    }
    return r;
  }
  void add(at::Generator g) {
    std::lock_guard<std::mutex> lock(g.mutex());
    states.push_back(g.get_state());
    gens.push_back(std::move(g));
  }
  // Puts these states in place; returns the ones they replace.
  RngStates swap_in() const {
    RngStates before;
    for (size_t i = 0; i < gens.size(); ++i) {
      at::Generator g = gens[i];
      std::lock_guard<std::mutex> lock(g.mutex());
      before.states.push_back(g.get_state());
      before.gens.push_back(g);
      g.set_state(states[i]);
    }
    return before;
  }
};

// What the node keeps besides the saved inputs.
struct Recompute : torch::CustomClassHolder {
  CheckpointRun run;
  RngStates rng;
  std::vector<at::Tensor> params;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<Recompute> rc, at::TensorList inputs,
                                                at::TensorList params) {
    (void)params;  // inputs of the node, for their gradient edges; the module reads them
    ctx->save_for_backward(inputs.vec());
    std::vector<at::Tensor> outputs;
    {
      RecomputePhaseGuard phase(RecomputePhase::kForward);
      outputs = rc->run(inputs.vec());
    }
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(rc);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto rc = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (const auto& x : saved) inputs.push_back(x.detach().requires_grad_(x.requires_grad()));
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode grad_on(true);
      RecomputePhaseGuard phase(RecomputePhase::kRecompute);
      const RngStates after = rc->rng.swap_in();
      try {
        outputs = rc->run(inputs);
      } catch (...) {
        after.swap_in();
        throw;
      }
      after.swap_in();
    }
    if (outputs.size() != grads.size()) {
      throw UsageError("checkpoint_module: the forward returned " + std::to_string(grads.size()) +
                       " tensors and, run again in backward, " + std::to_string(outputs.size()));
    }
    std::vector<at::Tensor> roots;
    std::vector<at::Tensor> root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!grads[i].defined() || !outputs[i].defined() || !outputs[i].requires_grad()) continue;
      roots.push_back(outputs[i]);
      root_grads.push_back(grads[i]);
    }
    std::vector<at::Tensor> wrt;
    for (const auto& x : inputs) {
      if (x.requires_grad()) wrt.push_back(x);
    }
    for (const auto& p : rc->params) wrt.push_back(p);
    std::vector<at::Tensor> found;
    if (!roots.empty() && !wrt.empty()) {
      found = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
    } else {
      found.resize(wrt.size());
    }
    // One gradient per input of forward: the Recompute (none), each tensor
    // argument, each parameter.
    torch::autograd::variable_list out;
    out.emplace_back();
    size_t next = 0;
    for (const auto& x : inputs) out.push_back(x.requires_grad() ? found[next++] : at::Tensor());
    for (size_t i = 0; i < rc->params.size(); ++i) out.push_back(found[next++]);
    return out;
  }
};

}  // namespace

RecomputePhase recompute_phase() { return t_phase; }

RecomputePhaseGuard::RecomputePhaseGuard(RecomputePhase phase) : previous_(t_phase) { t_phase = phase; }
RecomputePhaseGuard::~RecomputePhaseGuard() { t_phase = previous_; }

bool checkpoint_wanted(const std::vector<at::Tensor>& inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const auto& t : inputs) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

std::vector<at::Tensor> trainable_parameters(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

std::vector<at::Tensor> checkpoint_apply(CheckpointRun run, const std::vector<at::Tensor>& inputs,
                                         const std::vector<at::Tensor>& params) {
  auto rc = c10::make_intrusive<Recompute>();
  rc->run = std::move(run);
  rc->rng = RngStates::capture(inputs);
  rc->params = params;
  return CheckpointFunction::apply(rc, at::TensorList(inputs), at::TensorList(params));
}

}  // namespace tdist::detail
