// What an FSDP unit's backward waits for. Without sharding (NO_SHARD) a
// unit's gradients accumulate in autograd's own tensors and are all-reduced
// in them, so a block's backward runs while the block after it is still
// being reduced; a sharded unit takes its gradient buffer only after the
// reduction in flight returned its own to the pool (coordinator.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "tests/fsdp/models.h"
#include "tests/util/world.h"

using tdist::ProcessGroup;
using tdist::ShardingStrategy;
using tdist::test::Net;
using tdist::test::run_world;
using Clock = std::chrono::steady_clock;

namespace {

// Rank 1 holds back its part of block 2's reduction for `hold`; returns
// how long after the backward began rank 0 computed block 1's first-layer
// weight gradient (after block 1's second layer's gradients accumulated).
double ms_to_block1_on_rank0(ProcessGroup& pg, ShardingStrategy strategy, std::chrono::milliseconds hold) {
  torch::manual_seed(3);
  tdist::FullyShardedDataParallelOptions o;
  o.sharding_strategy = strategy;
  tdist::FSDP<Net> model(Net(&o), o);
  tdist::test::NetImpl& net = *model->module();
  auto block = [&](int i) { return net.named_children()["block" + std::to_string(i)]; };
  torch::Tensor block2_w, block1_w;
  for (const auto& p : block(2)->named_parameters()) {
    if (p.key().find("fc2.weight") != std::string::npos) block2_w = p.value();
  }
  for (const auto& p : block(1)->named_parameters()) {
    if (p.key().find("fc1.weight") != std::string::npos) block1_w = p.value();
  }
  EXPECT_TRUE(block2_w.defined() && block1_w.defined());
  Clock::time_point start, reached;
  if (pg.rank() == 1) {
    block2_w.register_hook([hold](const torch::Tensor&) { std::this_thread::sleep_for(hold); });
  } else {
    block1_w.register_hook([&reached](const torch::Tensor&) { reached = Clock::now(); });
  }
  const torch::Tensor x = torch::randn({4, 6}), y = torch::randn({4, 3});
  torch::Tensor loss = torch::mse_loss(model(x), y);
  start = Clock::now();
  loss.backward();
  return std::chrono::duration<double, std::milli>(reached - start).count();
}

TEST(FsdpOverlap, WithoutShardingABlocksBackwardRunsWhileTheBlockAfterItIsReduced) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    const double ms = ms_to_block1_on_rank0(pg, ShardingStrategy::NO_SHARD, std::chrono::milliseconds(1500));
    if (pg.rank() == 0) WORLD_CHECK(ms < 750, "block 1's backward waited " << ms << " ms for block 2's reduction");
  }), "");
}

TEST(FsdpOverlap, ShardedABlockTakesItsGradientBufferOnlyAfterTheReductionInFlight) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    const double ms = ms_to_block1_on_rank0(pg, ShardingStrategy::FULL_SHARD, std::chrono::milliseconds(1500));
    if (pg.rank() == 0) {
      WORLD_CHECK(ms >= 1000, "block 1's backward ran after " << ms << " ms, before block 2's reduction ended");
    }
  }), "");
}

}  // namespace
