// Tied parameters in state dicts and checkpoints (FSDP FULL_SHARD, a unit
// per block, the second block using the tied tensor too): the full state
// dict lists every name (one tensor under each), loading takes any
// non-empty subset of a tied tensor's names and refuses two that differ,
// naming both; the optimizer state holds the tied parameter's state once
// (its first name) and loads back; a sharded checkpoint saved at world 2
// consolidates with the tied tensor once and loads at world 3 bit for bit.
// Real processes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/tdist.h"
#include "tests/fsdp/tied_models.h"
#include "tests/util/process.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::test::run_world;
using tdist::test::TempDir;
using tdist::test::TiedBlock;
using tdist::test::TiedLm;

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

tdist::FullyShardedDataParallelOptions options() {
  tdist::FullyShardedDataParallelOptions o;
  o.auto_wrap_policy =
      tdist::lambda_auto_wrap_policy([](torch::nn::Module& m) { return m.as<TiedBlock>() != nullptr; });
  return o;
}

void train(tdist::FSDP<TiedLm>& model, torch::optim::Optimizer& opt, ProcessGroup& pg) {
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    const auto ids = tdist::test::tied_rows(tdist::test::tied_batch(step), pg.rank(), pg.size());
    tdist::test::tied_loss(model, ids).backward();
    opt.step();
  }
}

std::string load_error(torch::nn::Module& m, const tdist::StateDict& state) {
  try {
    tdist::load_full_state_dict(m, state);
  } catch (const tdist::CheckpointError& e) {
    return e.what();
  }
  return "";
}

TEST(TiedState, StateDictsOptimizerStateAndCheckpointsAcrossWorldSizes) {
  TempDir dir;
  const std::string prefix = dir.path() + "/tied";
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    const auto o = options();
    torch::manual_seed(7);
    tdist::FSDP<TiedLm> model(TiedLm(true), o);
    auto opt = tdist::test::tied_optimizer(tdist::unique_parameters(*model));
    train(model, opt, pg);

    // Every name, the tied ones one tensor with the same values.
    const auto full = tdist::full_state_dict(*model, /*rank0_only=*/false);
    TiedLm plain(true);
    WORLD_CHECK(full.size() == plain->named_parameters().size() + plain->named_buffers().size(), full.size());
    for (const auto& name : {"wte.weight", "h.1.emb", "lm_head.weight"}) WORLD_CHECK(full.contains(name), name);
    WORLD_CHECK(torch::equal(full["wte.weight"], full["lm_head.weight"]) &&
                    torch::equal(full["wte.weight"], full["h.1.emb"]),
                "the tied names differ in the full state dict");

    // A subset of the tied names loads (Hugging Face files drop
    // lm_head.weight), into a plain model and back into the FSDP one.
    tdist::StateDict subset;
    for (const auto& item : full) {
      if (item.key() != "lm_head.weight" && item.key() != "h.1.emb") subset.insert(item.key(), item.value().clone());
    }
    tdist::load_full_state_dict(*plain, subset);
    WORLD_CHECK(torch::equal(plain->lm_head->weight, full["wte.weight"]) &&
                    plain->lm_head->weight.data_ptr() == plain->wte->weight.data_ptr(),
                "plain model after a subset load");
    tdist::StateDict only_head;
    for (const auto& item : full) {
      if (item.key() != "wte.weight" && item.key() != "h.1.emb") only_head.insert(item.key(), item.value().clone());
    }
    tdist::load_full_state_dict(*model, only_head);
    WORLD_CHECK(torch::equal(tdist::full_state_dict(*model, false)["h.1.emb"], full["wte.weight"]), "reload");

    // Two tied names with different values are refused, naming both.
    tdist::StateDict differ;
    for (const auto& item : full) differ.insert(item.key(), item.value().clone());
    differ["lm_head.weight"].add_(1);
    const std::string msg = load_error(*plain, differ);
    WORLD_CHECK(contains(msg, "'wte.weight'") && contains(msg, "'lm_head.weight'"), msg);
    WORLD_CHECK(contains(load_error(*model, differ), "'lm_head.weight'"), "FSDP load of differing tied names");
    tdist::StateDict none = subset;
    none.erase("wte.weight");
    WORLD_CHECK(contains(load_error(*model, none), "no 'wte.weight'"), load_error(*model, none));

    // The optimizer state holds the tied parameter once, and loads back.
    const auto ostate = tdist::full_optimizer_state_dict(*model, opt, /*rank0_only=*/false);
    WORLD_CHECK(ostate.state.contains("wte.weight") && !ostate.state.contains("lm_head.weight") &&
                    !ostate.state.contains("h.1.emb"),
                "optimizer state keys: " << ostate.state.size());
    tdist::load_full_optimizer_state_dict(*model, opt, ostate);
    const auto again = tdist::full_optimizer_state_dict(*model, opt, false);
    WORLD_CHECK(torch::equal(again.state["wte.weight"]["exp_avg"], ostate.state["wte.weight"]["exp_avg"]), "exp_avg");

    tdist::save_sharded_checkpoint(prefix, pg, *model, &opt);
  }), "");

  // Consolidated: the tied tensor once, under its first name.
  tdist::ConsolidateOptions with_optimizer;
  with_optimizer.optimizer = true;
  const std::string consolidated =
      tdist::consolidate_sharded_model_checkpoints(prefix, "_rank-*-of-*.pt", "", with_optimizer);
  const auto saved = tdist::load_consolidated_checkpoint(consolidated);
  ASSERT_TRUE(saved.model.contains("wte.weight"));
  EXPECT_FALSE(saved.model.contains("lm_head.weight"));
  EXPECT_FALSE(saved.model.contains("h.1.emb"));
  ASSERT_TRUE(saved.has_optimizer);

  // Resharded for 3 ranks, and loaded at 3 (straight and resharded): the
  // same bits, the tied names one tensor.
  const std::string resharded = dir.path() + "/tied3";
  tdist::reshard_sharded_checkpoint(prefix, "_rank-*-of-*.pt", 3, resharded);
  EXPECT_EQ(run_world(3, [&](ProcessGroup& pg) {
    for (const std::string& from : {prefix, resharded}) {
      const auto o = options();
      torch::manual_seed(99);  // other weights: the checkpoint must set them
      tdist::FSDP<TiedLm> model(TiedLm(true), o);
      auto opt = tdist::test::tied_optimizer(tdist::unique_parameters(*model));
      tdist::load_sharded_checkpoint(from, pg, *model, &opt);
      const auto full = tdist::full_state_dict(*model, false);
      for (const auto& item : full) {
        const std::string first =
            item.key() == "lm_head.weight" || item.key() == "h.1.emb" ? "wte.weight" : item.key();
        WORLD_CHECK(torch::equal(item.value(), saved.model[first]), from << ": " << item.key() << " differs");
      }
      const auto ostate = tdist::full_optimizer_state_dict(*model, opt, false);
      WORLD_CHECK(ostate.state.size() == saved.optimizer.state.size(), from << ": optimizer state size");
      for (const auto& field : {"exp_avg", "exp_avg_sq"}) {
        WORLD_CHECK(torch::equal(ostate.state["wte.weight"][field], saved.optimizer.state["wte.weight"][field]),
                    from << ": " << field);
      }
      const auto named = model->named_parameters();
      WORLD_CHECK(named["module.wte.weight"].data_ptr() == named["module.lm_head.weight"].data_ptr(), from);
    }
  }), "");
}

}  // namespace
