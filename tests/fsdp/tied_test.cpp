// Tied parameters under FSDP: a tensor registered under several names (the
// LM head's weight is the embedding's; in the second model a block uses it
// too) is owned by one unit, once, and training gives one process's
// weights, at worlds 2 and 3, under every sharding strategy, with the
// blocks auto-wrapped (by type name and by predicate), with activation
// checkpointing, prefetching and bf16 mixed precision. Units built by hand
// that would both own it are refused with a message naming both uses and
// the fix. Real processes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>

#include "tdist/tdist.h"
#include "tests/fsdp/models.h"
#include "tests/fsdp/tied_models.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::ShardingStrategy;
using tdist::test::run_world;
using tdist::test::TiedBlock;
using tdist::test::TiedBlockImpl;
using tdist::test::TiedLm;

struct Config {
  const char* name;
  bool block_uses_tied;
  bool by_type_name;   // transformer_auto_wrap_policy by name, else lambda_auto_wrap_policy
  bool checkpointing;  // auto_wrapper_callable: FSDP(checkpoint_module(block))
  bool prefetch;       // forward_prefetch and BACKWARD_PRE
  bool bf16;           // param_dtype bf16 (reduce in fp32)
  bool reshard;        // reshard_after_forward for SHARD_GRAD_OP (and off for FULL_SHARD)
  double clip;         // clip_grad_norm_ (0: none)
};

const Config kConfigs[] = {
    {"head-tied/lambda", false, false, false, false, false, false, 0},
    {"block-uses-tied/by-name/checkpoint/prefetch/clip", true, true, true, true, false, false, 0.5},
    {"block-uses-tied/lambda/reshard-flipped", true, false, false, false, false, true, 0},
    {"block-uses-tied/lambda/checkpoint/bf16", true, false, true, false, true, false, 0},
};

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

void train_and_compare(ProcessGroup& pg, ShardingStrategy strategy, const Config& c) {
  const auto reference = tdist::test::tied_reference(c.block_uses_tied, c.clip);
  tdist::FullyShardedDataParallelOptions o;
  o.sharding_strategy = strategy;
  if (c.by_type_name) {
    o.auto_wrap_policy = tdist::transformer_auto_wrap_policy({TiedBlockImpl().name()});
  } else {
    o.auto_wrap_policy =
        tdist::lambda_auto_wrap_policy([](torch::nn::Module& m) { return m.as<TiedBlock>() != nullptr; });
  }
  if (c.checkpointing) {
    o.auto_wrapper_callable = [](torch::nn::AnyModule m, const tdist::FullyShardedDataParallelOptions& co) {
      return torch::nn::AnyModule(tdist::FullyShardedDataParallel(tdist::checkpoint_module(std::move(m)), co));
    };
  }
  if (c.prefetch) {
    o.forward_prefetch = true;
    o.backward_prefetch = tdist::BackwardPrefetch::BACKWARD_PRE;
  }
  if (c.bf16) {
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kFloat;
  }
  if (c.reshard) o.reshard_after_forward = strategy != ShardingStrategy::FULL_SHARD;
  torch::manual_seed(7);
  tdist::FSDP<TiedLm> model(TiedLm(c.block_uses_tied), o);

  // The root owns the tied tensor once, under its first name; the block
  // that uses it does not own it.
  const auto md = model->get_shard_metadata();
  WORLD_CHECK(md.units.size() == 3, c.name << ": " << md.units.size() << " units");
  size_t owners = 0;
  for (const auto& u : md.units) {
    for (const auto& p : u.params) {
      WORLD_CHECK(!contains(p.original_name, "emb") && p.original_name != "lm_head.weight",
                  c.name << ": a unit owns " << p.original_name);
      if (p.original_name != "wte.weight") continue;
      ++owners;
      WORLD_CHECK(u.prefix.empty(), c.name << ": wte.weight is owned by " << u.prefix);
      std::vector<std::string> want = {"lm_head.weight"};
      if (c.block_uses_tied) want.insert(want.begin(), "h.1.emb");
      WORLD_CHECK(p.aliases == want, c.name << ": aliases " << p.aliases.size());
    }
  }
  WORLD_CHECK(owners == 1, c.name << ": " << owners << " units own wte.weight");

  auto opt = tdist::test::tied_optimizer(tdist::unique_parameters(*model));
  for (int step = 0; step < tdist::test::kTiedSteps; ++step) {
    opt.zero_grad();
    const auto ids = tdist::test::tied_rows(tdist::test::tied_batch(step), pg.rank(), pg.size());
    tdist::test::tied_loss(model, ids).backward();
    if (c.clip > 0) model->clip_grad_norm_(c.clip);
    opt.step();
  }

  const double tolerance = c.bf16 ? 3e-2 : 1e-5;  // bf16: its forward and backward round
  auto full = model->summon_full_params(/*writeback=*/false);
  const auto named = model->named_parameters();
  size_t compared = 0;
  for (const auto& p : named) {
    const std::string name = tdist::test::strip_wrappers(p.key());
    const auto it = reference.find(name);
    WORLD_CHECK(it != reference.end(), c.name << ": no reference parameter " << name);
    WORLD_CHECK(p.value().sizes() == it->second.sizes(), c.name << ": " << name << " is not whole under summon");
    const double err = (p.value() - it->second).norm().item<double>() / it->second.norm().item<double>();
    WORLD_CHECK(err <= tolerance, c.name << ": " << name << " differs by " << err << " (relative)");
    ++compared;
  }
  WORLD_CHECK(compared == reference.size(), c.name << ": compared " << compared << " of " << reference.size());
  // The tied names are still one tensor.
  const auto* wte = named.find("module.wte.weight");
  const auto* head = named.find("module.lm_head.weight");
  WORLD_CHECK(wte && head && wte->data_ptr() == head->data_ptr(), c.name << ": lm_head.weight is not wte.weight");
  if (c.block_uses_tied) {
    const std::string emb = c.checkpointing ? "module.h.1.module.module.emb" : "module.h.1.module.emb";
    const auto* e = named.find(emb);
    WORLD_CHECK(e && e->data_ptr() == wte->data_ptr(), c.name << ": " << emb << " is not wte.weight");
  }
}

void run_strategy(ShardingStrategy strategy) {
  for (const int world : {2, 3}) {
    EXPECT_EQ(run_world(world,
                        [&](ProcessGroup& pg) {
                          for (const Config& c : kConfigs) train_and_compare(pg, strategy, c);
                        }),
              "")
        << "world " << world;
  }
}

TEST(TiedFsdp, FullShardTrainsAsOneProcess) { run_strategy(ShardingStrategy::FULL_SHARD); }
TEST(TiedFsdp, ShardGradOpTrainsAsOneProcess) { run_strategy(ShardingStrategy::SHARD_GRAD_OP); }
TEST(TiedFsdp, NoShardTrainsAsOneProcess) { run_strategy(ShardingStrategy::NO_SHARD); }

// The lowest common unit: two blocks inside a picked stage share a tensor
// (nothing outside the stage uses it), so neither block's unit owns it but
// the stage's does; training gives one process's weights.
struct StageImpl : torch::nn::Module {
  StageImpl() {
    const auto shared = torch::randn({tdist::test::kTiedVocab, tdist::test::kTiedWidth}) * 0.3;
    blocks = register_module("blocks", torch::nn::Sequential(TiedBlock(shared), TiedBlock(shared)));
  }
  torch::Tensor forward(torch::Tensor x) { return blocks->forward(x); }
  torch::nn::Sequential blocks{nullptr};
};
TORCH_MODULE(Stage);

struct StagedLmImpl : torch::nn::Module {
  StagedLmImpl() {
    wte = register_module("wte", torch::nn::Embedding(tdist::test::kTiedVocab, tdist::test::kTiedWidth));
    h = register_module("h", torch::nn::Sequential(Stage(), TiedBlock()));
    lm_head = register_module("lm_head", tdist::test::LmHead(wte->weight));
  }
  torch::Tensor forward(torch::Tensor ids) { return lm_head(h->forward(wte(ids))); }
  torch::nn::Embedding wte{nullptr};
  torch::nn::Sequential h{nullptr};
  tdist::test::LmHead lm_head{nullptr};
};
TORCH_MODULE(StagedLm);

TEST(TiedFsdp, ASharedTensorBelongsToTheLowestUnitAroundItsUses) {
  std::map<std::string, torch::Tensor> reference;
  {
    torch::manual_seed(7);
    StagedLm net;
    auto opt = tdist::test::tied_optimizer(tdist::unique_parameters(*net));
    for (int step = 0; step < tdist::test::kTiedSteps; ++step) {
      opt.zero_grad();
      tdist::test::tied_loss(net, tdist::test::tied_batch(step)).backward();
      opt.step();
    }
    for (const auto& p : net->named_parameters()) reference[p.key()] = p.value().detach().clone();
  }
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    o.auto_wrap_policy = tdist::lambda_auto_wrap_policy(
        [](torch::nn::Module& m) { return m.as<TiedBlock>() != nullptr || m.as<Stage>() != nullptr; });
    torch::manual_seed(7);
    tdist::FSDP<StagedLm> model(StagedLm(), o);
    const auto md = model->get_shard_metadata();
    WORLD_CHECK(md.units.size() == 5, md.units.size() << " units");
    size_t owners = 0;
    for (const auto& u : md.units) {
      for (const auto& p : u.params) {
        WORLD_CHECK(p.original_name != "h.0.blocks.1.emb" && p.original_name != "lm_head.weight", p.original_name);
        if (p.original_name == "wte.weight") WORLD_CHECK(u.prefix.empty(), "wte.weight in " << u.prefix);
        if (p.original_name != "h.0.blocks.0.emb") continue;
        ++owners;
        WORLD_CHECK(u.prefix == "module.h.0", "the shared tensor is owned by '" << u.prefix << "'");
        WORLD_CHECK(p.aliases == std::vector<std::string>{"h.0.blocks.1.emb"}, p.aliases.size());
      }
    }
    WORLD_CHECK(owners == 1, owners << " units own the shared tensor");
    auto opt = tdist::test::tied_optimizer(tdist::unique_parameters(*model));
    for (int step = 0; step < tdist::test::kTiedSteps; ++step) {
      opt.zero_grad();
      const auto ids = tdist::test::tied_rows(tdist::test::tied_batch(step), pg.rank(), pg.size());
      tdist::test::tied_loss(model, ids).backward();
      opt.step();
    }
    auto full = model->summon_full_params(/*writeback=*/false);
    size_t compared = 0;
    for (const auto& p : model->named_parameters()) {
      const std::string name = tdist::test::strip_wrappers(p.key());
      const auto it = reference.find(name);
      WORLD_CHECK(it != reference.end(), "no reference parameter " << name);
      const double err = (p.value() - it->second).norm().item<double>() / it->second.norm().item<double>();
      WORLD_CHECK(err <= 1e-5, name << " differs by " << err << " (relative)");
      ++compared;
    }
    WORLD_CHECK(compared == reference.size(), compared << " of " << reference.size());
  }), "");
}

// The second block wrapped by hand owns the tied tensor (as its "emb"); the
// outer wrapper then finds it as its own wte.weight and lm_head.weight.
TEST(TiedFsdp, HandWrappedUnitsSharingAParameterAreRefused) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup&) {
                        tdist::FullyShardedDataParallelOptions o;
                        std::string msg;
                        try {
                          tdist::FSDP<TiedLm> model(TiedLm(true,
                                                           [&](TiedBlock b) {
                                                             return torch::nn::AnyModule(tdist::wrap(b, o));
                                                           }),
                                                    o);
                        } catch (const tdist::UsageError& e) {
                          msg = e.what();
                        }
                        WORLD_CHECK(contains(msg, "'wte.weight'") && contains(msg, "'emb'") &&
                                        contains(msg, "TiedBlock") &&
                                        contains(msg, "wrap the modules that share it in one unit") &&
                                        contains(msg, "auto_wrap_policy"),
                                    msg);
                      }),
            "");
}

}  // namespace
