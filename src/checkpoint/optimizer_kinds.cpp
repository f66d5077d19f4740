// The optimizer kinds: one table each of state tensors and options. The
// contract is in optimizer_kinds.h.
#include "checkpoint/optimizer_kinds.h"

#include <ATen/ATen.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "tdist/errors.h"

namespace tdist::checkpoint {

namespace {

template <typename Opt, typename Options, typename State>
class Kind final : public OptimizerKind {
 public:
  struct TensorField {
    const char* name;
    bool optional;  // left out while undefined
    at::Tensor& (*get)(State&);
  };
  struct Option {
    const char* name;
    double (*get)(const Options&);
    void (*set)(Options&, double);
  };
  Kind(const char* name, bool has_step, std::vector<TensorField> tensors, std::vector<Option> options)
      : name_(name), has_step_(has_step), tensors_(std::move(tensors)), options_(std::move(options)) {}

  const char* name() const override { return name_; }
  bool matches(const torch::optim::Optimizer& opt) const { return dynamic_cast<const Opt*>(&opt) != nullptr; }

  StateDict read_state(const torch::optim::OptimizerParamState& s) const override {
    auto& st = const_cast<State&>(dynamic_cast<const State&>(s));
    StateDict out;
    if constexpr (kHasStep) {
      if (has_step_) out.insert("step", at::scalar_tensor(st.step(), at::kLong));
    }
    for (const auto& f : tensors_) {
      const at::Tensor& t = f.get(st);
      if (t.defined()) out.insert(f.name, t);
    }
    return out;
  }

  std::unique_ptr<torch::optim::OptimizerParamState> make_state(const StateDict& fields, const std::string& name,
                                                                const at::Tensor& param, bool adopt) const override {
    auto st = std::make_unique<State>();
    for (const auto& f : fields) {
      const bool known = (f.key() == "step" && kHasStep && has_step_) ||
                         std::any_of(tensors_.begin(), tensors_.end(),
                                     [&](const TensorField& t) { return f.key() == t.name; });
      if (!known) {
        throw CheckpointError("optimizer state of '" + name + "': a field '" + f.key() + "' that " + name_ +
                              " does not have");
      }
      if (f.key() != "step" && f.value().defined() && !at::isFloatingType(f.value().scalar_type())) {
        throw CheckpointError("optimizer state of '" + name + "': its " + f.key() + " is a " +
                              c10::toString(f.value().scalar_type()) + " tensor, not floating point");
      }
    }
    if constexpr (kHasStep) {
      if (has_step_) {
        const at::Tensor* step = fields.find("step");
        if (!step || !step->defined() || step->numel() != 1) {
          throw CheckpointError("optimizer state of '" + name + "': no step");
        }
        const at::ScalarType t = step->scalar_type();
        if (!at::isIntegralType(t, /*includeBool=*/false) && !at::isFloatingType(t)) {
          throw CheckpointError("optimizer state of '" + name + "': its step is a " + c10::toString(t) + " tensor");
        }
        // Whole, non-negative and exact in a double (2^53) before it becomes an int.
        const double v = step->item<double>();
        if (!(v >= 0 && v <= 9007199254740992.0) || v != std::floor(v)) {
          throw CheckpointError("optimizer state of '" + name + "': its step is " + std::to_string(v) +
                                ", not a count");
        }
        st->step(static_cast<int64_t>(v));
      }
    }
    for (const auto& f : tensors_) {
      const at::Tensor* t = fields.find(f.name);
      if (t && t->defined()) {
        if (!param.defined()) {  // a check only: nothing to place, nothing kept
          f.get(*st) = t->detach();
          continue;
        }
        const bool cast = t->is_floating_point() && param.is_floating_point();
        f.get(*st) = t->detach().to(param.device(), cast ? param.scalar_type() : t->scalar_type(),
                                    /*non_blocking=*/false, /*copy=*/!adopt);
      } else if (!f.optional) {
        throw CheckpointError("optimizer state of '" + name + "': no " + f.name + " (" + name_ + ")");
      }
    }
    return st;
  }

  std::map<std::string, double> read_options(const torch::optim::OptimizerOptions& o) const override {
    const auto& opts = dynamic_cast<const Options&>(o);
    std::map<std::string, double> out;
    for (const auto& opt : options_) out[opt.name] = opt.get(opts);
    return out;
  }

  void write_options(torch::optim::OptimizerOptions& o, const std::map<std::string, double>& values) const override {
    auto& opts = dynamic_cast<Options&>(o);
    for (const auto& opt : options_) {
      const auto it = values.find(opt.name);
      if (it != values.end()) opt.set(opts, it->second);
    }
  }

 private:
  static constexpr bool kHasStep = !std::is_same_v<State, torch::optim::SGDParamState>;
  const char* name_;
  bool has_step_;
  std::vector<TensorField> tensors_;
  std::vector<Option> options_;
};

// Adam and AdamW: the same fields and options on their own types.
template <typename Opt, typename Options, typename State>
Kind<Opt, Options, State> adam_like(const char* name) {
  using K = Kind<Opt, Options, State>;
  return K(name, true,
           {{"exp_avg", false, [](State& s) -> at::Tensor& { return s.exp_avg(); }},
            {"exp_avg_sq", false, [](State& s) -> at::Tensor& { return s.exp_avg_sq(); }},
            {"max_exp_avg_sq", true, [](State& s) -> at::Tensor& { return s.max_exp_avg_sq(); }}},
           {{"lr", [](const Options& o) { return o.lr(); }, [](Options& o, double v) { o.lr(v); }},
            {"beta1", [](const Options& o) { return std::get<0>(o.betas()); },
             [](Options& o, double v) { o.betas(std::make_tuple(v, std::get<1>(o.betas()))); }},
            {"beta2", [](const Options& o) { return std::get<1>(o.betas()); },
             [](Options& o, double v) { o.betas(std::make_tuple(std::get<0>(o.betas()), v)); }},
            {"eps", [](const Options& o) { return o.eps(); }, [](Options& o, double v) { o.eps(v); }},
            {"weight_decay", [](const Options& o) { return o.weight_decay(); },
             [](Options& o, double v) { o.weight_decay(v); }},
            {"amsgrad", [](const Options& o) { return o.amsgrad() ? 1.0 : 0.0; },
             [](Options& o, double v) { o.amsgrad(v != 0); }}});
}

using torch::optim::AdagradOptions;
using torch::optim::AdagradParamState;
using torch::optim::RMSpropOptions;
using torch::optim::RMSpropParamState;
using torch::optim::SGDOptions;
using torch::optim::SGDParamState;

const auto& adam() {
  static const auto k = adam_like<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState>("Adam");
  return k;
}
const auto& adamw() {
  static const auto k =
      adam_like<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState>("AdamW");
  return k;
}
const auto& sgd() {
  using K = Kind<torch::optim::SGD, SGDOptions, SGDParamState>;
  static const K k(
      "SGD", false, {{"momentum_buffer", true, [](SGDParamState& s) -> at::Tensor& { return s.momentum_buffer(); }}},
      {{"lr", [](const SGDOptions& o) { return o.lr(); }, [](SGDOptions& o, double v) { o.lr(v); }},
       {"momentum", [](const SGDOptions& o) { return o.momentum(); }, [](SGDOptions& o, double v) { o.momentum(v); }},
       {"dampening", [](const SGDOptions& o) { return o.dampening(); },
        [](SGDOptions& o, double v) { o.dampening(v); }},
       {"weight_decay", [](const SGDOptions& o) { return o.weight_decay(); },
        [](SGDOptions& o, double v) { o.weight_decay(v); }},
       {"nesterov", [](const SGDOptions& o) { return o.nesterov() ? 1.0 : 0.0; },
        [](SGDOptions& o, double v) { o.nesterov(v != 0); }}});
  return k;
}
const auto& rmsprop() {
  using K = Kind<torch::optim::RMSprop, RMSpropOptions, RMSpropParamState>;
  static const K k(
      "RMSprop", true,
      {{"square_avg", false, [](RMSpropParamState& s) -> at::Tensor& { return s.square_avg(); }},
       {"momentum_buffer", true, [](RMSpropParamState& s) -> at::Tensor& { return s.momentum_buffer(); }},
       {"grad_avg", true, [](RMSpropParamState& s) -> at::Tensor& { return s.grad_avg(); }}},
      {{"lr", [](const RMSpropOptions& o) { return o.lr(); }, [](RMSpropOptions& o, double v) { o.lr(v); }},
       {"alpha", [](const RMSpropOptions& o) { return o.alpha(); }, [](RMSpropOptions& o, double v) { o.alpha(v); }},
       {"eps", [](const RMSpropOptions& o) { return o.eps(); }, [](RMSpropOptions& o, double v) { o.eps(v); }},
       {"weight_decay", [](const RMSpropOptions& o) { return o.weight_decay(); },
        [](RMSpropOptions& o, double v) { o.weight_decay(v); }},
       {"momentum", [](const RMSpropOptions& o) { return o.momentum(); },
        [](RMSpropOptions& o, double v) { o.momentum(v); }},
       {"centered", [](const RMSpropOptions& o) { return o.centered() ? 1.0 : 0.0; },
        [](RMSpropOptions& o, double v) { o.centered(v != 0); }}});
  return k;
}
const auto& adagrad() {
  using K = Kind<torch::optim::Adagrad, AdagradOptions, AdagradParamState>;
  static const K k(
      "Adagrad", true, {{"sum", false, [](AdagradParamState& s) -> at::Tensor& { return s.sum(); }}},
      {{"lr", [](const AdagradOptions& o) { return o.lr(); }, [](AdagradOptions& o, double v) { o.lr(v); }},
       {"lr_decay", [](const AdagradOptions& o) { return o.lr_decay(); },
        [](AdagradOptions& o, double v) { o.lr_decay(v); }},
       {"weight_decay", [](const AdagradOptions& o) { return o.weight_decay(); },
        [](AdagradOptions& o, double v) { o.weight_decay(v); }},
       {"initial_accumulator_value", [](const AdagradOptions& o) { return o.initial_accumulator_value(); },
        [](AdagradOptions& o, double v) { o.initial_accumulator_value(v); }},
       {"eps", [](const AdagradOptions& o) { return o.eps(); }, [](AdagradOptions& o, double v) { o.eps(v); }}});
  return k;
}

}  // namespace

const OptimizerKind& kind_of(const torch::optim::Optimizer& opt) {
  if (adamw().matches(opt)) return adamw();
  if (adam().matches(opt)) return adam();
  if (sgd().matches(opt)) return sgd();
  if (rmsprop().matches(opt)) return rmsprop();
  if (adagrad().matches(opt)) return adagrad();
  throw UsageError("optimizer state dicts: this optimizer is none of Adam, AdamW, SGD, RMSprop, Adagrad");
}

}  // namespace tdist::checkpoint
