// checkpoint_module: the gradients of the plain module bit for bit (dropout
// included), the random-number stream left as the plain module leaves it,
// skipped when no input
// requires a gradient, and the same inside DDP and FSDP (real processes).
// (The bytes it saves are for tdist-bench fsdp to measure: issue 16.)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/tdist.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::test::run_world;

struct DeepImpl : torch::nn::Module {
  explicit DeepImpl(int64_t width = 16, int layers = 4, double dropout = 0.3) {
    for (int i = 0; i < layers; ++i) {
      fcs.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, width)));
    }
    drop = register_module("drop", torch::nn::Dropout(dropout));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& fc : fcs) x = drop(torch::gelu(fc(x)));
    return x;
  }
  std::vector<torch::nn::Linear> fcs;
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Deep);

// Two outputs, a non-tensor argument.
struct TwoImpl : torch::nn::Module {
  TwoImpl() { fc = register_module("fc", torch::nn::Linear(8, 8)); }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, double scale) {
    auto h = torch::dropout(fc(x), 0.5, is_training());
    return {h * scale, torch::tanh(h).sum(1)};
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Two);

void copy_params(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto a = from.parameters();
  auto b = to.parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
}

void expect_same_grads(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters();
  auto pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].grad().defined()) << i;
    ASSERT_TRUE(pb[i].grad().defined()) << i;
    EXPECT_TRUE(torch::equal(pa[i].grad(), pb[i].grad())) << "parameter " << i;
  }
}

TEST(Checkpoint, GradientsBitForBitWithDropout) {
  torch::manual_seed(1);
  Deep plain;
  auto ckpt = tdist::checkpoint_module(Deep());
  copy_params(*plain, *ckpt);
  torch::Tensor grads[2];
  torch::Tensor next[2];
  torch::Tensor out[2];
  for (int run = 0; run < 2; ++run) {
    torch::manual_seed(5);
    auto x = torch::randn({6, 16}, torch::requires_grad());
    auto y = run == 0 ? plain(x) : ckpt(x);
    if (run == 1) {
      EXPECT_NE(y.grad_fn()->name().find("CheckpointFunction"), std::string::npos) << y.grad_fn()->name();
    }
    (y * y).sum().backward();
    grads[run] = x.grad();
    out[run] = y.detach();
    next[run] = torch::rand({4});  // the stream after forward and backward
  }
  EXPECT_TRUE(torch::equal(out[0], out[1]));
  EXPECT_TRUE(torch::equal(grads[0], grads[1]));
  EXPECT_TRUE(torch::equal(next[0], next[1]));
  expect_same_grads(*plain, *ckpt);
}

TEST(Checkpoint, TupleOutputsAndNonTensorArguments) {
  torch::manual_seed(2);
  Two plain;
  auto ckpt = tdist::checkpoint_module(Two());
  copy_params(*plain, *ckpt);
  torch::Tensor xg[2];
  for (int run = 0; run < 2; ++run) {
    torch::manual_seed(9);
    auto x = torch::randn({3, 8}, torch::requires_grad());
    auto [a, b] = run == 0 ? plain(x, 2.5) : ckpt(x, 2.5);
    (a.sum() + (b * b).sum()).backward();
    xg[run] = x.grad();
  }
  EXPECT_TRUE(torch::equal(xg[0], xg[1]));
  expect_same_grads(*plain, *ckpt);
}

TEST(Checkpoint, SkippedWhenNoInputRequiresGrad) {
  torch::manual_seed(3);
  Deep plain(16, 2, 0.0);
  auto ckpt = tdist::checkpoint_module(Deep(16, 2, 0.0));
  copy_params(*plain, *ckpt);
  auto x = torch::randn({5, 16});  // no gradient: the first layer's input
  auto y = ckpt(x);
  EXPECT_EQ(y.grad_fn()->name().find("CheckpointFunction"), std::string::npos);
  y.sum().backward();
  plain(x).sum().backward();
  expect_same_grads(*plain, *ckpt);  // the parameters still get their gradients
  torch::NoGradGuard no_grad;        // and without gradients it simply runs
  EXPECT_TRUE(torch::equal(ckpt(x), plain(x)));
}

// ---- inside DDP and FSDP, on real processes ----

struct StackImpl : torch::nn::Module {
  // checkpoint: the middle blocks in checkpoint_module; fsdp: each of them
  // (checkpointed or not) in a FSDP unit of its own.
  StackImpl(bool checkpoint, const tdist::FullyShardedDataParallelOptions* fsdp) {
    in = register_module("in", torch::nn::Linear(6, 16));
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int i = 0; i < 3; ++i) {
      if (checkpoint && fsdp) {
        blocks->push_back(tdist::FullyShardedDataParallel(tdist::checkpoint_module(Deep(16, 2, 0.2)), *fsdp));
      } else if (checkpoint) {
        blocks->push_back(tdist::checkpoint_module(Deep(16, 2, 0.2)));
      } else if (fsdp) {
        blocks->push_back(tdist::FSDP<Deep>(Deep(16, 2, 0.2), *fsdp));
      } else {
        blocks->push_back(Deep(16, 2, 0.2));
      }
    }
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return head(blocks->forward(in(x))); }
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::Sequential blocks{nullptr};
};
TORCH_MODULE(Stack);

// Three steps of SGD on this rank's rows; the parameters after them (whole).
std::vector<torch::Tensor> train(ProcessGroup& pg, bool checkpoint, bool fsdp) {
  torch::manual_seed(11);
  tdist::FullyShardedDataParallelOptions o;
  std::vector<torch::Tensor> params;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::shared_ptr<void> keep;
  std::function<std::vector<torch::Tensor>()> whole;
  if (fsdp) {
    auto m = std::make_shared<tdist::FSDP<Stack>>(Stack(checkpoint, &o), o);
    forward = [m](const torch::Tensor& x) { return (*m)(x); };
    params = (*m)->parameters();
    whole = [m] {
      auto g = (*m)->summon_full_params(false);
      std::vector<torch::Tensor> out;
      for (const auto& p : (*m)->parameters()) out.push_back(p.detach().clone());
      return out;
    };
    keep = m;
  } else {
    auto m = std::make_shared<tdist::DistributedDataParallel<Stack>>(Stack(checkpoint, nullptr));
    forward = [m](const torch::Tensor& x) { return (*m)(x); };
    params = (*m)->parameters();
    whole = [params] {
      std::vector<torch::Tensor> out;
      for (const auto& p : params) out.push_back(p.detach().clone());
      return out;
    };
    keep = m;
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(100 + step);
    auto x = torch::randn({4 * pg.size(), 6}).narrow(0, 4 * pg.rank(), 4);
    auto y = torch::randn({4 * pg.size(), 3}).narrow(0, 4 * pg.rank(), 4);
    torch::manual_seed(200 + 10 * step + pg.rank());  // dropout differs by rank, not by variant
    for (auto& p : params) p.mutable_grad().reset();
    torch::mse_loss(forward(x), y).backward();
    opt.step();
  }
  return whole();
}

void same_as_plain(ProcessGroup& pg, bool fsdp) {
  const auto plain = train(pg, false, fsdp);
  const auto ckpt = train(pg, true, fsdp);
  WORLD_CHECK(plain.size() == ckpt.size(), plain.size() << " vs " << ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    WORLD_CHECK(torch::equal(plain[i], ckpt[i]), "parameter " << i << " differs by "
                                                               << (plain[i] - ckpt[i]).abs().max().item<double>());
  }
}

TEST(Checkpoint, InsideDdpSameWeightsAsPlain) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) { same_as_plain(pg, false); }), "");
}

TEST(Checkpoint, InsideFsdpUnitsSameWeightsAsPlain) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) { same_as_plain(pg, true); }), "");
}

// Units nested inside the checkpointed module join the iteration in the
// first run and gather for backward in the second.
TEST(Checkpoint, AroundAModuleWithUnitsInside) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup& pg) {
                        torch::manual_seed(11);
                        tdist::FullyShardedDataParallelOptions o;
                        tdist::FSDP<Stack> plain(Stack(false, &o), o);
                        torch::manual_seed(11);
                        tdist::FSDP<tdist::CheckpointModule<Stack>> ckpt(
                            tdist::checkpoint_module(Stack(false, &o)), o);
                        for (int step = 0; step < 2; ++step) {
                          torch::manual_seed(100 + step);
                          auto x = torch::randn({4, 6}, torch::requires_grad());
                          torch::manual_seed(300 + pg.rank());
                          plain(x).pow(2).sum().backward();
                          torch::manual_seed(100 + step);
                          auto x2 = torch::randn({4, 6}, torch::requires_grad());
                          torch::manual_seed(300 + pg.rank());
                          ckpt(x2).pow(2).sum().backward();
                          WORLD_CHECK(torch::equal(x.grad(), x2.grad()), "input gradients differ");
                          auto a = plain->parameters();
                          auto b = ckpt->parameters();
                          WORLD_CHECK(a.size() == b.size(), a.size() << " vs " << b.size());
                          for (size_t i = 0; i < a.size(); ++i) {
                            WORLD_CHECK(torch::equal(a[i].grad(), b[i].grad()), "gradient " << i);
                            a[i].mutable_grad().reset();
                            b[i].mutable_grad().reset();
                          }
                        }
                      }),
            "");
}

TEST(Checkpoint, AroundTheOutermostFsdpWrapperIsRefused) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup&) {
                        tdist::FullyShardedDataParallelOptions o;
                        auto m = tdist::checkpoint_module(tdist::FSDP<Deep>(Deep(16, 2, 0.0), o));
                        auto x = torch::randn({2, 16}, torch::requires_grad());
                        try {
                          m(x).sum().backward();
                        } catch (const std::exception& e) {
                          WORLD_CHECK(std::string(e.what()).find("FSDP(checkpoint_module(m))") != std::string::npos,
                                      e.what());
                          return;
                        }
                        WORLD_CHECK(false, "no error");
                      }),
            "");
}

}  // namespace
