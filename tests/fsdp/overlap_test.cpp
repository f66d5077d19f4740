// What an FSDP unit waits for. Without sharding (NO_SHARD) a unit's
// gradients accumulate in autograd's own tensors and are all-reduced in
// them, so a block's backward runs while the block after it is still being
// reduced, and its reduction is queued behind the ones in flight; a sharded
// unit takes its gradient buffer only after the reduction in flight
// returned its own to the pool. With forward_prefetch a unit's forward
// queues the next unit's gather before it waits for its own
// (coordinator.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tdist/trace.h"
#include "tests/fsdp/models.h"
#include "tests/util/process.h"
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
double ms_to_block1_on_rank0(ProcessGroup& pg, ShardingStrategy strategy, std::chrono::milliseconds hold,
                             std::optional<at::ScalarType> reduce_dtype = std::nullopt) {
  torch::manual_seed(3);
  tdist::FullyShardedDataParallelOptions o;
  o.sharding_strategy = strategy;
  o.mixed_precision.reduce_dtype = reduce_dtype;
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

// The ops of the world group named `op` that the flight recorder holds, in
// the order they were queued: when each was queued and when it completed.
struct Recorded {
  int64_t created_ns = 0, completed_ns = 0;
};
std::vector<Recorded> recorded(const std::string& op) {
  const std::string path = tdist::trace::dump_flight_recorder();
  WORLD_CHECK(!path.empty(), "no flight recorder dump (is TDIST_DUMP_DIR set?)");
  const auto dump = nlohmann::json::parse(tdist::test::read_all(path));
  std::vector<Recorded> out;
  for (const auto& e : dump["entries"]) {
    if (e["process_group"][0] != "world" || e["profiling_name"] != "tdist:" + op) continue;
    out.push_back({e["time_created_ns"].get<int64_t>(), e["time_discovered_completed_ns"].get<int64_t>()});
  }
  return out;
}

// On rank 0, of the ops named `op` recorded after the first `before`: the
// first (which rank 1 joined 600 ms late) took 400 ms or more, and the
// second was queued while the first still ran (`while_running`), or only
// once it had completed.
void check_when_second_was_queued(ProcessGroup& pg, const std::string& op, size_t before, const std::string& first,
                                  const std::string& second, bool while_running = true) {
  const auto r = recorded(op);
  WORLD_CHECK(r.size() >= before + 2, r.size() - before << " " << op << " since");
  if (pg.rank() != 0) return;
  const Recorded& a = r[before];
  const Recorded& b = r[before + 1];
  WORLD_CHECK(a.completed_ns - a.created_ns >= 400'000'000,
              first << " took " << (a.completed_ns - a.created_ns) / 1e6 << " ms");
  const double late_ms = (b.created_ns - a.completed_ns) / 1e6;
  if (while_running) {
    WORLD_CHECK(b.created_ns < a.completed_ns - 300'000'000,
                second << " was queued " << late_ms << " ms after " << first << " completed");
  } else {
    WORLD_CHECK(b.created_ns > a.completed_ns - 100'000'000,  // the recorder's clock is coarse
                second << " was queued " << -late_ms << " ms before " << first << " completed");
  }
}

// Without sharding a unit's reduction is queued behind the one still
// running (no buffer to wait for), so the worker runs them back to back:
// rank 1 comes to block 2's reduction 600 ms late, and rank 0 has queued
// block 1's before block 2's completed.
TEST(FsdpOverlap, WithoutShardingAReductionIsQueuedBehindTheOneInFlight) {
  tdist::test::TempDir dumps;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dumps.path().c_str(), 1);
    const size_t before = recorded("all_reduce_coalesced").size();
    ms_to_block1_on_rank0(pg, ShardingStrategy::NO_SHARD, std::chrono::milliseconds(600));
    check_when_second_was_queued(pg, "all_reduce_coalesced", before, "block 2's reduction", "block 1's");
  }), "");
}

// ... unless it reduces a converted copy of them (a reduce dtype other than
// theirs): then it waits for the one in flight, so that no more than one
// such copy lives beside the gradients.
TEST(FsdpOverlap, WithoutShardingAReductionInAnotherDtypeWaitsForTheOneInFlight) {
  tdist::test::TempDir dumps;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dumps.path().c_str(), 1);
    const size_t before = recorded("all_reduce_coalesced").size();
    ms_to_block1_on_rank0(pg, ShardingStrategy::NO_SHARD, std::chrono::milliseconds(600), at::kBFloat16);
    check_when_second_was_queued(pg, "all_reduce_coalesced", before, "block 2's reduction", "block 1's",
                                 /*while_running=*/false);
  }), "");
}

// Rank 1 comes to the second forward 600 ms late, so rank 0's first gather
// of it (the root's) completes 600 ms after it was queued. With the prefetch
// block 0's gather was queued at once behind it (the worker then runs the
// two back to back), not when the root's gather had been waited for.
TEST(FsdpOverlap, AForwardPrefetchIsQueuedBeforeTheUnitsOwnGatherIsWaitedFor) {
  tdist::test::TempDir dumps;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dumps.path().c_str(), 1);
    torch::manual_seed(3);
    tdist::FullyShardedDataParallelOptions o;
    o.forward_prefetch = true;
    tdist::FSDP<Net> model(Net(&o), o);
    const torch::Tensor x = torch::randn({4, 6}), y = torch::randn({4, 3});
    torch::mse_loss(model(x), y).backward();  // the order the next forward's prefetches follow
    const std::string gather = "all_gather_into_tensor_coalesced";
    const size_t before = recorded(gather).size();
    if (pg.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(600));
    torch::mse_loss(model(x), y).backward();
    check_when_second_was_queued(pg, gather, before, "the root's gather", "block 0's");
  }), "");
}

}  // namespace
