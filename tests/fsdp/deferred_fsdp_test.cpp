// FSDP over a model built with tdist::deferred_init: each unit is made
// real as its wrapper is built (never the whole model), and the shards
// and a few training steps equal those of the same model built eagerly
// with the same seed, bit for bit: auto-wrapped and nested by hand (units
// built inside the model's constructor, so inside deferred_init), every
// strategy, hybrid sharding, mixed precision, activation checkpointing,
// tied weights; param_init_fn instead of the constructor's init.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "tests/fsdp/models.h"
#include "tests/fsdp/shard_compare.h"
#include "tests/fsdp/tied_models.h"
#include "tdist/activation_checkpoint.h"
#include "tdist/deferred_init.h"
#include "tdist/errors.h"
#include "tdist/fsdp.h"
#include "tdist/fsdp_wrap.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::ShardingStrategy;
using tdist::test::run_world;
using tdist::test::shards;
using tdist::test::TiedBlock;
using tdist::test::TiedLm;

struct Config {
  const char* name;
  ShardingStrategy strategy;
  int world;
  bool tied_block;  // the second block uses the embedding too
  bool checkpointing;
  bool bf16;
};

const Config kConfigs[] = {
    {"full_shard", ShardingStrategy::FULL_SHARD, 2, false, false, false},
    {"shard_grad_op/tied", ShardingStrategy::SHARD_GRAD_OP, 2, true, false, false},
    {"no_shard", ShardingStrategy::NO_SHARD, 2, false, false, false},
    {"hybrid/world4", ShardingStrategy::HYBRID_SHARD, 4, true, false, false},
    {"full_shard/checkpoint/bf16/tied", ShardingStrategy::FULL_SHARD, 3, true, true, true},
};

tdist::FullyShardedDataParallelOptions options_for(const Config& c) {
  tdist::FullyShardedDataParallelOptions o;
  o.sharding_strategy = c.strategy;
  o.auto_wrap_policy =
      tdist::lambda_auto_wrap_policy([](torch::nn::Module& m) { return m.as<TiedBlock>() != nullptr; });
  if (c.strategy == ShardingStrategy::HYBRID_SHARD) o.sharding_groups = {{0, 1}, {2, 3}};
  if (c.checkpointing) {
    o.auto_wrapper_callable = [](torch::nn::AnyModule m, const tdist::FullyShardedDataParallelOptions& co) {
      return torch::nn::AnyModule(tdist::FullyShardedDataParallel(tdist::checkpoint_module(std::move(m)), co));
    };
  }
  if (c.bf16) {
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kFloat;
  }
  return o;
}

template <typename Model>
void train(Model& model, ProcessGroup& pg) {
  auto opt = tdist::test::tied_optimizer(model->parameters());
  for (int step = 0; step < 3; ++step) {
    const auto ids = tdist::test::tied_rows(tdist::test::tied_batch(step), pg.rank(), pg.size());
    opt.zero_grad();
    tdist::test::tied_loss(model, ids).backward();
    opt.step();
  }
}

class DeferredFsdp : public ::testing::TestWithParam<Config> {};

TEST_P(DeferredFsdp, EqualsTheEagerModelBitForBit) {
  const Config c = GetParam();
  EXPECT_EQ(run_world(c.world, [&](ProcessGroup& pg) {
    const auto o = options_for(c);
    torch::manual_seed(7);
    tdist::FSDP<TiedLm> eager(TiedLm(c.tied_block), o);
    torch::manual_seed(7);
    TiedLm inner = tdist::deferred_init([&] { return TiedLm(c.tied_block); });
    WORLD_CHECK(tdist::is_deferred(*inner), c.name);
    tdist::FSDP<TiedLm> deferred(inner, o);
    std::string why = tdist::test::compare_shards(shards(*deferred), shards(*eager));
    WORLD_CHECK(why.empty(), c.name << " after wrapping: " << why);
    train(eager, pg);
    train(deferred, pg);
    why = tdist::test::compare_shards(shards(*deferred), shards(*eager));
    WORLD_CHECK(why.empty(), c.name << " after training: " << why);
  }), "");
}

INSTANTIATE_TEST_SUITE_P(Configs, DeferredFsdp, ::testing::ValuesIn(kConfigs),
                         [](const ::testing::TestParamInfo<Config>& i) {
                           return tdist::test::param_test_name(i.param.name);
                         });

// Units built by hand inside the model's constructor run inside
// deferred_init: each is made real (for real, not recorded) as it is built.
TEST(DeferredFsdpNested, UnitsBuiltInTheConstructorEqualTheEagerOnes) {
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(3);
    tdist::FSDP<tdist::test::Net> eager(tdist::test::Net(&o), o);
    torch::manual_seed(3);
    auto inner = tdist::deferred_init([&] { return tdist::test::Net(&o); });
    tdist::FSDP<tdist::test::Net> deferred(inner, o);
    const std::string why = tdist::test::compare_shards(shards(*deferred), shards(*eager));
    WORLD_CHECK(why.empty(), why);
    (void)pg;
  }), "");
}

// With param_init_fn, each unit is made when its wrapper is: when the fn
// runs for a module, the units built after it are still meta, so the
// model is never whole.
TEST(DeferredFsdpInit, ParamInitFnInitializesOneUnitAtATime) {
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    auto o = options_for(kConfigs[0]);
    TiedLm model = tdist::deferred_init([] { return TiedLm(false); });
    std::vector<int64_t> meta_left;  // meta parameters of the whole model at each call
    std::vector<std::string> called;
    o.param_init_fn = [&](torch::nn::Module& m) {
      int64_t meta = 0;
      for (const auto& p : model->parameters()) meta += p.is_meta() ? 1 : 0;
      meta_left.push_back(meta);
      called.push_back(m.name());
      torch::NoGradGuard no_grad;
      for (auto& p : m.parameters(false)) p.fill_(0.25);
      for (auto& b : m.buffers(false)) b.fill_(0.0);
    };
    tdist::FSDP<TiedLm> fsdp(model, o);
    WORLD_CHECK(meta_left.size() == called.size() && !called.empty(), called.size());
    // Two blocks (2 Linear each: fc), then the root's embedding and layer norm.
    WORLD_CHECK(meta_left.front() > 0 && meta_left.back() < meta_left.front(), meta_left.front());
    for (const auto& p : fsdp->named_parameters(true)) {
      WORLD_CHECK(!p.value().is_meta(), p.key());
      WORLD_CHECK(p.value().numel() == 0 || (p.value() == 0.25).all().item<bool>(), p.key());
    }
    (void)pg;
  }), "");
}

TEST(DeferredFsdpInit, AnInitThatForgetsATensorIsNamed) {
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    auto o = options_for(kConfigs[0]);
    TiedLm model = tdist::deferred_init([] { return TiedLm(false); });
    // param_init_fn's tensors are real already: a meta one left is one it
    // replaced with a meta tensor (a bug), named.
    o.param_init_fn = [](torch::nn::Module& m) {
      if (auto* ln = m.as<torch::nn::LayerNorm>()) {
        ln->weight.unsafeGetTensorImpl()->shallow_copy_from(torch::empty({8}, torch::kMeta).getIntrusivePtr());
      }
    };
    try {
      tdist::FSDP<TiedLm> fsdp(model, o);
      WORLD_CHECK(false, "no error");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(std::string(e.what()).find("ln_f.weight") != std::string::npos, e.what());
    }
    (void)pg;
  }), "");
}

}  // namespace
