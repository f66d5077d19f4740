// State dicts by the unwrapped model's names: an FSDP model's full state
// is the plain model's (same names, same values, buffers included), loads
// into the plain module, and a full state loads into FSDP at any world
// size; the sharded state round-trips at its own world size only; DDP and
// checkpoint_module leave no "module." in the names; bad states are named
// and change nothing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/tdist.h"
#include "tests/fsdp/models.h"
#include "tests/util/world.h"

namespace {

using tdist::CheckpointError;
using tdist::FSDP;
using tdist::ProcessGroup;
using tdist::StateDict;
using tdist::test::Net;
using tdist::test::run_world;

// models.h's Net (units per block, a frozen parameter, a 0-d one) with a
// BatchNorm for buffers.
struct BnNetImpl : torch::nn::Module {
  explicit BnNetImpl(const tdist::FullyShardedDataParallelOptions* wrap_blocks = nullptr)
      : net(register_module("net", Net(wrap_blocks))), bn(register_module("bn", torch::nn::BatchNorm1d(3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return bn(net(x)); }
  Net net;
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(BnNet);

StateDict plain_state(torch::nn::Module& m) {
  StateDict out;
  for (const auto& p : m.named_parameters()) out.insert(p.key(), p.value().detach().clone());
  for (const auto& b : m.named_buffers()) out.insert(b.key(), b.value().detach().clone());
  return out;
}

void expect_same(const StateDict& a, const StateDict& b, const std::string& what) {
  WORLD_CHECK(a.size() == b.size(), what << ": " << a.size() << " entries against " << b.size());
  for (const auto& item : a) {
    const at::Tensor* other = b.find(item.key());
    WORLD_CHECK(other != nullptr, what << ": no '" << item.key() << "'");
    WORLD_CHECK(torch::equal(item.value(), *other), what << ": '" << item.key() << "' differs");
  }
}

// A few Adam steps so that nothing is at its initial value.
template <typename M>
void train(M& model, ProcessGroup& pg, int steps) {
  torch::optim::Adam opt(model->parameters(), 0.01);
  for (int s = 0; s < steps; ++s) {
    torch::manual_seed(40 + s);
    const auto x = torch::randn({4 * pg.size(), 6}).narrow(0, 4 * pg.rank(), 4);
    opt.zero_grad();
    model(x).pow(2).sum().backward();
    opt.step();
  }
}

class StateDicts : public ::testing::TestWithParam<std::tuple<int, tdist::ShardingStrategy>> {};

TEST_P(StateDicts, FullStateIsThePlainModelsAndLoadsIntoIt) {
  const auto [world, strategy] = GetParam();
  EXPECT_EQ(run_world(world, [s = strategy](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    o.sharding_strategy = s;
    torch::manual_seed(1);
    FSDP<BnNet> model(BnNet(&o), o);
    train(model, pg, 3);
    const StateDict full = tdist::full_state_dict(*model);
    const StateDict everywhere = tdist::full_state_dict(*model, /*rank0_only=*/false);
    WORLD_CHECK(pg.rank() == 0 ? full.size() > 0 : full.size() == 0, "rank0_only: " << full.size());
    // The same values as summon_full_params shows, under the plain names.
    BnNet plain;
    StateDict summoned;
    {
      auto guard = model->summon_full_params(/*writeback=*/false);
      const auto md = model->get_shard_metadata();
      std::map<std::string, std::string> original;
      for (const auto& u : md.units) {
        for (const auto& p : u.params) original[p.name] = p.original_name;
      }
      for (const auto& p : model->named_parameters()) summoned.insert(original.at(p.key()), p.value().detach().clone());
    }
    const StateDict want = plain_state(*plain);
    WORLD_CHECK(summoned.size() == plain->parameters().size(), "summoned " << summoned.size());
    WORLD_CHECK(everywhere.size() == want.size(), "entries " << everywhere.size() << " vs " << want.size());
    size_t i = 0;
    for (const auto& item : want) {
      WORLD_CHECK(everywhere.keys()[i++] == item.key(), "order: " << item.key());
      const at::Tensor& got = everywhere[item.key()];
      WORLD_CHECK(got.sizes() == item.value().sizes(), item.key());
      if (const at::Tensor* v = summoned.find(item.key())) WORLD_CHECK(torch::equal(got, *v), item.key());
    }
    WORLD_CHECK(everywhere["bn.running_mean"].abs().sum().item<double>() > 0, "buffers trained");
    if (pg.rank() == 0) expect_same(full, everywhere, "rank 0");
    // Into the plain module: the same forward.
    tdist::load_full_state_dict(*plain, everywhere);
    model->eval();
    plain->eval();
    const auto x = torch::randn({5, 6});
    WORLD_CHECK(torch::allclose(model(x), plain(x), 1e-6, 1e-6), "plain module forward differs");
  }), "");
}

TEST_P(StateDicts, AFullStateLoadsAtAnyWorldSize) {
  const auto [world, strategy] = GetParam();
  EXPECT_EQ(run_world(world, [s = strategy](ProcessGroup& pg) {
    // The state of one process's trained model...
    torch::manual_seed(2);
    BnNet alone;
    {
      torch::optim::SGD opt(alone->parameters(), 0.1);
      alone(torch::randn({4, 6})).sum().backward();
      opt.step();
    }
    const StateDict want = plain_state(*alone);
    // ...into an FSDP model made from another seed.
    tdist::FullyShardedDataParallelOptions o;
    o.sharding_strategy = s;
    torch::manual_seed(3);
    FSDP<BnNet> model(BnNet(&o), o);
    tdist::load_full_state_dict(*model, want);
    expect_same(tdist::full_state_dict(*model, false), want, "after loading");
    train(model, pg, 1);  // and it trains on from there, the same everywhere
    const StateDict trained = tdist::full_state_dict(*model, false);
    WORLD_CHECK(!torch::equal(trained["net.head.weight"], want["net.head.weight"]), "no training after the load");
    const at::Tensor head = trained["net.head.weight"].clone();
    at::Tensor first = head.clone();
    pg.broadcast(first)->wait();
    WORLD_CHECK(torch::equal(first, head), "the ranks differ after training on");
  }), "");
}

TEST_P(StateDicts, TheShardedStateRoundTripsAtItsWorldSize) {
  const auto [world, strategy] = GetParam();
  EXPECT_EQ(run_world(world, [s = strategy](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    o.sharding_strategy = s;
    torch::manual_seed(1);
    FSDP<BnNet> model(BnNet(&o), o);
    train(model, pg, 2);
    const StateDict full = tdist::full_state_dict(*model, false);
    tdist::ShardedStateDict local = tdist::sharded_state_dict(*model);
    WORLD_CHECK(local.metadata.world_size == pg.size() && local.metadata.rank == pg.rank(), "metadata");
    for (auto& item : local.tensors) item.value() = item.value().clone();  // kept apart from the model
    train(model, pg, 2);
    tdist::load_sharded_state_dict(*model, local);
    expect_same(tdist::full_state_dict(*model, false), full, "after loading the sharded state");
    tdist::ShardedStateDict other = local;
    if (pg.size() > 1) {  // another rank's state at the same world size
      other.metadata.rank = (pg.rank() + 1) % pg.size();
      try {
        tdist::load_sharded_state_dict(*model, other);
        WORLD_CHECK(false, "another rank's sharded state loaded");
      } catch (const CheckpointError& e) {
        WORLD_CHECK(std::string(e.what()).find("rank " + std::to_string(other.metadata.rank)) != std::string::npos,
                    e.what());
      }
      expect_same(tdist::full_state_dict(*model, false), full, "after a refused load");
    }
    other.metadata.rank = (pg.rank() + 1) % pg.size();
    other.metadata.world_size = pg.size() + 1;
    try {
      tdist::load_sharded_state_dict(*model, other);
      WORLD_CHECK(false, "another world's sharded state loaded");
    } catch (const CheckpointError& e) {
      WORLD_CHECK(std::string(e.what()).find("of " + std::to_string(pg.size() + 1)) != std::string::npos, e.what());
    }
  }), "");
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<int, tdist::ShardingStrategy>>& info) {
  static const char* const kNames[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"};
  return "world" + std::to_string(std::get<0>(info.param)) + "_" + kNames[static_cast<int>(std::get<1>(info.param))];
}

INSTANTIATE_TEST_SUITE_P(Strategies, StateDicts,
                         ::testing::Values(std::make_tuple(1, tdist::ShardingStrategy::FULL_SHARD),
                                           std::make_tuple(2, tdist::ShardingStrategy::FULL_SHARD),
                                           std::make_tuple(3, tdist::ShardingStrategy::FULL_SHARD),
                                           std::make_tuple(4, tdist::ShardingStrategy::FULL_SHARD),
                                           std::make_tuple(2, tdist::ShardingStrategy::SHARD_GRAD_OP),
                                           std::make_tuple(2, tdist::ShardingStrategy::NO_SHARD)),
                         case_name);

TEST(StateDictNames, DdpAndCheckpointModuleLeaveNoWrapperSteps) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    torch::manual_seed(4);
    tdist::DistributedDataParallel<BnNet> ddp{BnNet()};
    BnNet plain;
    const StateDict s = tdist::full_state_dict(*ddp);
    WORLD_CHECK(s.keys() == plain_state(*plain).keys(), "DDP names");
    auto ckpt = tdist::checkpoint_module(BnNet());
    WORLD_CHECK(tdist::full_state_dict(*ckpt).keys() == plain_state(*plain).keys(), "checkpoint_module names");
    tdist::load_full_state_dict(*plain, s);
    for (const auto& p : plain->named_parameters()) WORLD_CHECK(torch::equal(p.value(), s[p.key()]), p.key());
  }), "");
}

TEST(StateDictDtypes, MixedPrecisionBuffersComeOutInTheirOwnDtype) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    o.mixed_precision.param_dtype = at::kBFloat16;
    o.mixed_precision.buffer_dtype = at::kBFloat16;
    torch::manual_seed(1);
    FSDP<BnNet> model(BnNet(&o), o);
    train(model, pg, 2);
    const auto live = model->named_buffers();
    WORLD_CHECK(live["module.bn.running_mean"].scalar_type() == at::kBFloat16, "the live buffer is bf16");
    const StateDict full = tdist::full_state_dict(*model, false);
    const auto sharded = tdist::sharded_state_dict(*model);
    for (const char* name : {"bn.running_mean", "bn.running_var", "net.head.weight"}) {
      WORLD_CHECK(full[name].scalar_type() == at::kFloat, name << " is " << full[name].scalar_type());
      WORLD_CHECK(sharded.tensors[name].scalar_type() == at::kFloat, name << " (sharded)");
    }
    WORLD_CHECK(torch::equal(full["bn.running_mean"], live["module.bn.running_mean"].to(at::kFloat)), "values");
    WORLD_CHECK(full["bn.num_batches_tracked"].scalar_type() == at::kLong, "an integer buffer stays");
    BnNet plain;
    tdist::load_full_state_dict(*plain, full);
    WORLD_CHECK(torch::equal(plain->bn->running_mean, full["bn.running_mean"]), "into the plain module");
  }), "");
}

TEST(StateDictErrors, ABadStateIsNamedAndChangesNothing) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(1);
    FSDP<BnNet> model(BnNet(&o), o);
    const StateDict before = tdist::full_state_dict(*model, false);
    const auto expect_error = [&](const StateDict& bad, const std::string& says, bool strict) {
      try {
        tdist::load_full_state_dict(*model, bad, strict);
        WORLD_CHECK(false, "loaded: " << says);
      } catch (const CheckpointError& e) {
        WORLD_CHECK(std::string(e.what()).find(says) != std::string::npos, e.what());
      }
      expect_same(tdist::full_state_dict(*model, false), before, "after a refused load");
    };
    StateDict missing = before;
    missing.erase("net.head.weight");
    expect_error(missing, "no 'net.head.weight'", true);
    StateDict wrong = before;
    wrong["net.block1.fc1.weight"] = torch::zeros({3, 3});  // zeroing everything before it, were it copied
    for (auto& item : wrong) {
      if (item.key() != "net.block1.fc1.weight") item.value() = torch::zeros_like(item.value());
    }
    expect_error(wrong, "'net.block1.fc1.weight' is [3, 3] in the state but [5, 7]", true);
    StateDict extra = before;
    extra.insert("net.nothing", torch::ones({1}));
    expect_error(extra, "'net.nothing' is not in the model", true);
    tdist::load_full_state_dict(*model, extra, /*strict=*/false);
  }), "");
}

}  // namespace
