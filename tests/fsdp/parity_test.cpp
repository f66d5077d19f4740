// FSDP trains to the same weights as one process on the whole batch: every
// sharding strategy, flat (one unit) and nested (a unit per block plus the
// root's), SGD with momentum and Adam, clip_grad_norm_ and gradient
// accumulation under no_sync, on worlds of 1-4 real processes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <sstream>

#include "tests/fsdp/models.h"
#include "tests/util/world.h"

using tdist::ProcessGroup;
using tdist::ShardingStrategy;
using tdist::test::Net;
using tdist::test::run_world;

namespace {

constexpr int kSteps = 24;
constexpr int kBatch = 12;  // divides over 1-4 ranks

struct Case {
  const char* name;
  bool nested;
  bool adam;
  double clip;     // 0: no clipping
  int accumulate;  // micro-batches per step (the first ones under no_sync)
};

const Case kCases[] = {
    {"flat-sgd", false, false, 0, 1},
    {"nested-adam", true, true, 0, 1},
    {"nested-sgd-clip-nosync", true, false, 0.05, 2},
    {"flat-adam-clip-nosync", false, true, 0.05, 2},
};

std::pair<torch::Tensor, torch::Tensor> batch(int step, int micro) {
  torch::manual_seed(1000 + 10 * step + micro);
  auto x = torch::randn({kBatch, 6});
  auto y = torch::randn({kBatch, 3});
  return {x, y};
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::Tensor> params, bool adam) {
  if (adam) return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
}

void zero_grads(const std::vector<torch::Tensor>& params) {
  for (auto p : params) p.mutable_grad().reset();
}

std::map<std::string, torch::Tensor> train_reference(const Case& c) {
  torch::manual_seed(7);
  Net net;
  auto opt = make_optimizer(net->parameters(), c.adam);
  for (int step = 0; step < kSteps; ++step) {
    zero_grads(net->parameters());
    for (int m = 0; m < c.accumulate; ++m) {
      auto [x, y] = batch(step, m);
      torch::mse_loss(net->forward(x), y).backward();
    }
    if (c.clip > 0) torch::nn::utils::clip_grad_norm_(net->parameters(), c.clip);
    opt->step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

void train_sharded(ProcessGroup& pg, ShardingStrategy strategy, const Case& c) {
  const auto reference = train_reference(c);
  torch::manual_seed(7);
  tdist::FullyShardedDataParallelOptions o;
  o.sharding_strategy = strategy;
  tdist::FSDP<Net> model(Net(c.nested ? &o : nullptr), o);
  auto opt = make_optimizer(model->parameters(), c.adam);
  const int64_t rows = kBatch / pg.size();
  for (int step = 0; step < kSteps; ++step) {
    zero_grads(model->parameters());
    for (int m = 0; m < c.accumulate; ++m) {
      auto [x, y] = batch(step, m);
      auto loss = torch::mse_loss(model(x.narrow(0, pg.rank() * rows, rows)), y.narrow(0, pg.rank() * rows, rows));
      if (m + 1 < c.accumulate) {
        auto guard = model->no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    if (c.clip > 0) model->clip_grad_norm_(c.clip);
    opt->step();
  }
  auto full = model->summon_full_params(/*writeback=*/false);
  size_t compared = 0;
  for (const auto& p : model->named_parameters()) {
    const std::string name = tdist::test::strip_wrappers(p.key());
    auto it = reference.find(name);
    WORLD_CHECK(it != reference.end(), c.name << ": no reference parameter " << name);
    WORLD_CHECK(p.value().sizes() == it->second.sizes(), c.name << ": " << name << " is not whole under summon");
    const double err = (p.value() - it->second).norm().item<double>() / std::max(it->second.norm().item<double>(), 1e-12);
    WORLD_CHECK(err <= 1e-5, c.name << ": " << name << " differs by " << err << " (relative)");
    ++compared;
  }
  WORLD_CHECK(compared == reference.size(), c.name << ": compared " << compared << " of " << reference.size());
}

class Parity : public ::testing::TestWithParam<std::tuple<int, ShardingStrategy>> {};

TEST_P(Parity, SameWeightsAsOneProcessOnTheWholeBatch) {
  const auto [world, strategy] = GetParam();
  for (const Case& c : kCases) {
    EXPECT_EQ(run_world(world, [&, s = strategy](ProcessGroup& pg) { train_sharded(pg, s, c); }), "") << c.name;
  }
}

std::string strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FULL_SHARD: return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD: return "NO_SHARD";
    case ShardingStrategy::HYBRID_SHARD: return "HYBRID_SHARD";
    case ShardingStrategy::HYBRID_SHARD_ZERO2: return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

// One collective per unit each way, on every backend: a step of the
// nested model (3 blocks and the root: 4 units) gathers each unit once in
// forward and, under FULL_SHARD, once more in backward (not the root, which
// stays gathered), and reduce-scatters each unit once; nothing per
// parameter. The weights still match the one-process run (gloo packs the
// pieces, shm takes large ones alone).
class OneCollectivePerUnit : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(OneCollectivePerUnit, EachWayPerStep) {
  const auto [backend, world] = GetParam();
  tdist::test::WorldOptions wo;
  wo.backend = backend;
  for (ShardingStrategy strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
    EXPECT_EQ(run_world(world, [strategy](ProcessGroup& pg) {
      const Case c = kCases[1];  // nested-adam
      train_sharded(pg, strategy, c);
      torch::manual_seed(7);
      tdist::FullyShardedDataParallelOptions o;
      o.sharding_strategy = strategy;
      tdist::FSDP<Net> model(Net(&o), o);
      const auto step = [&] {
        auto [x, y] = batch(0, 0);
        torch::mse_loss(model(x), y).backward();
      };
      step();
      pg.reset_collective_counts();
      step();
      const auto counts = pg.collective_counts();
      const auto calls = [&](const char* op) { return counts.count(op) ? counts.at(op).calls : 0; };
      const int64_t units = 4;
      const int64_t gathers = strategy == ShardingStrategy::FULL_SHARD ? 2 * units - 1 : units;
      WORLD_CHECK(calls("all_gather_into_tensor_coalesced") == gathers,
                  "gathers per step: " << calls("all_gather_into_tensor_coalesced") << ", want " << gathers);
      WORLD_CHECK(calls("reduce_scatter_tensor_coalesced") == units,
                  "reductions per step: " << calls("reduce_scatter_tensor_coalesced") << ", want " << units);
      WORLD_CHECK(calls("all_gather_into_tensor") == 0 && calls("reduce_scatter_tensor") == 0,
                  "per-parameter collectives remain");
    }, wo), "") << strategy_name(strategy);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, OneCollectivePerUnit,
                         ::testing::Combine(::testing::Values("shm", "gloo"), ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
                         });

// FSDP2's controls: gradient accumulation with set_requires_gradient_sync
// instead of the no_sync guard, the full parameters kept from one
// micro-batch's backward into the next forward, explicit prefetch lists,
// all against the one-process run of nested-sgd-clip-nosync's schedule (two
// micro-batches a step, no clipping).
struct Fsdp2Nets {
  tdist::FullyShardedDataParallelOptions o;
  std::vector<tdist::FSDP<tdist::test::Block>> blocks;
};

TEST(Fsdp2Controls, AccumulateKeepGatheredAndPrefetchMatchOneProcess) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    const Case c{"controls", true, false, 0, 2};
    const auto reference = train_reference(c);
    torch::manual_seed(7);
    tdist::FullyShardedDataParallelOptions o;
    tdist::FSDP<Net> model(Net(&o), o);
    // block0's forward starts gathering blocks 1 and 2; block2's backward
    // starts gathering blocks 1 and 0.
    std::vector<std::shared_ptr<tdist::detail::FullyShardedModule>> blocks;
    for (const auto& child : model->module()->named_children()) {
      if (auto w = std::dynamic_pointer_cast<tdist::detail::FullyShardedModule>(child.value())) blocks.push_back(w);
    }
    WORLD_CHECK(blocks.size() == 3, blocks.size() << " block wrappers");
    const auto as_module = [](const std::shared_ptr<tdist::detail::FullyShardedModule>& w) {
      return std::dynamic_pointer_cast<torch::nn::Module>(w);
    };
    using Block = tdist::FullyShardedDataParallelImpl<tdist::test::Block>;
    auto b0 = std::dynamic_pointer_cast<Block>(as_module(blocks[0]));
    auto b2 = std::dynamic_pointer_cast<Block>(as_module(blocks[2]));
    WORLD_CHECK(b0 && b2, "block wrappers of an unexpected type");
    b0->set_modules_to_forward_prefetch({blocks[1], blocks[2]});
    b2->set_modules_to_backward_prefetch({blocks[1], blocks[0]});
    auto opt = make_optimizer(model->parameters(), c.adam);
    const int64_t rows = kBatch / pg.size();
    int64_t forward_gathers_kept = -1;
    for (int step = 0; step < kSteps; ++step) {
      zero_grads(model->parameters());
      for (int m = 0; m < c.accumulate; ++m) {
        const bool last = m + 1 == c.accumulate;
        model->set_requires_gradient_sync(last);
        model->set_reshard_after_backward(last);  // the first micro-batch's units stay gathered
        auto [x, y] = batch(step, m);
        pg.reset_collective_counts();
        auto out = model(x.narrow(0, pg.rank() * rows, rows));
        const auto counts = pg.collective_counts();
        const int64_t gathers = counts.count("all_gather_into_tensor_coalesced")
                                    ? counts.at("all_gather_into_tensor_coalesced").calls
                                    : 0;
        if (m == 1) forward_gathers_kept = gathers;
        pg.reset_collective_counts();
        torch::mse_loss(out, y.narrow(0, pg.rank() * rows, rows)).backward();
        const auto after = pg.collective_counts();
        WORLD_CHECK(last == (after.count("reduce_scatter_tensor_coalesced") > 0),
                    "micro-batch " << m << (last ? " reduced nothing" : " reduced with gradient sync off"));
      }
      opt->step();
    }
    // The second micro-batch's forward found every unit gathered: the root
    // stays gathered anyway, the blocks were kept from the first backward.
    WORLD_CHECK(forward_gathers_kept == 0, forward_gathers_kept << " gathers in a forward after a kept backward");
    auto full = model->summon_full_params(/*writeback=*/false);
    for (const auto& p : model->named_parameters()) {
      const auto& want = reference.at(tdist::test::strip_wrappers(p.key()));
      const double err = (p.value() - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-12);
      WORLD_CHECK(err <= 1e-5, p.key() << " differs by " << err);
    }
  }), "");
}

TEST(Fsdp2Controls, ReshardFreesKeptUnitsBeforeTheOptimizerSteps) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    torch::manual_seed(7);
    tdist::FullyShardedDataParallelOptions o;
    tdist::FSDP<Net> model(Net(&o), o);
    auto opt = make_optimizer(model->parameters(), true);
    std::vector<int64_t> shard_sizes;
    for (const auto& p : model->parameters()) shard_sizes.push_back(p.numel());
    const auto gathered = [&] {
      bool full = false;
      size_t k = 0;
      for (const auto& p : model->parameters()) full = full || p.numel() != shard_sizes[k++];
      return full;
    };
    auto [x, y] = batch(0, 0);
    // Kept gathered only while the gradients stay full (sync off)...
    model->set_reshard_after_backward(false);
    model->set_requires_gradient_sync(false);
    torch::mse_loss(model(x), y).backward();
    WORLD_CHECK(gathered(), "no unit stayed gathered after a backward without sync");
    model->reshard();
    WORLD_CHECK(!gathered(), "reshard() left a unit gathered");
    // ...never after a backward that reduced: the optimizer steps shards.
    model->set_requires_gradient_sync(true);
    torch::mse_loss(model(x), y).backward();
    WORLD_CHECK(!gathered(), "a unit stayed gathered holding shard gradients");
    size_t k = 0;
    for (const auto& p : model->parameters()) {
      WORLD_CHECK(!p.requires_grad() || p.grad().numel() == shard_sizes[k], "a full gradient after the reduction");
      ++k;
    }
    opt->step();  // steps the shards
    model->set_reshard_after_backward(true);
  }), "");
}

// A unit prefetched but not run in an iteration must not keep that gather:
// its shards change before it runs (here by hand, as an optimizer would).
struct SkipNetImpl : torch::nn::Module {
  explicit SkipNetImpl(const tdist::FullyShardedDataParallelOptions& o) {
    a = register_module("a", tdist::FSDP<tdist::test::Block>(tdist::test::Block(), o));
    b = register_module("b", tdist::FSDP<tdist::test::Block>(tdist::test::Block(), o));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = a(x);
    return use_b ? b(h) : h;
  }
  tdist::FSDP<tdist::test::Block> a{nullptr}, b{nullptr};
  bool use_b = true;
};
TORCH_MODULE(SkipNet);

TEST(Fsdp2Controls, APrefetchedUnitThatDidNotRunGathersAfresh) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    torch::manual_seed(7);
    tdist::FullyShardedDataParallelOptions o;
    tdist::FSDP<SkipNet> model(SkipNet(o), o);
    model->module()->a->set_modules_to_forward_prefetch({model->module()->b.ptr()});
    const auto x = torch::randn({4, 7});
    model->module()->use_b = false;  // b is prefetched by a's forward, then never runs
    model(x).sum().backward();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->module()->b->parameters()) p.mul_(2);  // its shards change
    }
    model->module()->use_b = true;
    const auto first = model(x).detach();
    const auto again = model(x).detach();
    WORLD_CHECK(at::equal(first, again), "the first forward used b's gather from before its shards changed");
  }), "");
}

INSTANTIATE_TEST_SUITE_P(Worlds, Parity,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(ShardingStrategy::FULL_SHARD,
                                                              ShardingStrategy::SHARD_GRAD_OP,
                                                              ShardingStrategy::NO_SHARD)),
                         [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) + "_" +
                                  strategy_name(std::get<1>(info.param));
                         });

}  // namespace
