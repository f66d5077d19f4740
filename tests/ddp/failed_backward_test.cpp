// A backward that fails part-way (a communication hook or the model's own
// backward throws) fails that backward only: the next iteration reduces as
// usual and nothing is reported at the next forward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/ddp.h"
#include "tests/util/world.h"

using tdist::ProcessGroup;
using tdist::test::run_world;

namespace {

struct TwoLayersImpl : torch::nn::Module {
  TwoLayersImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::tanh(fc1->forward(x));
    // Runs in backward after fc2's gradients have reached DDP.
    if (fail_in_backward) h.register_hook([](torch::Tensor) -> torch::Tensor { throw std::runtime_error("boom"); });
    return fc2->forward(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  bool fail_in_backward = false;
};
TORCH_MODULE(TwoLayers);

// Whether every gradient is the same on every rank (each rank's data
// differ, so only reduced gradients are).
bool reduced(ProcessGroup& pg, TwoLayers& net) {
  for (const auto& p : net->parameters()) {
    auto top = p.grad().clone();
    pg.all_reduce(top, {tdist::ReduceOp::MAX})->wait();
    if (!torch::equal(top, p.grad())) return false;
  }
  return true;
}

void step(tdist::DistributedDataParallel<TwoLayers>& ddp, ProcessGroup& pg, int i) {
  torch::manual_seed(100 * i + pg.rank());
  for (auto& p : ddp->parameters()) p.mutable_grad().reset();
  ddp->forward(torch::randn({4, 6})).sum().backward();
}

void expect_recovery(ProcessGroup& pg, tdist::DistributedDataParallel<TwoLayers>& ddp, TwoLayers& net) {
  for (int i = 1; i <= 3; ++i) {
    step(ddp, pg, i);  // a UsageError here would be a leftover of the failed backward
    WORLD_CHECK(reduced(pg, net), "iteration " << i << " after the failed backward was not reduced");
  }
}

TEST(DdpFailedBackward, AHookThatThrowsFailsOnlyItsBackward) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    TwoLayers net;
    tdist::DistributedDataParallel<TwoLayers> ddp(net);
    auto calls = std::make_shared<int>(0);
    auto group = tdist::default_group();
    ddp->register_comm_hook([calls, group](tdist::GradBucket& b) {
      if ((*calls)++ == 0) throw std::runtime_error("hook failed");
      return tdist::allreduce_hook(group, b);
    });
    bool failed = false;
    try {
      step(ddp, pg, 0);
    } catch (const std::exception& e) {
      failed = std::string(e.what()).find("hook failed") != std::string::npos;
    }
    WORLD_CHECK(failed, "the hook's exception did not fail backward");
    expect_recovery(pg, ddp, net);
  }), "");
}

TEST(DdpFailedBackward, AModelWhoseBackwardThrowsFailsOnlyThatBackward) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    TwoLayers net;
    tdist::DistributedDataParallelOptions o;
    o.bucket_cap_mb = o.first_bucket_cap_mb = 0.0001;  // a bucket per parameter: fc2's launch before the throw
    tdist::DistributedDataParallel<TwoLayers> ddp(net, o);
    net->fail_in_backward = true;
    bool failed = false;
    try {
      step(ddp, pg, 0);
    } catch (const std::exception& e) {
      failed = std::string(e.what()).find("boom") != std::string::npos;
    }
    WORLD_CHECK(failed, "the model's exception did not fail backward");
    net->fail_in_backward = false;
    expect_recovery(pg, ddp, net);
  }), "");
}

}  // namespace
