// DDP gives the same weights whether the optimizer zeroes the gradients
// between steps or drops them (sets them to undefined), in every mode of
// the reducer: buckets in symmetric memory, in ordinary memory, as views
// (gradient_as_bucket_view), every built-in hook, a user's hook, PowerSGD's
// error feedback, unused parameters, a static graph.
//
// LibTorch 2.x's Optimizer::zero_grad() drops by default, 1.13's zeroes: each
// case trains once with the default of the LibTorch this build uses and once
// with the other behaviour, and the two must end bit for bit equal.
//
// A parameter that no rank used in a step is the exception, as it is in one
// process: its zeroed gradient still moves it under momentum, a dropped one
// makes the optimizer skip it. DDP leaves such a gradient as it was (as
// PyTorch's does), so the unused-parameter cases train with plain SGD, and
// check that after dropping, exactly the parameters no rank used are left
// without a gradient.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <map>

#include "tdist/ddp.h"
#include "tdist/powersgd.h"
#include "tests/util/world.h"
#include "util/torch_compat.h"

using tdist::ProcessGroup;
using tdist::test::run_world;

namespace {

// Three layers and a head that only some steps use (for the unused-parameter
// cases): several buckets with a small cap.
struct ModelImpl : torch::nn::Module {
  ModelImpl() {
    a = register_module("a", torch::nn::Linear(12, 32));
    b = register_module("b", torch::nn::Linear(32, 32));
    c = register_module("c", torch::nn::Linear(32, 4));
    side = register_module("side", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(torch::Tensor x, bool use_side) {
    auto h = torch::tanh(b->forward(torch::relu(a->forward(x))));
    return use_side ? c->forward(h) + side->forward(h) : c->forward(h);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr}, side{nullptr};
};
TORCH_MODULE(Model);

enum class Hook { kDefault, kAllreduce, kFp16, kBf16, kNoop, kUser, kPowerSGD, kBatchedPowerSGD };

struct Case {
  std::string name;
  std::string backend = "shm";
  Hook hook = Hook::kDefault;
  bool as_view = false;
  bool find_unused = false;
  bool static_graph = false;
  bool adam = false;
  std::map<std::string, std::string> env;  // set in the ranks' environment
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

void register_hook(tdist::DistributedDataParallel<Model>& ddp, Hook hook) {
  auto world = tdist::default_group();
  switch (hook) {
    case Hook::kDefault: break;
    case Hook::kAllreduce: ddp->register_comm_hook(world, tdist::allreduce_hook); break;
    case Hook::kFp16: ddp->register_comm_hook(world, tdist::fp16_compress_hook); break;
    case Hook::kBf16: ddp->register_comm_hook(world, tdist::bf16_compress_hook); break;
    case Hook::kNoop: ddp->register_comm_hook(world, tdist::noop_hook); break;
    case Hook::kUser:  // through the GradBucket path: the hook sees the flat bucket
      ddp->register_comm_hook([world](tdist::GradBucket& bucket) {
        at::Tensor flat = bucket.buffer();
        flat.div_(world->size());
        return world->all_reduce(flat);
      });
      break;
    case Hook::kPowerSGD:
    case Hook::kBatchedPowerSGD: {
      tdist::PowerSGDOptions o;
      o.matrix_approximation_rank = 2;
      o.start_powerSGD_iter = 2;  // compressed, with error feedback, from the third step
      o.min_compression_rate = 0;
      auto state = std::make_shared<tdist::PowerSGDState>(world, o);
      ddp->register_comm_hook(state, hook == Hook::kPowerSGD ? tdist::powerSGD_hook : tdist::batched_powerSGD_hook);
      break;
    }
  }
}

// Trains 6 steps on this rank's shard; returns the weights, flattened.
torch::Tensor train(ProcessGroup& pg, const Case& c, bool set_to_none) {
  const int r = pg.rank();
  torch::manual_seed(11 + r);  // different on purpose: DDP broadcasts rank 0's
  Model net;
  tdist::DistributedDataParallelOptions o;
  o.bucket_cap_mb = 0.002;  // a few KiB: several buckets
  o.first_bucket_cap_mb = 0.002;
  o.gradient_as_bucket_view = c.as_view;
  o.find_unused_parameters = c.find_unused;
  o.static_graph = c.static_graph;
  tdist::DistributedDataParallel<Model> ddp(net, o);
  register_hook(ddp, c.hook);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (c.adam) opt = std::make_unique<torch::optim::Adam>(ddp->parameters(), torch::optim::AdamOptions(0.01));
  else opt = std::make_unique<torch::optim::SGD>(ddp->parameters(),
                                                 torch::optim::SGDOptions(0.05).momentum(c.find_unused ? 0 : 0.9));
  for (int step = 0; step < 6; ++step) {
    if (set_to_none == tdist::compat::kZeroGradSetsToNone) {
      opt->zero_grad();  // this LibTorch's default
    } else {
      tdist::compat::zero_grad(*opt, set_to_none);
    }
    for (const auto& p : net->parameters()) {
      // Undefined after dropping; after zeroing, defined (and zero) once a
      // first backward made it.
      WORLD_CHECK(!p.grad().defined() || (!set_to_none && p.grad().eq(0).all().item<bool>()),
                  c.name << " step " << step << ": zero_grad(" << set_to_none << ") left a gradient");
    }
    torch::manual_seed(500 + step * 10 + r);
    const torch::Tensor x = torch::randn({6, 12});
    // With unused parameters: rank 0 uses the side head on even steps only.
    const bool use_side = !c.find_unused || (r == 0 && step % 2 == 0);
    ddp->forward(x, use_side).pow(2).mean().backward();
    if (set_to_none) {
      const bool some_rank_used_side = !c.find_unused || step % 2 == 0;
      for (const auto& item : net->named_parameters()) {
        const std::string& name = item.key();
        const torch::Tensor& p = item.value();
        const bool used = name.rfind("side.", 0) != 0 || some_rank_used_side;
        WORLD_CHECK(p.grad().defined() == used, c.name << " step " << step << ": " << name << " has "
                                                       << (used ? "no gradient" : "a gradient no rank made"));
      }
    }
    opt->step();
  }
  std::vector<torch::Tensor> flat;
  for (const auto& p : net->parameters()) flat.push_back(p.detach().flatten());
  return torch::cat(flat);
}

class ZeroGrad : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroGrad, DroppingOrZeroingGradientsGivesTheSameWeights) {
  const Case& c = GetParam();
  for (const auto& [k, v] : c.env) setenv(k.c_str(), v.c_str(), 1);
  tdist::test::WorldOptions wo;
  wo.backend = c.backend;
  const std::string failures = run_world(2, [&c](ProcessGroup& pg) {
    const torch::Tensor zeroed = train(pg, c, /*set_to_none=*/false);
    const torch::Tensor dropped = train(pg, c, /*set_to_none=*/true);
    WORLD_CHECK(torch::equal(zeroed, dropped), c.name << ": weights differ by up to "
                                                      << (zeroed - dropped).abs().max().item<double>());
  }, wo);
  for (const auto& [k, v] : c.env) unsetenv(k.c_str());
  EXPECT_EQ(failures, "");
}

Case with(Case c, std::string name) {
  c.name = std::move(name);
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  Case plain;
  plain.name = "symmetric_slots";
  out.push_back(plain);
  Case large = with(plain, "symmetric_slots_in_place");  // tiny models reach the in-place path only so
  large.env = {{"TDIST_SHM_SMALL_BYTES", "0"}};
  out.push_back(large);
  Case view = with(plain, "bucket_view");
  view.as_view = true;
  out.push_back(view);
  Case staged = with(plain, "no_symmetric_memory");
  staged.env = {{"TDIST_SHM_SYMMETRIC", "0"}};
  out.push_back(staged);
  Case gloo = with(plain, "gloo");
  gloo.backend = "gloo";
  out.push_back(gloo);
  Case gloo_view = with(gloo, "gloo_bucket_view");
  gloo_view.as_view = true;
  out.push_back(gloo_view);
  // Every hook on each kind of bucket memory: symmetric slots (shm's
  // default), views (gradient_as_bucket_view), ordinary memory.
  for (auto [hook, name] : {std::pair{Hook::kAllreduce, "allreduce_hook"}, {Hook::kFp16, "fp16_hook"},
                            {Hook::kBf16, "bf16_hook"}, {Hook::kNoop, "noop_hook"}, {Hook::kUser, "user_hook"},
                            {Hook::kPowerSGD, "powerSGD"}, {Hook::kBatchedPowerSGD, "batched_powerSGD"}}) {
    Case h = with(plain, name);
    h.hook = hook;
    out.push_back(h);
    Case hv = with(h, std::string(name) + "_bucket_view");
    hv.as_view = true;
    out.push_back(hv);
    Case ho = with(h, std::string(name) + "_no_symmetric_memory");
    ho.env = staged.env;
    out.push_back(ho);
  }
  Case unused = with(plain, "find_unused_parameters");
  unused.find_unused = true;
  out.push_back(unused);
  Case unused_view = with(unused, "find_unused_parameters_bucket_view");
  unused_view.as_view = true;
  out.push_back(unused_view);
  Case fixed = with(plain, "static_graph");
  fixed.static_graph = true;
  out.push_back(fixed);
  Case adam = with(plain, "adam");
  adam.adam = true;
  out.push_back(adam);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Modes, ZeroGrad, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
