// FSDP with bad input and failures: models that differ across ranks, a
// module wrapped twice, a unit of two dtypes, a parameter replaced after
// wrapping, a rank that dies during a gather, a backward that fails part-
// way; and what users see between iterations: shards, eval forwards that
// leave no gradient and no full parameter behind, summon_full_params,
// get_shard_metadata.
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <chrono>

#include "fsdp/unit.h"
#include "tdist/errors.h"
#include "tests/fsdp/models.h"
#include "tests/util/two_devices.h"
#include "tests/util/world.h"

using tdist::FSDP;
using tdist::ProcessGroup;
using tdist::test::Block;
using tdist::test::Net;
using tdist::test::run_world;
using tdist::test::WorldOptions;

namespace {

using tdist::test::TwoDevices;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

template <typename E, typename F>
std::string expect_throw(F&& f, const std::string& what) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  throw std::runtime_error(what + ": did not throw the expected error");
}

TEST(FsdpMisuse, AModelThatDiffersAcrossRanksIsNamed) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    const std::string msg = expect_throw<tdist::UsageError>([&] { FSDP<Block> b(Block(7, 5 + pg.rank())); }, "differ");
    WORLD_CHECK(contains(msg, "rank 1") && contains(msg, "fc1.weight"), msg);
  }), "");
}

TEST(FsdpMisuse, AModuleWrappedTwiceIsRefused) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    Block b;
    FSDP<Block> first(b);
    std::string msg = expect_throw<tdist::UsageError>([&] { FSDP<Block> second(b); }, "same module");
    WORLD_CHECK(contains(msg, "already sharded") && contains(msg, "'gate'"), msg);
    msg = expect_throw<tdist::UsageError>([&] { FSDP<FSDP<Block>> outer(first); }, "wrapper of a wrapper");
    WORLD_CHECK(contains(msg, "already an FSDP wrapper"), msg);
    // The refused wrappers claimed nothing: a fresh module still wraps.
    FSDP<Block> other{Block()};
  }), "");
}

struct TwoDtypesImpl : torch::nn::Module {
  TwoDtypesImpl() {
    a = register_parameter("a", torch::ones({4}));
    b = register_parameter("b", torch::ones({4}, torch::kDouble));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x * a + x * b.to(torch::kFloat); }
  torch::Tensor a, b;
};
TORCH_MODULE(TwoDtypes);

TEST(FsdpMisuse, AUnitOfTwoDtypesIsRefusedByName) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    const std::string msg = expect_throw<tdist::UsageError>([&] { FSDP<TwoDtypes> m{TwoDtypes()}; }, "dtypes");
    WORLD_CHECK(contains(msg, "'b'") && contains(msg, "Double"), msg);
  }), "");
}

// A meta tensor FSDP cannot make real (deferred_init did not make it) is
// refused by name before anything is sharded.
TEST(FsdpMisuse, AMetaTensorNotFromDeferredInitIsRefusedByName) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    tdist::FullyShardedDataParallelOptions o;
    const std::string msg = expect_throw<tdist::UsageError>([&] { FSDP<TwoDevices> m(TwoDevices(), o); }, "meta");
    WORLD_CHECK(contains(msg, "'b'") && contains(msg, "deferred_init") && contains(msg, "FullyShardedDataParallel"), msg);
  }), "");
}

// A unit's parameters on two devices (the CPU and, as the one other device
// a CPU-only machine has, meta) are refused by name.
TEST(FsdpMisuse, AUnitOnTwoDevicesIsRefusedByName) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    std::vector<tdist::detail::FsdpParamSpec> specs;
    specs.push_back({"a", torch::ones({4}), false, "a", {}});
    specs.push_back({"b", torch::empty({4}, torch::kMeta), false, "b", {}});
    const std::string msg = expect_throw<tdist::UsageError>(
        [&] { tdist::detail::ShardedUnit u(tdist::default_group(), "unit", std::move(specs), {}); }, "device");
    WORLD_CHECK(contains(msg, "'b'") && contains(msg, "meta") && contains(msg, "device_id"), msg);
  }), "");
}

TEST(FsdpMisuse, ADeviceIdOfTheCpuTrainsAsWithout) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    tdist::FullyShardedDataParallelOptions o;
    o.device_id = c10::Device(c10::kCPU);
    FSDP<Block> m(Block(), o);
    m(torch::ones({2, 7})).sum().backward();
    for (const auto& p : m->parameters()) WORLD_CHECK(p.device().is_cpu(), "a shard left the CPU");
  }), "");
}

TEST(FsdpMisuse, AParameterReplacedAfterWrappingIsNamed) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    FSDP<Block> m{Block()};
    m->module()->fc2->bias.set_data(torch::zeros({7}));
    const std::string msg = expect_throw<tdist::UsageError>([&] { m(torch::ones({2, 7})); }, "replaced");
    WORLD_CHECK(contains(msg, "fc2.bias") && contains(msg, "before wrapping"), msg);
  }), "");
}

TEST(FsdpFailures, ARankThatDiesDuringAGatherIsNamed) {
  WorldOptions o;
  o.final_barrier = false;
  const std::string failures = run_world(3, [](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions fo;
    torch::manual_seed(1);
    FSDP<Net> model(Net(&fo), fo);
    model(torch::ones({2, 6})).sum().backward();
    if (pg.rank() == 2) raise(SIGKILL);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      model(torch::ones({2, 6})).sum().backward();
      throw std::runtime_error("a step with a dead peer succeeded");
    } catch (const tdist::PeerFailureError& e) {
      WORLD_CHECK(e.rank() == 2 && contains(e.what(), "rank 2"), e.what());
      WORLD_CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10), "noticed late");
    }
  }, o);
  EXPECT_EQ(failures, "rank 2: signal 9\n");
}

// A backward that throws part-way (here a user's hook on the output) fails
// that backward only: the next iterations train as if it never happened.
TEST(FsdpFailures, ABackwardThatFailsPartWayLeavesNothingBehind) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    const auto x = [](int step) { torch::manual_seed(50 + step); return torch::randn({4, 6}); };
    torch::manual_seed(3);
    Net reference;
    torch::optim::SGD ref_opt(reference->parameters(), 0.1);
    torch::manual_seed(3);
    tdist::FullyShardedDataParallelOptions fo;
    FSDP<Net> model(Net(&fo), fo);
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      if (step == 1) {
        auto out = model(x(99).narrow(0, 2 * pg.rank(), 2));
        out.register_hook([](torch::Tensor) -> torch::Tensor { throw std::runtime_error("boom"); });
        expect_throw<std::exception>([&] { out.sum().backward(); }, "failing backward");
      }
      ref_opt.zero_grad();
      reference(x(step)).sum().div(2).backward();
      ref_opt.step();
      for (auto& p : model->parameters()) p.mutable_grad().reset();
      model(x(step).narrow(0, 2 * pg.rank(), 2)).sum().backward();
      opt.step();
    }
    auto full = model->summon_full_params(false);
    auto ref = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      const auto& r = ref[tdist::test::strip_wrappers(p.key())];
      WORLD_CHECK(torch::allclose(p.value(), r, 1e-5, 1e-6), p.key() << " differs after the failed backward");
    }
  }), "");
}

TEST(FsdpUse, BetweenIterationsParametersAreShardsAndEvalLeavesNoGradients) {
  for (auto strategy : {tdist::ShardingStrategy::FULL_SHARD, tdist::ShardingStrategy::SHARD_GRAD_OP}) {
    EXPECT_EQ(run_world(3, [strategy](ProcessGroup& pg) {
      tdist::FullyShardedDataParallelOptions fo;
      fo.sharding_strategy = strategy;
      FSDP<Net> model(Net(&fo), fo);
      const auto md = model->get_shard_metadata();
      std::map<std::string, std::vector<int64_t>> shard_shapes;
      for (const auto& u : md.units) {
        for (const auto& p : u.params) shard_shapes[p.name] = p.shard_shape;
      }
      const auto check_shards = [&](const char* when) {
        for (const auto& p : model->named_parameters()) {
          WORLD_CHECK(p.value().sizes().vec() == shard_shapes.at(p.key()), p.key() << " is not a shard " << when);
        }
      };
      check_shards("after wrapping");
      model->eval();
      model(torch::ones({2, 6}));  // eval mode, gradients on
      model->train();
      {
        torch::NoGradGuard no_grad;
        model(torch::ones({2, 6}));
      }
      check_shards("after eval and no_grad forwards");
      for (const auto& p : model->parameters()) WORLD_CHECK(!p.grad().defined(), "a forward made a gradient");
      model(torch::ones({2, 6})).sum().backward();
      check_shards("after backward");
      for (const auto& p : model->named_parameters()) {
        if (p.value().requires_grad()) {
          WORLD_CHECK(p.value().grad().sizes() == p.value().sizes(), p.key() << ": .grad is not the shard's shape");
        }
      }
      // Every element is on exactly one rank.
      int64_t mine = 0, full = 0;
      for (const auto& u : md.units) {
        for (const auto& p : u.params) {
          mine += c10::multiply_integers(p.shard_shape);
          full += p.numel;
        }
      }
      at::Tensor total = torch::tensor({mine});
      pg.all_reduce(total)->wait();
      WORLD_CHECK(total.item<int64_t>() == full, "shards add up to " << total.item<int64_t>() << " of " << full);
    }), "");
  }
}

TEST(FsdpUse, ShardMetadataNamesEveryUnitAndRow) {
  EXPECT_EQ(run_world(3, [](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions fo;
    FSDP<Net> model(Net(&fo), fo);
    const auto md = model->get_shard_metadata();
    WORLD_CHECK(md.world_size == 3 && md.rank == pg.rank(), "world/rank");
    WORLD_CHECK(md.units.size() == 4, md.units.size() << " units");
    WORLD_CHECK(md.units[0].prefix.empty() && md.units[1].prefix == "module.block0", md.units[1].prefix);
    const auto& root = md.units[0].params;
    // A module's own parameters first, then its children's (named_parameters' order).
    WORLD_CHECK(root.size() == 5 && root[0].original_name == "scale" && root[1].original_name == "in.weight",
                root[1].original_name);
    const auto& scale = root[0];  // 0-d: one row, on rank 0
    WORLD_CHECK(scale.shape.empty() && scale.rows_per_rank == 1 && scale.padding_rows == 2, "scale layout");
    WORLD_CHECK(scale.shard_shape == (pg.rank() == 0 ? std::vector<int64_t>{} : std::vector<int64_t>{0}), "scale shard");
    const auto& fc1 = md.units[1].params[1];  // [5, 7] over 3 ranks: 2, 2, 1 rows
    WORLD_CHECK(fc1.name == "module.block0.module.fc1.weight" && fc1.original_name == "block0.fc1.weight", fc1.name);
    WORLD_CHECK(fc1.rows_per_rank == 2 && fc1.padding_rows == 1 && fc1.first_row == 2 * pg.rank(), "fc1 rows");
    WORLD_CHECK(fc1.shard_shape == (std::vector<int64_t>{pg.rank() == 2 ? 1 : 2, 7}), "fc1 shard shape");
    const auto& gate = md.units[1].params[0];
    WORLD_CHECK(gate.original_name == "block0.gate" && !gate.requires_grad, gate.original_name);
  }), "");
}

TEST(FsdpUse, SummonFullParamsReadsAndWritesTheWholeModel) {
  for (auto strategy : {tdist::ShardingStrategy::FULL_SHARD, tdist::ShardingStrategy::SHARD_GRAD_OP}) {
  EXPECT_EQ(run_world(2, [strategy](ProcessGroup&) {
    torch::manual_seed(11);
    Net plain;
    torch::manual_seed(11);
    tdist::FullyShardedDataParallelOptions fo;
    fo.sharding_strategy = strategy;
    FSDP<Net> model(Net(&fo), fo);
    auto ref = plain->named_parameters();
    {
      auto full = model->summon_full_params();
      for (const auto& p : model->named_parameters()) {
        WORLD_CHECK(torch::equal(p.value(), ref[tdist::test::strip_wrappers(p.key())]), p.key());
      }
      torch::NoGradGuard no_grad;
      model->module()->head->bias.fill_(3);
      expect_throw<tdist::UsageError>([&] { model(torch::ones({1, 6})); }, "forward inside summon");
    }
    {
      auto full = model->summon_full_params(/*writeback=*/false);
      WORLD_CHECK(torch::equal(model->module()->head->bias, torch::full({3}, 3.0)), "the edit was not written back");
      torch::NoGradGuard no_grad;
      model->module()->head->bias.fill_(5);
    }
    auto full = model->summon_full_params(false);
    WORLD_CHECK(torch::equal(model->module()->head->bias, torch::full({3}, 3.0)), "an edit without writeback stayed");
  }), "");
  }
}

// A model that trained and is dropped goes away whole: its units, their
// gradient accumulators and its parameters (the outermost unit's iteration
// state referred back to the unit that owns it: a cycle that kept every
// model alive).
class FsdpLifetime : public ::testing::TestWithParam<tdist::ShardingStrategy> {};

TEST_P(FsdpLifetime, ADroppedModelIsFreed) {
  EXPECT_EQ(run_world(2, [s = GetParam()](ProcessGroup&) {
    std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> params;
    {
      tdist::FullyShardedDataParallelOptions fo;
      fo.sharding_strategy = s;
      torch::manual_seed(1);
      FSDP<Net> model(Net(&fo), fo);
      torch::optim::SGD opt(model->parameters(), 0.1);
      for (int step = 0; step < 2; ++step) {
        opt.zero_grad();
        model(torch::ones({2, 6})).sum().backward();
        opt.step();
      }
      for (const auto& p : model->parameters()) params.emplace_back(p.getIntrusivePtr());
    }
    for (size_t i = 0; i < params.size(); ++i) WORLD_CHECK(params[i].expired(), "parameter " << i << " still alive");
  }), "");
}

std::string strategy_name(const ::testing::TestParamInfo<tdist::ShardingStrategy>& info) {
  static const char* const kNames[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"};
  return kNames[static_cast<int>(info.param)];
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpLifetime,
                         ::testing::Values(tdist::ShardingStrategy::FULL_SHARD, tdist::ShardingStrategy::SHARD_GRAD_OP,
                                           tdist::ShardingStrategy::NO_SHARD),
                         strategy_name);

}  // namespace
