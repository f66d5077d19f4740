// auto_wrap_policy on a model written as a new user would (blocks in a
// torch::nn::Sequential): by size, by type and by predicate it makes a
// unit per block, printing shows them, and training gives the weights of
// one process on the whole batch; auto_wrapper_callable adds activation
// checkpointing; wrap() builds units while the model is constructed; a
// policy that picks a module no wrapper can take over gets an error naming
// it. Real processes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <sstream>

#include "tdist/tdist.h"
#include "tests/fsdp/models.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::test::run_world;

struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl() : fc1(register_module("fc1", torch::nn::Linear(8, 16))), fc2(register_module("fc2", torch::nn::Linear(16, 8))) {}
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::relu(fc1(x))); }  // 280 parameters
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MlpBlock);

struct UserNetImpl : torch::nn::Module {
  // wrap_while_building: each block goes in through tdist::wrap(block, *o).
  explicit UserNetImpl(const tdist::FullyShardedDataParallelOptions* wrap_while_building = nullptr) {
    in = register_module("in", torch::nn::Linear(6, 8));
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int i = 0; i < 3; ++i) {
      if (wrap_while_building) {
        blocks->push_back(tdist::wrap(MlpBlock(), *wrap_while_building));
      } else {
        blocks->push_back(MlpBlock());
      }
    }
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return head(blocks->forward(in(x))); }
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::Sequential blocks{nullptr};
};
TORCH_MODULE(UserNet);

constexpr int kSteps = 8;
constexpr int kBatch = 12;

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(1000 + step);
  return {torch::randn({kBatch, 6}), torch::randn({kBatch, 3})};
}

std::map<std::string, torch::Tensor> train_reference() {
  torch::manual_seed(7);
  UserNet net;
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto [x, y] = batch(step);
    torch::mse_loss(net(x), y).backward();
    opt.step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Builds with `o` (and wrap() when building), checks the units, trains,
// compares with one process.
void train_and_compare(ProcessGroup& pg, const tdist::FullyShardedDataParallelOptions& o, bool build_with_wrap,
                       size_t checkpoints) {
  const auto reference = train_reference();
  torch::manual_seed(7);
  tdist::FSDP<UserNet> model(UserNet(build_with_wrap ? &o : nullptr), o);
  std::ostringstream printed;
  printed << *model;
  WORLD_CHECK(count(printed.str(), "tdist::FullyShardedDataParallel(") == 4, printed.str());
  WORLD_CHECK(count(printed.str(), "tdist::CheckpointModule") == checkpoints, printed.str());
  const auto md = model->get_shard_metadata();
  WORLD_CHECK(md.units.size() == 4, md.units.size());
  for (size_t u = 1; u < 4; ++u) {
    WORLD_CHECK(md.units[u].prefix == "module.blocks." + std::to_string(u - 1), md.units[u].prefix);
    WORLD_CHECK(md.units[u].params.size() == 4, md.units[u].params.size());
    WORLD_CHECK(md.units[u].params[0].original_name == "blocks." + std::to_string(u - 1) + ".fc1.weight",
                md.units[u].params[0].original_name);
  }
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  const int64_t rows = kBatch / pg.size();
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto [x, y] = batch(step);
    torch::mse_loss(model(x.narrow(0, pg.rank() * rows, rows)), y.narrow(0, pg.rank() * rows, rows)).backward();
    opt.step();
  }
  auto full = model->summon_full_params(/*writeback=*/false);
  size_t compared = 0;
  for (const auto& info : md.units) {
    for (const auto& p : info.params) {
      auto it = reference.find(p.original_name);
      WORLD_CHECK(it != reference.end(), "no reference parameter " << p.original_name);
      const auto mine = model->named_parameters()[p.name];
      const double err = (mine - it->second).norm().item<double>() / it->second.norm().item<double>();
      WORLD_CHECK(err <= 1e-5, p.original_name << " differs by " << err);
      ++compared;
    }
  }
  WORLD_CHECK(compared == reference.size(), compared << " of " << reference.size());
}

TEST(AutoWrap, ByTypeMakesAUnitPerBlockAndTrainsAsOneProcess) {
  tdist::FullyShardedDataParallelOptions o;
  o.auto_wrap_policy = tdist::transformer_auto_wrap_policy<MlpBlock>();
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) { train_and_compare(pg, o, false, 0); }), "");
}

TEST(AutoWrap, ByTypeNameAndByPredicate) {
  tdist::FullyShardedDataParallelOptions by_name;
  by_name.auto_wrap_policy = tdist::transformer_auto_wrap_policy({MlpBlockImpl().name()});
  tdist::FullyShardedDataParallelOptions by_lambda;
  by_lambda.auto_wrap_policy =
      tdist::lambda_auto_wrap_policy([](torch::nn::Module& m) { return m.as<MlpBlock>() != nullptr; });
  EXPECT_EQ(run_world(3,
                      [&](ProcessGroup& pg) {
                        train_and_compare(pg, by_name, false, 0);
                        train_and_compare(pg, by_lambda, false, 0);
                      }),
            "");
}

TEST(AutoWrap, BySizeMakesAUnitPerBlockAndTrainsAsOneProcess) {
  tdist::FullyShardedDataParallelOptions o;
  o.auto_wrap_policy = tdist::size_based_auto_wrap_policy(200);  // a block: 280; its layers 144, 136
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) { train_and_compare(pg, o, false, 0); }), "");
}

TEST(AutoWrap, WrapperCallableAddsCheckpointing) {
  tdist::FullyShardedDataParallelOptions o;
  o.auto_wrap_policy = tdist::transformer_auto_wrap_policy<MlpBlock>();
  o.auto_wrapper_callable = [](torch::nn::AnyModule m, const tdist::FullyShardedDataParallelOptions& c) {
    return torch::nn::AnyModule(tdist::FullyShardedDataParallel(tdist::checkpoint_module(std::move(m)), c));
  };
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) { train_and_compare(pg, o, false, 3); }), "");
}

TEST(AutoWrap, WrapWhileBuildingTheModel) {
  tdist::FullyShardedDataParallelOptions o;  // no policy: the blocks are wrapped as they are built
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) { train_and_compare(pg, o, true, 0); }), "");
}

// The error, on every rank, before anything is sharded by the outer wrapper.
std::string wrap_error(const std::function<void()>& build) {
  try {
    build();
  } catch (const tdist::UsageError& e) {
    return e.what();
  }
  return "no error";
}

TEST(AutoWrap, PickingAModuleNoWrapperCanTakeOverIsAnError) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup&) {
                        tdist::FullyShardedDataParallelOptions small;
                        small.auto_wrap_policy = tdist::size_based_auto_wrap_policy(100);  // picks the Linears
                        std::string e = wrap_error([&] { tdist::FSDP<UserNet> m(UserNet(), small); });
                        WORLD_CHECK(e.find("'blocks.0.fc1'") != std::string::npos, e);
                        WORLD_CHECK(e.find("a member of 'blocks.0' (") != std::string::npos, e);
                        WORLD_CHECK(e.find("torch::nn::Sequential") != std::string::npos, e);

                        tdist::FullyShardedDataParallelOptions head;
                        head.auto_wrap_policy = tdist::lambda_auto_wrap_policy(
                            [](torch::nn::Module& m) { return m.as<torch::nn::Linear>() && m.parameters()[0].size(0) == 3; });
                        e = wrap_error([&] { tdist::FSDP<UserNet> m(UserNet(), head); });
                        WORLD_CHECK(e.find("'head'") != std::string::npos, e);

                        // A ModuleList entry is called through as<T>(): refused too.
                        struct ListNetImpl : torch::nn::Module {
                          ListNetImpl() { list = register_module("list", torch::nn::ModuleList(MlpBlock(), MlpBlock())); }
                          torch::Tensor forward(torch::Tensor x) {
                            for (const auto& b : *list) x = b->as<MlpBlockImpl>()->forward(x);
                            return x;
                          }
                          torch::nn::ModuleList list{nullptr};
                        };
                        tdist::FullyShardedDataParallelOptions blocks;
                        blocks.auto_wrap_policy = tdist::transformer_auto_wrap_policy<MlpBlock>();
                        e = wrap_error([&] {
                          tdist::FSDP<torch::nn::ModuleHolder<ListNetImpl>> m(
                              torch::nn::ModuleHolder<ListNetImpl>(std::make_shared<ListNetImpl>()), blocks);
                        });
                        WORLD_CHECK(e.find("'list.0'") != std::string::npos && e.find("ModuleList") != std::string::npos, e);
                      }),
            "");
}

}  // namespace
