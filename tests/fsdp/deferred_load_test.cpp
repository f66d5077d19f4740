// Weights straight into the shards: a model built with tdist::deferred_init
// and wrapped with skip_init gets no initialization at all; each loader
// (load_full_state_dict, load_sharded_checkpoint, a Checkpointer's restore,
// load_pretrained, tdist-ckpt's consolidated file) gives its shards their
// first values, which equal the saved model's shards bit for bit, and
// training goes on from them as from the saved model. A parameter no
// loader wrote is named: by a strict load that lacks it, and by the
// forward or full state dict that would read it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tdist/checkpoint_tools.h"
#include "tdist/checkpointer.h"
#include "tdist/deferred_init.h"
#include "tdist/errors.h"
#include "tdist/fsdp.h"
#include "tdist/fsdp_wrap.h"
#include "tdist/pretrained.h"
#include "tdist/safetensors.h"
#include "tdist/sharded_checkpoint.h"
#include "tdist/state_dict.h"
#include "tests/fsdp/shard_compare.h"
#include "tests/fsdp/tied_models.h"
#include "tests/util/process.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::ShardingStrategy;
using tdist::test::run_world;
using tdist::test::shards;
using tdist::test::TempDir;
using tdist::test::TiedBlock;
using tdist::test::TiedLm;

enum class Loader { kFullStateDict, kShardedCheckpoint, kCheckpointer, kPretrained, kConsolidated };

struct Case {
  const char* name;
  Loader loader;
  ShardingStrategy strategy;
  int world;
  bool tied_block;
};

const Case kCases[] = {
    {"full_state_dict", Loader::kFullStateDict, ShardingStrategy::FULL_SHARD, 2, false},
    {"full_state_dict/no_shard/tied", Loader::kFullStateDict, ShardingStrategy::NO_SHARD, 2, true},
    {"sharded_checkpoint/grad_op/tied", Loader::kShardedCheckpoint, ShardingStrategy::SHARD_GRAD_OP, 3, true},
    {"checkpointer", Loader::kCheckpointer, ShardingStrategy::FULL_SHARD, 2, true},
    {"pretrained", Loader::kPretrained, ShardingStrategy::FULL_SHARD, 3, false},
    {"consolidated", Loader::kConsolidated, ShardingStrategy::FULL_SHARD, 2, true},
};

tdist::FullyShardedDataParallelOptions options_for(const Case& c) {
  tdist::FullyShardedDataParallelOptions o;
  o.sharding_strategy = c.strategy;
  o.auto_wrap_policy =
      tdist::lambda_auto_wrap_policy([](torch::nn::Module& m) { return m.as<TiedBlock>() != nullptr; });
  return o;
}

template <typename Model, typename Opt>
void train(Model& model, Opt& opt, ProcessGroup& pg, int first_step) {
  for (int step = first_step; step < first_step + 2; ++step) {
    const auto ids = tdist::test::tied_rows(tdist::test::tied_batch(step), pg.rank(), pg.size());
    opt.zero_grad();
    tdist::test::tied_loss(model, ids).backward();
    opt.step();
  }
}

// The deferred model, wrapped with skip_init.
tdist::FSDP<TiedLm> deferred_model(const Case& c, uint64_t seed) {
  auto o = options_for(c);
  o.skip_init = true;
  torch::manual_seed(seed);
  TiedLm inner = tdist::deferred_init([&] { return TiedLm(c.tied_block); });
  return tdist::FSDP<TiedLm>(inner, o);
}

// Saves `source` as `c.loader` reads it, loads that into `target`.
void save_and_load(const Case& c, const std::string& dir, ProcessGroup& pg, tdist::FSDP<TiedLm>& source,
                   torch::optim::Optimizer& source_opt, tdist::FSDP<TiedLm>& target,
                   torch::optim::Optimizer& target_opt) {
  const std::string prefix = dir + "/ck";
  switch (c.loader) {
    case Loader::kFullStateDict:
      tdist::load_full_state_dict(*target, tdist::full_state_dict(*source, /*rank0_only=*/false));
      return;
    case Loader::kShardedCheckpoint:
      tdist::save_sharded_checkpoint(prefix, pg, *source, &source_opt);
      tdist::load_sharded_checkpoint(prefix, pg, *target, &target_opt);
      return;
    case Loader::kCheckpointer: {
      tdist::CheckpointerOptions o;
      o.dir = dir + "/run";
      o.async = false;
      {
        tdist::Checkpointer saver(tdist::default_group(), *source, &source_opt, o);
        saver.save(2);
      }
      tdist::Checkpointer loader(tdist::default_group(), *target, &target_opt, o);
      const auto restored = loader.restore();
      WORLD_CHECK(restored && restored->step == 2, "nothing restored");
      return;
    }
    case Loader::kPretrained:
      tdist::save_pretrained(*source, dir + "/hf");
      tdist::load_pretrained(*target, dir + "/hf");
      return;
    case Loader::kConsolidated: {
      tdist::save_sharded_checkpoint(prefix, pg, *source);
      if (pg.rank() == 0) {
        tdist::ConsolidateOptions co;
        co.format = tdist::CheckpointFormat::safetensors;
        tdist::consolidate_sharded_model_checkpoints(prefix, "_rank-*-of-*.pt", dir + "/full.safetensors", co);
      }
      pg.barrier()->wait();
      tdist::load_pretrained(*target, dir + "/full.safetensors");
      return;
    }
  }
}

class DeferredLoad : public ::testing::TestWithParam<Case> {};

TEST_P(DeferredLoad, TheLoadedValuesAreTheShardsFirstValues) {
  const Case c = GetParam();
  TempDir dir;
  EXPECT_EQ(run_world(c.world, [&](ProcessGroup& pg) {
    torch::manual_seed(11);
    tdist::FSDP<TiedLm> source(TiedLm(c.tied_block), options_for(c));
    auto source_opt = tdist::test::tied_optimizer(tdist::unique_parameters(*source));
    train(source, source_opt, pg, 0);  // values no initialization makes
    tdist::FSDP<TiedLm> target = deferred_model(c, 7);
    auto target_opt = tdist::test::tied_optimizer(tdist::unique_parameters(*target));
    save_and_load(c, dir.path(), pg, source, source_opt, target, target_opt);
    std::string why = tdist::test::compare_shards(shards(*target), shards(*source));
    WORLD_CHECK(why.empty(), c.name << " after loading: " << why);
    if (c.loader == Loader::kShardedCheckpoint || c.loader == Loader::kCheckpointer) {
      // The optimizer came with it: training goes on as the source's does.
      train(source, source_opt, pg, 2);
      train(target, target_opt, pg, 2);
      why = tdist::test::compare_shards(shards(*target), shards(*source));
      WORLD_CHECK(why.empty(), c.name << " after training on: " << why);
    }
  }), "");
}

INSTANTIATE_TEST_SUITE_P(Loaders, DeferredLoad, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return tdist::test::param_test_name(i.param.name);
                         });

bool names(const std::exception& e, const std::string& what) {
  return std::string(e.what()).find(what) != std::string::npos;
}

const Case kPlain = kCases[0];

TEST(DeferredLoadMissing, AForwardBeforeAnyLoadIsRefusedByName) {
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FSDP<TiedLm> target = deferred_model(kPlain, 7);
    try {
      tdist::test::tied_loss(target, tdist::test::tied_rows(tdist::test::tied_batch(0), pg.rank(), pg.size()));
      WORLD_CHECK(false, "no error");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(names(e, "skip_init") && names(e, "wte.weight"), e.what());
    }
    try {
      tdist::full_state_dict(*target, false);
      WORLD_CHECK(false, "no error");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(names(e, "skip_init"), e.what());
    }
  }), "");
}

// The sharded saves read the shards without gathering: they check too,
// and write nothing (no rank file, no Checkpointer step).
TEST(DeferredLoadMissing, ASaveBeforeAnyLoadIsRefusedByName) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FSDP<TiedLm> target = deferred_model(kPlain, 7);
    torch::optim::Adam opt(target->parameters(), 1e-3);
    try {
      tdist::sharded_state_dict(*target);
      WORLD_CHECK(false, "sharded_state_dict: no error");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(names(e, "skip_init") && names(e, "wte.weight"), e.what());
    }
    try {
      tdist::save_sharded_checkpoint(dir.path() + "/ck", pg, *target, &opt);
      WORLD_CHECK(false, "save_sharded_checkpoint: no error");
    } catch (const tdist::Error& e) {
      WORLD_CHECK(names(e, "skip_init"), e.what());
    }
    tdist::CheckpointerOptions o;
    o.dir = dir.path() + "/run";
    o.async = false;
    tdist::Checkpointer saver(tdist::default_group(), *target, &opt, o);
    try {
      saver.save(1);
      WORLD_CHECK(false, "Checkpointer::save: no error");
    } catch (const tdist::Error& e) {
      WORLD_CHECK(names(e, "skip_init"), e.what());
    }
    pg.barrier()->wait();
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::recursive_directory_iterator(dir.path())) {
      if (!e.is_directory()) files.push_back(e.path().string());
    }
    WORLD_CHECK(files.empty(), "a refused save left " << files.size() << " files, e.g. " << files[0]);
    WORLD_CHECK(!saver.restore(), "a refused save can be restored");
  }), "");
}

TEST(DeferredLoadMissing, ANameTheFilesLackIsAnError) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    torch::manual_seed(11);
    tdist::FSDP<TiedLm> source(TiedLm(false), options_for(kPlain));
    tdist::StateDict full = tdist::full_state_dict(*source, false);
    const std::string lacking = "h.1.fc.weight";
    WORLD_CHECK(full.contains(lacking), "no " << lacking);
    full.erase(lacking);
    tdist::FSDP<TiedLm> target = deferred_model(kPlain, 7);
    for (bool strict : {true, false}) {  // a state dict lacking an entry is refused either way
      try {
        tdist::load_full_state_dict(*target, full, strict);
        WORLD_CHECK(false, "no error");
      } catch (const tdist::CheckpointError& e) {
        WORLD_CHECK(names(e, lacking), e.what());
      }
    }
    const std::string file = dir.path() + "/lacking.safetensors";
    if (pg.rank() == 0) tdist::save_safetensors(file, full);
    pg.barrier()->wait();
    try {
      tdist::load_pretrained(*target, file);  // strict
      WORLD_CHECK(false, "no error");
    } catch (const tdist::CheckpointError& e) {
      WORLD_CHECK(names(e, lacking), e.what());
    }
    // Not strict, load_pretrained loads the rest and reports what it
    // lacked, and the forward that would read it names it.
    tdist::LoadPretrainedOptions lenient;
    lenient.strict = false;
    const auto report = tdist::load_pretrained(*target, file, lenient);
    WORLD_CHECK(report.missing == std::vector<std::string>{lacking}, report.missing.size());
    try {
      tdist::test::tied_loss(target, tdist::test::tied_rows(tdist::test::tied_batch(0), pg.rank(), pg.size()));
      WORLD_CHECK(false, "no error");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(names(e, lacking) && names(e, "skip_init"), e.what());
    }
  }), "");
}

// A parameter with one row at world 2: rank 1 holds none of it. Every rank
// still decides alike (a loader writes the empty rows too), so a load that
// lacks it fails the forward on both ranks, never one rank in a gather.
TEST(DeferredLoadMissing, ARankWithoutRowsDecidesAsTheOthers) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    o.skip_init = true;
    const auto make = [&] {
      return tdist::FSDP<torch::nn::Linear>(tdist::deferred_init([] { return torch::nn::Linear(3, 1); }), o);
    };
    tdist::StateDict full;
    full.insert("weight", torch::full({1, 3}, 0.5));
    full.insert("bias", torch::full({1}, 0.25));
    auto loaded = make();
    tdist::load_full_state_dict(*loaded, full);
    const at::Tensor y = loaded(torch::ones({2, 3}));
    WORLD_CHECK(torch::allclose(y, torch::full({2, 1}, 1.75)), y);
    const std::string file = dir.path() + "/no_bias.safetensors";
    if (pg.rank() == 0) tdist::save_safetensors(file, {{"weight", full["weight"]}});
    pg.barrier()->wait();
    auto lacking = make();
    tdist::LoadPretrainedOptions lenient;
    lenient.strict = false;
    tdist::load_pretrained(*lacking, file, lenient);
    try {
      lacking(torch::ones({2, 3}));
      WORLD_CHECK(false, "no error");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(names(e, "'bias'"), e.what());
    }
  }), "");
}

// sync_module_states: rank 0's values are the load (it built the model
// eagerly; the others deferred, with skip_init).
TEST(DeferredLoadMissing, SyncModuleStatesIsTheLoad) {
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    auto o = options_for(kPlain);
    o.skip_init = true;
    o.sync_module_states = true;
    torch::manual_seed(11);
    tdist::FSDP<TiedLm> reference(TiedLm(false), options_for(kPlain));
    torch::manual_seed(11);
    TiedLm inner = pg.rank() == 0 ? TiedLm(false) : tdist::deferred_init([] { return TiedLm(false); });
    tdist::FSDP<TiedLm> model(inner, o);
    const std::string why = tdist::test::compare_shards(shards(*model), shards(*reference));
    WORLD_CHECK(why.empty(), why);
    tdist::test::tied_loss(model, tdist::test::tied_rows(tdist::test::tied_batch(0), pg.rank(), pg.size()));
  }), "");
}

TEST(DeferredLoadMissing, SkipInitWithParamInitFnIsRefused) {
  EXPECT_EQ(run_world(1, [&](ProcessGroup&) {
    auto o = options_for(kPlain);
    o.skip_init = true;
    o.param_init_fn = [](torch::nn::Module&) {};
    TiedLm inner = tdist::deferred_init([] { return TiedLm(false); });
    try {
      tdist::FSDP<TiedLm> fsdp(inner, o);
      WORLD_CHECK(false, "no error");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(names(e, "skip_init") && names(e, "param_init_fn"), e.what());
    }
  }), "");
}

}  // namespace
