// A binding's own C layer, in miniature (tests/c/binding_ops.h), and the
// C++ API's run of the same training for the C and Rust tests to match.
#include "binding_ops.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cstdio>
#include <exception>
#include <string>

#include "tdist/tdist.h"

namespace {

at::Tensor& T(tt_tensor t) { return *static_cast<at::Tensor*>(t); }

template <typename Fn>
tt_tensor make(const char* what, Fn&& fn) {
  try {
    return new at::Tensor(fn());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", what, e.what());
    return nullptr;
  }
}

template <typename Fn>
int run(const char* what, Fn&& fn) {
  try {
    fn();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", what, e.what());
    return 1;
  }
}

at::Tensor seeded(at::IntArrayRef shape, uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::randn(shape, g, at::TensorOptions().dtype(at::kFloat));
}

// fc1 = Linear(8, 16), tanh, fc2 = Linear(16, 4): the layers given (FSDP
// wraps them) or plain ones.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(torch::nn::AnyModule a, torch::nn::AnyModule b)
      : fc1(std::move(a)), fc2(std::move(b)) {
    register_module("fc1", fc1.ptr());
    register_module("fc2", fc2.ptr());
  }
  at::Tensor forward(const at::Tensor& x) { return fc2.forward(torch::tanh(fc1.forward(x))); }
  torch::nn::AnyModule fc1, fc2;
};
TORCH_MODULE(Net);

torch::nn::Linear layer(int64_t in, int64_t out, tt_tensor w, tt_tensor b) {
  torch::nn::Linear l(in, out);
  torch::NoGradGuard g;
  l->weight.copy_(T(w));
  l->bias.copy_(T(b));
  return l;
}

void free_all(tt_tensor* ts, size_t n) {
  for (size_t i = 0; i < n; ++i) tt_free(ts[i]);
}

// One step of the reference: forward, backward, and (step) SGD's step.
template <typename Model>
void train_step(Model& model, torch::optim::SGD& opt, int rank, int s, bool step) {
  tt_tensor x = nullptr, y = nullptr;
  if (tt_step_batch(rank, s, &x, &y) != 0) throw std::runtime_error("tt_step_batch");
  at::Tensor loss = torch::mse_loss(model->forward(T(x)).to(at::kFloat), T(y));
  tt_free(x);
  tt_free(y);
  loss.backward();
  if (step) {
    opt.step();
    opt.zero_grad();
  }
}

void reference(const std::string& mode, int steps, double lr, tt_tensor out[TT_NPARAMS]) {
  const int rank = tdist::default_group()->rank();
  tt_tensor init[TT_NPARAMS];
  if (tt_init_params(rank, init) != 0) throw std::runtime_error("tt_init_params");
  auto fc1 = layer(8, 16, init[0], init[1]);
  auto fc2 = layer(16, 4, init[2], init[3]);
  free_all(init, TT_NPARAMS);
  tdist::StateDict full;
  if (mode.rfind("ddp", 0) == 0) {
    tdist::DistributedDataParallelOptions dopt;
    if (mode == "ddp-unused-view") {
      dopt.find_unused_parameters = true;
      dopt.gradient_as_bucket_view = true;
    }
    tdist::DistributedDataParallel<Net> ddp{Net(torch::nn::AnyModule(fc1), torch::nn::AnyModule(fc2)), dopt};
    torch::optim::SGD opt(ddp->parameters(), lr);
    if (mode == "ddp" || mode == "ddp-unused-view") {
      for (int s = 0; s < steps; ++s) train_step(ddp, opt, rank, s, true);
    } else if (mode == "ddp-powersgd") {
      tdist::PowerSGDOptions po;
      po.matrix_approximation_rank = 1;
      po.start_powerSGD_iter = 2;
      ddp->register_comm_hook(std::make_shared<tdist::PowerSGDState>(tdist::default_group(), po),
                              tdist::powerSGD_hook);
      for (int s = 0; s < steps; ++s) train_step(ddp, opt, rank, s, true);
    } else if (mode == "ddp-fp16-nosync") {
      ddp->register_comm_hook(tdist::default_group(), tdist::fp16_compress_hook);
      for (int s = 0; s < steps; ++s) {
        if (s % 2 == 0) {
          auto guard = ddp->no_sync();
          train_step(ddp, opt, rank, s, false);
        } else {
          train_step(ddp, opt, rank, s, true);
        }
      }
    } else if (mode == "ddp-join") {
      tdist::Join join({ddp.get()});
      for (int s = 0; s < steps + rank; ++s) train_step(ddp, opt, rank, s, true);
      join.join();
    } else {
      throw std::runtime_error("unknown mode " + mode);
    }
    for (const auto& p : ddp->module()->named_parameters()) full.insert(p.key(), p.value().detach().clone());
  } else {
    tdist::FullyShardedDataParallelOptions o;
    if (mode == "fsdp-zero2-bf16") {
      o.sharding_strategy = tdist::ShardingStrategy::SHARD_GRAD_OP;
      o.mixed_precision.param_dtype = at::kBFloat16;
    } else if (mode == "fsdp-hybrid") {  // every rank its own shard group, replicated over all
      o.sharding_strategy = tdist::ShardingStrategy::HYBRID_SHARD;
      for (int r = 0; r < tdist::default_group()->size(); ++r) o.sharding_groups.push_back({r});
    } else if (mode != "fsdp" && mode != "fsdp-join" && mode != "fsdp-tensors") {
      throw std::runtime_error("unknown mode " + mode);
    }
    tdist::FSDP<Net> model(Net(torch::nn::AnyModule(tdist::FSDP<torch::nn::Linear>(fc1, o)),
                               torch::nn::AnyModule(tdist::FSDP<torch::nn::Linear>(fc2, o))),
                           o);
    torch::optim::SGD opt(model->parameters(), lr);
    if (mode == "fsdp-join") {
      // Rank r has steps + r batches; a joined rank's step runs on step 0's batch.
      model->set_join_step([&] { train_step(model, opt, rank, 0, true); });
      tdist::Join join({model.get()});
      for (int s = 0; s < steps + rank; ++s) train_step(model, opt, rank, s, true);
      join.join();
    } else {
      for (int s = 0; s < steps; ++s) train_step(model, opt, rank, s, true);
    }
    full = tdist::full_state_dict(*model, /*rank0_only=*/false);
  }
  for (int i = 0; i < TT_NPARAMS; ++i) out[i] = new at::Tensor(full[tt_names[i]]);
}

}  // namespace

extern "C" {

const char* const tt_names[TT_NPARAMS] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

tt_tensor tt_param(int64_t rows, int64_t cols, uint64_t seed) {
  return make("tt_param", [&] {
    at::Tensor t = cols > 0 ? seeded({rows, cols}, seed) : seeded({rows}, seed);
    return t.mul_(0.3).requires_grad_(true);
  });
}

tt_tensor tt_batch(int64_t rows, int64_t cols, uint64_t seed) {
  return make("tt_batch", [&] { return seeded({rows, cols}, seed); });
}

tt_tensor tt_linear(tt_tensor x, tt_tensor w, tt_tensor b) {
  return make("tt_linear", [&] { return at::linear(T(x), T(w), T(b)); });
}

tt_tensor tt_tanh(tt_tensor x) {
  return make("tt_tanh", [&] { return at::tanh(T(x)); });
}

tt_tensor tt_mse(tt_tensor y, tt_tensor target) {
  return make("tt_mse", [&] { return torch::mse_loss(T(y).to(T(target).scalar_type()), T(target)); });
}

int tt_backward(tt_tensor loss) {
  return run("tt_backward", [&] { T(loss).backward(); });
}

int tt_sgd_step(const tt_tensor* params, size_t n, double lr) {
  return run("tt_sgd_step", [&] {
    torch::NoGradGuard g;
    for (size_t i = 0; i < n; ++i) {
      at::Tensor& p = T(params[i]);
      if (p.grad().defined()) p.add_(p.grad(), -lr);
      p.mutable_grad().reset();
    }
  });
}

int tt_equal(tt_tensor a, tt_tensor b) {
  const at::Tensor& x = T(a);
  const at::Tensor& y = T(b);
  return x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() && at::equal(x, y) ? 1 : 0;
}

void tt_free(tt_tensor t) { delete static_cast<at::Tensor*>(t); }

int tt_init_params(int rank, tt_tensor out[TT_NPARAMS]) {
  const uint64_t base = 1000 + 10 * static_cast<uint64_t>(rank);
  out[0] = tt_param(16, 8, base);
  out[1] = tt_param(16, 0, base + 1);
  out[2] = tt_param(4, 16, base + 2);
  out[3] = tt_param(4, 0, base + 3);
  return out[0] && out[1] && out[2] && out[3] ? 0 : 1;
}

int tt_step_batch(int rank, int step, tt_tensor* x, tt_tensor* target) {
  const uint64_t seed = 100000 + 1000 * static_cast<uint64_t>(step) + 2 * static_cast<uint64_t>(rank);
  *x = tt_batch(4, 8, seed);
  *target = tt_batch(4, 4, seed + 1);
  return *x && *target ? 0 : 1;
}

int tt_reference(const char* mode, int steps, double lr, tt_tensor out[TT_NPARAMS]) {
  return run("tt_reference", [&] { reference(mode, steps, lr, out); });
}

}  // extern "C"
