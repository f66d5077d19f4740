// Optimizer state dicts by parameter name: FSDP's full Adam state is one
// process's Adam state on the whole batch; full states move between world
// sizes exactly (2 -> 1 -> 2 here, through per-rank groups of one); a
// sharded state resumes training bit for bit; every supported optimizer's
// state and options round-trip; bad states are named and change nothing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/tdist.h"
#include "tests/fsdp/models.h"
#include "tests/util/world.h"

namespace {

using tdist::CheckpointError;
using tdist::FSDP;
using tdist::OptimizerStateDict;
using tdist::ProcessGroup;
using tdist::test::Net;
using tdist::test::run_world;

at::Tensor batch(int step, int world) {
  torch::manual_seed(60 + step);
  return torch::randn({4 * world, 6});
}

// Step s of a batch of 4 rows for each of `batch_ranks` ranks, on a model
// of `world` ranks (this is `rank`), which takes batch_ranks / world of
// those blocks: the loss divided by that many, so that the gradient (FSDP
// averages over its ranks) is the same at every world size.
template <typename M>
void step(M& model, torch::optim::Optimizer& opt, int s, int world, int rank, int batch_ranks) {
  const int blocks = batch_ranks / world;
  const auto x = batch(s, batch_ranks).narrow(0, 4 * rank * blocks, 4 * blocks);
  opt.zero_grad();
  (model(x).pow(2).sum() / blocks).backward();
  opt.step();
}

double max_relative(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

void expect_same_state(const OptimizerStateDict& a, const OptimizerStateDict& b, double tolerance,
                       const std::string& what) {
  WORLD_CHECK(a.state.size() == b.state.size(), what << ": " << a.state.size() << " vs " << b.state.size());
  for (const auto& item : a.state) {
    const auto* other = b.state.find(item.key());
    WORLD_CHECK(other != nullptr, what << ": no state for " << item.key());
    WORLD_CHECK(item.value().size() == other->size(), what << ": fields of " << item.key());
    for (const auto& f : item.value()) {
      const at::Tensor* g = other->find(f.key());
      WORLD_CHECK(g != nullptr, what << ": " << item.key() << " has no " << f.key());
      const bool same = tolerance == 0 ? torch::equal(f.value(), *g) : max_relative(f.value(), *g) <= tolerance;
      WORLD_CHECK(same, what << ": " << item.key() << "." << f.key() << " differs");
    }
  }
  WORLD_CHECK(a.param_groups.size() == b.param_groups.size(), what << ": groups");
  for (size_t g = 0; g < a.param_groups.size(); ++g) {
    WORLD_CHECK(a.param_groups[g].params == b.param_groups[g].params, what << ": group " << g << " params");
    WORLD_CHECK(a.param_groups[g].options == b.param_groups[g].options, what << ": group " << g << " options");
  }
}

class FullOptimizerState : public ::testing::TestWithParam<int> {};

TEST_P(FullOptimizerState, IsOneProcesssAdamStateOnTheWholeBatch) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup& pg) {
    const int world = pg.size();
    torch::manual_seed(1);
    Net alone;
    torch::optim::Adam alone_opt(alone->parameters(), torch::optim::AdamOptions(0.01).amsgrad(true));
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(1);
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01).amsgrad(true));
    for (int s = 0; s < 3; ++s) {
      step(alone, alone_opt, s, 1, 0, world);
      step(model, opt, s, world, pg.rank(), world);
    }
    const OptimizerStateDict want = tdist::full_optimizer_state_dict(*alone, alone_opt);
    const OptimizerStateDict got = tdist::full_optimizer_state_dict(*model, opt);
    if (pg.rank() != 0) {
      WORLD_CHECK(got.state.size() == 0, "rank0_only");
      return;
    }
    WORLD_CHECK(want.state.contains("block1.fc1.weight") && want.state["block1.fc1.weight"].contains("max_exp_avg_sq"),
                "the reference state");
    WORLD_CHECK(!want.state.contains("block1.gate"), "a frozen parameter has no state");
    expect_same_state(got, want, 1e-5, "FSDP against one process");
  }), "");
}

INSTANTIATE_TEST_SUITE_P(Worlds, FullOptimizerState, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(FullOptimizerStateMoves, BetweenWorldSizesExactly) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(1);
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    for (int s = 0; s < 2; ++s) step(model, opt, s, 2, pg.rank(), 2);
    const auto model_state = tdist::full_state_dict(*model, false);
    const auto opt_state = tdist::full_optimizer_state_dict(*model, opt, false);
    // Into a world of one (each rank a group of its own)...
    auto first = pg.new_group({0});  // collective: both ranks make both
    auto second = pg.new_group({1});
    auto self = pg.rank() == 0 ? first : second;
    tdist::FullyShardedDataParallelOptions one;
    one.process_group = self;
    torch::manual_seed(9);
    FSDP<Net> small(Net(&one), one);
    torch::optim::Adam small_opt(small->parameters(), 0.5);
    tdist::load_full_state_dict(*small, model_state);
    tdist::load_full_optimizer_state_dict(*small, small_opt, opt_state);
    expect_same_state(tdist::full_optimizer_state_dict(*small, small_opt), opt_state, 0, "at world 1");
    // ...one step there and one at world 2 agree...
    step(small, small_opt, 2, 1, 0, 2);
    step(model, opt, 2, 2, pg.rank(), 2);
    expect_same_state(tdist::full_optimizer_state_dict(*small, small_opt),
                      tdist::full_optimizer_state_dict(*model, opt, false), 1e-5, "a step later");
    // ...and back to world 2, exactly.
    const auto back = tdist::full_optimizer_state_dict(*small, small_opt);
    tdist::load_full_optimizer_state_dict(*model, opt, back);
    expect_same_state(tdist::full_optimizer_state_dict(*model, opt, false), back, 0, "back at world 2");
  }), "");
}

TEST(ShardedOptimizerState, ResumesBitForBit) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(1);
    FSDP<Net> model(Net(&o), o);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int s = 0; s < 2; ++s) step(model, opt, s, 2, pg.rank(), 2);
    auto model_state = tdist::sharded_state_dict(*model);
    for (auto& t : model_state.tensors) t.value() = t.value().clone();
    auto opt_state = tdist::sharded_optimizer_state_dict(*model, opt);
    for (auto& p : opt_state.state) {
      for (auto& f : p.value()) f.value() = f.value().clone();
    }
    for (int s = 2; s < 5; ++s) step(model, opt, s, 2, pg.rank(), 2);
    // Another world's or rank's sharded state is refused.
    for (const auto& [world, rank] : {std::make_pair(3, pg.rank()), std::make_pair(2, 1 - pg.rank())}) {
      auto other = opt_state;
      other.world_size = world;
      other.rank = rank;
      try {
        tdist::load_sharded_optimizer_state_dict(*model, opt, other);
        WORLD_CHECK(false, "rank " << rank << " of " << world << "'s state loaded");
      } catch (const CheckpointError& e) {
        const std::string says = "the state is rank " + std::to_string(rank) + " of " + std::to_string(world);
        WORLD_CHECK(std::string(e.what()).find(says) != std::string::npos, e.what());
      }
    }
    const auto straight = tdist::full_state_dict(*model, false);
    tdist::load_sharded_state_dict(*model, model_state);
    tdist::load_sharded_optimizer_state_dict(*model, opt, opt_state);
    for (int s = 2; s < 5; ++s) step(model, opt, s, 2, pg.rank(), 2);
    const auto resumed = tdist::full_state_dict(*model, false);
    for (const auto& item : straight) {
      WORLD_CHECK(torch::equal(item.value(), resumed[item.key()]), item.key() << " differs after the resume");
    }
  }), "");
}

// Each optimizer's state and options survive a round trip into a fresh one.
template <typename Opt, typename Options>
void round_trip(const Options& options, const std::string& what) {
  torch::manual_seed(5);
  Net a, b;
  Opt opt_a(a->parameters(), options);
  for (int s = 0; s < 2; ++s) step(a, opt_a, s, 1, 0, 1);
  const auto state = tdist::full_optimizer_state_dict(*a, opt_a);
  WORLD_CHECK(state.state.size() > 0, what);
  Opt opt_b(b->parameters(), Options(0.5));
  tdist::load_full_optimizer_state_dict(*b, opt_b, state);
  expect_same_state(tdist::full_optimizer_state_dict(*b, opt_b), state, 0, what);
}

TEST(OptimizerKinds, EachRoundTrips) {
  EXPECT_EQ(run_world(1, [](ProcessGroup&) {
    round_trip<torch::optim::Adam>(torch::optim::AdamOptions(0.01).betas({0.8, 0.99}).weight_decay(0.1), "Adam");
    round_trip<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01).amsgrad(true), "AdamW");
    round_trip<torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true), "SGD");
    round_trip<torch::optim::RMSprop>(torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true), "RMSprop");
    round_trip<torch::optim::Adagrad>(torch::optim::AdagradOptions(0.1).lr_decay(0.01), "Adagrad");
  }), "");
}

TEST(OptimizerStateErrors, ABadStateIsNamedAndChangesNothing) {
  EXPECT_EQ(run_world(1, [](ProcessGroup&) {
    torch::manual_seed(5);
    Net net;
    torch::optim::Adam opt(net->parameters(), 0.01);
    step(net, opt, 0, 1, 0, 1);
    const auto good = tdist::full_optimizer_state_dict(*net, opt);
    const auto expect_error = [&](const OptimizerStateDict& bad, const std::string& says) {
      try {
        tdist::load_full_optimizer_state_dict(*net, opt, bad);
        WORLD_CHECK(false, "loaded: " << says);
      } catch (const CheckpointError& e) {
        WORLD_CHECK(std::string(e.what()).find(says) != std::string::npos, e.what());
      }
      expect_same_state(tdist::full_optimizer_state_dict(*net, opt), good, 0, "after a refused load");
    };
    OptimizerStateDict renamed = good;
    renamed.param_groups[0].params[1] = "elsewhere";
    expect_error(renamed, "holds 'elsewhere'");
    OptimizerStateDict wrong = good;
    wrong.state["head.weight"] = good.state["head.weight"];
    wrong.state["head.weight"]["exp_avg"] = torch::zeros({2, 2});
    expect_error(wrong, "the exp_avg of 'head.weight' is [2, 2]");
    OptimizerStateDict no_groups = good;
    no_groups.param_groups.clear();
    expect_error(no_groups, "0 param groups");
    OptimizerStateDict other_kind = good;
    other_kind.optimizer = "SGD";
    expect_error(other_kind, "the state is SGD's, the optimizer Adam");
    OptimizerStateDict stranger = good;
    stranger.state.insert("nowhere.weight", good.state["head.weight"]);
    expect_error(stranger, "'nowhere.weight' is no parameter the optimizer steps");
    OptimizerStateDict changed_options = good;  // refused for another reason: the options stay too
    changed_options.param_groups[0].options["lr"] = 7;
    changed_options.optimizer = "RMSprop";
    expect_error(changed_options, "RMSprop's");
    torch::optim::LBFGS lbfgs(net->parameters());
    try {
      tdist::full_optimizer_state_dict(*net, lbfgs);
      WORLD_CHECK(false, "LBFGS");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(std::string(e.what()).find("none of Adam") != std::string::npos, e.what());
    }
  }), "");
}

}  // namespace
