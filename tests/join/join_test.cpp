// Join in real processes, at worlds 2-4, with uneven inputs (one rank with
// none, ranks that run out together): a user's joinable counts every input
// of every rank and knows who joined last; DDP and FSDP end with the
// weights of one process trained on each iteration's inputs of the ranks
// that still had some (their gradients averaged over the world, or over
// those ranks); throw_on_early_termination stops every rank, naming the
// first to run out; misuse is named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tdist/tdist.h"
#include "tests/fsdp/models.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::test::Net;
using tdist::test::run_world;

// Inputs per rank: rank 2 has none; at world 4 ranks 0 and 3 run out last,
// together.
int inputs_of(int rank) {
  const int counts[] = {5, 2, 0, 5};
  return counts[rank];
}

int most_inputs(int world) {
  int m = 0;
  for (int r = 0; r < world; ++r) m = std::max(m, inputs_of(r));
  return m;
}

std::pair<torch::Tensor, torch::Tensor> batch(int rank, int step) {
  torch::manual_seed(1000 + 100 * rank + step);
  return {torch::randn({4, 6}), torch::randn({4, 3})};
}

// ---- a user's joinable ---------------------------------------------------------------

// PyTorch's example: every iteration all-reduces a one per rank that has an
// input, so every rank ends with the number of inputs of all ranks.
class Counter : public tdist::Joinable {
 public:
  explicit Counter(std::shared_ptr<ProcessGroup> pg) : pg_(std::move(pg)) {}
  void step() {
    tdist::Join::notify_join_context(*this);
    add(torch::ones({1}, torch::kLong));
  }
  std::unique_ptr<tdist::JoinHook> join_hook(const tdist::JoinOptions&) override {
    return std::make_unique<Hook>(*this);
  }
  std::shared_ptr<ProcessGroup> join_process_group() override { return pg_; }

  int64_t total = 0;
  int shadowed = 0;
  std::optional<bool> last_joiner;

 private:
  struct Hook : tdist::JoinHook {
    explicit Hook(Counter& c) : c(c) {}
    void main_hook() override {
      c.add(torch::zeros({1}, torch::kLong));
      ++c.shadowed;
    }
    void post_hook(bool is_last_joiner) override { c.last_joiner = is_last_joiner; }
    Counter& c;
  };
  void add(at::Tensor t) {
    pg_->all_reduce(t)->wait();
    total += t.item<int64_t>();
  }
  std::shared_ptr<ProcessGroup> pg_;
};

class JoinWorld : public ::testing::TestWithParam<int> {};

TEST_P(JoinWorld, AUserJoinableSeesEveryInputOfEveryRank) {
  const int world = GetParam();
  EXPECT_EQ(run_world(world,
                      [&](ProcessGroup& pg) {
                        auto group = tdist::default_group();
                        Counter c(group);
                        const int mine = inputs_of(pg.rank());
                        {
                          tdist::Join join({&c});
                          for (int k = 0; k < mine; ++k) c.step();
                        }  // the destructor joins
                        int64_t all = 0;
                        for (int r = 0; r < world; ++r) all += inputs_of(r);
                        WORLD_CHECK(c.total == all, "counted " << c.total << " inputs of " << all);
                        WORLD_CHECK(c.shadowed == most_inputs(world) - mine, "shadowed " << c.shadowed);
                        WORLD_CHECK(c.last_joiner.has_value() && *c.last_joiner == (mine == most_inputs(world)),
                                    "is_last_joiner wrong");
                        // The Join is gone: the joinable works on its own again.
                        c.step();
                        WORLD_CHECK(c.total == all + world, "a step after the Join counted " << c.total - all);
                      }),
            "");
}

// ---- DDP ------------------------------------------------------------------------

struct DdpCase {
  const char* name;
  bool divide_by_world;
  std::function<void(tdist::DistributedDataParallelOptions&)> options;
  bool user_hook;
};

// One process: each iteration's loss is the ranks' losses that still have
// inputs, summed and divided as DDP averages them.
std::map<std::string, torch::Tensor> train_reference(int world, bool divide_by_world) {
  torch::manual_seed(7);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int t = 0; t < most_inputs(world); ++t) {
    opt.zero_grad();
    std::vector<int> active;
    for (int r = 0; r < world; ++r) {
      if (t < inputs_of(r)) active.push_back(r);
    }
    torch::Tensor loss = torch::zeros({});
    for (int r : active) {
      auto [x, y] = batch(r, t);
      loss = loss + torch::mse_loss(net->forward(x), y);
    }
    (loss / (divide_by_world ? world : static_cast<int>(active.size()))).backward();
    opt.step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

void expect_reference(const std::map<std::string, torch::Tensor>& reference,
                      const std::vector<std::pair<std::string, torch::Tensor>>& got, const std::string& what) {
  WORLD_CHECK(got.size() == reference.size(), what << ": " << got.size() << " parameters of " << reference.size());
  for (const auto& [name, value] : got) {
    auto it = reference.find(name);
    WORLD_CHECK(it != reference.end(), what << ": no reference parameter " << name);
    const double err = (value - it->second).abs().max().item<double>();
    WORLD_CHECK(err <= 1e-5, what << ": " << name << " differs by " << err);
  }
}

void train_ddp(ProcessGroup& pg, const DdpCase& c) {
  const int world = pg.size();
  const auto reference = train_reference(world, c.divide_by_world);
  torch::manual_seed(7 + pg.rank());  // rank 0's weights are broadcast
  tdist::DistributedDataParallelOptions o;
  if (c.options) c.options(o);
  tdist::DistributedDataParallel<Net> model(Net(), o);
  if (c.user_hook) {
    model->register_comm_hook([group = model->process_group()](tdist::GradBucket& b) {
      return group->all_reduce(b.buffer(), {tdist::ReduceOp::AVG});
    });
  }
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  tdist::JoinOptions jo;
  jo.divide_by_initial_world_size = c.divide_by_world;
  {
    tdist::Join join({model.get()}, jo);
    for (int t = 0; t < inputs_of(pg.rank()); ++t) {
      auto [x, y] = batch(pg.rank(), t);
      opt.zero_grad();
      torch::mse_loss(model(x), y).backward();
      opt.step();
    }
    join.join();
  }
  std::vector<std::pair<std::string, torch::Tensor>> got;
  for (const auto& p : model->module()->named_parameters()) got.emplace_back(p.key(), p.value().detach());
  expect_reference(reference, got, std::string(c.name) + " on rank " + std::to_string(pg.rank()));
  // After the Join, the model trains on as before (every rank one input).
  auto [x, y] = batch(pg.rank(), 99);
  opt.zero_grad();
  torch::mse_loss(model(x), y).backward();
  opt.step();
}

TEST_P(JoinWorld, DistributedDataParallelMatchesOneProcess) {
  const DdpCase cases[] = {
      {"plain", true, nullptr, false},
      {"over-the-ranks-training", false, nullptr, false},
      {"unused-views-small-buckets", true,
       [](tdist::DistributedDataParallelOptions& o) {
         o.find_unused_parameters = true;
         o.gradient_as_bucket_view = true;
         o.bucket_cap_mb = 0.0002;
         o.first_bucket_cap_mb = 0.0001;
       },
       false},
      {"static-graph-user-hook", false,
       [](tdist::DistributedDataParallelOptions& o) { o.static_graph = true; }, true},
  };
  for (const DdpCase& c : cases) {
    EXPECT_EQ(run_world(GetParam(), [&](ProcessGroup& pg) { train_ddp(pg, c); }), "") << c.name;
  }
}

// A buffer that records which rank ran each forward (a decimal digit,
// rank + 1, per forward): with broadcast_buffers, each forward starts from
// the buffers of the highest rank that still trains (PyTorch's choice in
// a Join), and at the end every rank has the last joiner's.
struct CountingImpl : torch::nn::Module {
  explicit CountingImpl(int rank = 0) : rank(rank) {
    fc = register_module("fc", torch::nn::Linear(6, 3));
    seen = register_buffer("seen", torch::zeros({1}, torch::kDouble));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    seen.mul_(10).add_(rank + 1);
    return fc->forward(x);
  }
  int rank;
  torch::nn::Linear fc{nullptr};
  torch::Tensor seen;
};
TORCH_MODULE(Counting);

TEST(Join, DistributedDataParallelTakesBuffersFromARankThatStillTrains) {
  EXPECT_EQ(run_world(3,
                      [](ProcessGroup& pg) {
                        const int counts[] = {1, 4, 2};
                        tdist::DistributedDataParallel<Counting> model(Counting(pg.rank()),
                                                                       tdist::DistributedDataParallelOptions{});
                        torch::optim::SGD opt(model->parameters(), 0.1);
                        {
                          tdist::Join join({model.get()});
                          for (int t = 0; t < counts[pg.rank()]; ++t) {
                            auto [x, y] = batch(pg.rank(), t);
                            opt.zero_grad();
                            torch::mse_loss(model(x), y).backward();
                            opt.step();
                          }
                        }
                        // Step 0 from rank 2's buffer (all train), step 1 from rank 2's
                        // (ranks 1 and 2 train), steps 2 and 3 from rank 1's; rank 1
                        // joins last.
                        const double seen = model->module()->seen.item<double>();
                        WORLD_CHECK(seen == 3222, "rank " << pg.rank() << " ends with seen = " << seen);
                      }),
            "");
}

// ---- FSDP ---------------------------------------------------------------------

std::map<std::string, torch::Tensor> train_reference_fsdp(int world) {
  torch::manual_seed(7);
  Net net;
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int t = 0; t < most_inputs(world); ++t) {
    opt.zero_grad();
    torch::Tensor loss = torch::zeros({});
    for (int r = 0; r < world; ++r) {
      if (t >= inputs_of(r)) continue;
      auto [x, y] = batch(r, t);
      loss = loss + torch::mse_loss(net->forward(x), y);
    }
    (loss / world).backward();
    torch::nn::utils::clip_grad_norm_(net->parameters(), 0.05);
    opt.step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

void train_fsdp(ProcessGroup& pg, tdist::ShardingStrategy strategy) {
  const auto reference = train_reference_fsdp(pg.size());
  torch::manual_seed(7);
  tdist::FullyShardedDataParallelOptions o;
  o.sharding_strategy = strategy;
  tdist::FSDP<Net> model(Net(&o), o);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto step = [&](const torch::Tensor& x, const torch::Tensor& y) {
    opt.zero_grad();
    torch::mse_loss(model(x), y).backward();
    model->clip_grad_norm_(0.05);
    opt.step();
  };
  // A joined rank steps on anything of the right shape: its gradients count as zeros.
  model->set_join_step([&] { step(torch::full({4, 6}, 3.0), torch::full({4, 3}, -2.0)); });
  {
    tdist::Join join({model.get()});
    for (int t = 0; t < inputs_of(pg.rank()); ++t) {
      auto [x, y] = batch(pg.rank(), t);
      step(x, y);
    }
  }
  auto full = model->summon_full_params(/*writeback=*/false);
  std::vector<std::pair<std::string, torch::Tensor>> got;
  for (const auto& p : model->named_parameters()) {
    got.emplace_back(tdist::test::strip_wrappers(p.key()), p.value().detach().clone());
  }
  expect_reference(reference, got, "rank " + std::to_string(pg.rank()));
}

TEST_P(JoinWorld, FullyShardedDataParallelMatchesOneProcess) {
  for (auto s : {tdist::ShardingStrategy::FULL_SHARD, tdist::ShardingStrategy::SHARD_GRAD_OP}) {
    EXPECT_EQ(run_world(GetParam(), [&](ProcessGroup& pg) { train_fsdp(pg, s); }), "");
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, JoinWorld, ::testing::Values(2, 3, 4));

// ---- stopping, misuse ------------------------------------------------------------

TEST(Join, ThrowOnEarlyTerminationStopsEveryRankNamingTheFirstToRunOut) {
  EXPECT_EQ(run_world(3,
                      [](ProcessGroup& pg) {
                        Counter c(tdist::default_group());
                        const int mine = pg.rank() == 1 ? 1 : 3;
                        tdist::JoinOptions o;
                        o.throw_on_early_termination = true;
                        int done = 0;
                        try {
                          tdist::Join join({&c}, o);
                          for (; done < mine; ++done) c.step();
                          join.join();
                          WORLD_CHECK(false, "no EarlyTerminationError");
                        } catch (const tdist::EarlyTerminationError& e) {
                          WORLD_CHECK(e.rank() == 1, "named rank " << e.rank() << ": " << e.what());
                          WORLD_CHECK(std::string(e.what()).find("rank 1") != std::string::npos, e.what());
                        }
                        // The ranks that still had inputs stopped at their second.
                        WORLD_CHECK(done == 1 || pg.rank() == 1, "rank " << pg.rank() << " went on to " << done);
                        // Equal inputs everywhere: nobody throws.
                        Counter d(tdist::default_group());
                        {
                          tdist::Join join({&d}, o);
                          for (int k = 0; k < 2; ++k) d.step();
                        }
                        WORLD_CHECK(d.total == 6, "counted " << d.total);
                      }),
            "");
}

// no_sync is decided at forward time (PyTorch's rule): a forward inside the
// guard only accumulates, even when its backward runs after the guard, and
// a joined rank is told so. Rank 1 has no inputs: rank 0's two losses are
// averaged with its zeros.
TEST(Join, DistributedDataParallelDecidesNoSyncAtForwardTime) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup& pg) {
                        torch::manual_seed(7);
                        Net ref;
                        torch::optim::SGD ropt(ref->parameters(), 0.05);
                        auto [x0, y0] = batch(0, 0);
                        auto [x1, y1] = batch(0, 1);
                        ropt.zero_grad();
                        ((torch::mse_loss(ref->forward(x0), y0) + torch::mse_loss(ref->forward(x1), y1)) / 2).backward();
                        ropt.step();
                        torch::manual_seed(7);
                        tdist::DistributedDataParallel<Net> model(Net(), tdist::DistributedDataParallelOptions{});
                        torch::optim::SGD opt(model->parameters(), 0.05);
                        {
                          tdist::Join join({model.get()});
                          if (pg.rank() == 0) {
                            opt.zero_grad();
                            torch::Tensor first;
                            {
                              auto guard = model->no_sync();
                              first = torch::mse_loss(model(x0), y0);
                            }
                            first.backward();  // accumulates only
                            torch::mse_loss(model(x1), y1).backward();
                            opt.step();
                          }
                        }
                        auto want = ref->named_parameters();
                        for (const auto& p : model->module()->named_parameters()) {
                          const double err = (p.value() - want[p.key()]).abs().max().item<double>();
                          WORLD_CHECK(err < 1e-6, "rank " << pg.rank() << ": " << p.key() << " differs by " << err);
                        }
                      }),
            "");
}

// An EarlyTerminationError caught inside the Join's scope ends the Join on
// that rank: the scope's end runs no more rounds that the others would
// have to meet.
TEST(Join, AnEarlyTerminationCaughtInsideTheScopeEndsTheJoin) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup& pg) {
                        Counter c(tdist::default_group());
                        tdist::JoinOptions o;
                        o.throw_on_early_termination = true;
                        const int mine = pg.rank() == 1 ? 1 : 3;
                        bool thrown = false;
                        {
                          tdist::Join join({&c}, o);
                          try {
                            for (int k = 0; k < mine; ++k) c.step();
                            join.join();
                          } catch (const tdist::EarlyTerminationError&) {
                            thrown = true;
                          }
                        }
                        WORLD_CHECK(thrown, "rank " << pg.rank() << " saw no EarlyTerminationError");
                        pg.barrier()->wait();  // the ranks are in step again
                        // throw_on_early_termination needs no FSDP join step: its hooks never run.
                        tdist::FullyShardedDataParallelOptions fo;
                        tdist::FSDP<Net> model(Net(&fo), fo);
                        tdist::Join fsdp_join({model.get()}, o);
                      }),
            "");
}

TEST(Join, MisuseIsNamed) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup& pg) {
                        auto expect_usage = [](const std::function<void()>& fn, const std::string& needle) {
                          try {
                            fn();
                          } catch (const tdist::UsageError& e) {
                            WORLD_CHECK(std::string(e.what()).find(needle) != std::string::npos, e.what());
                            return;
                          }
                          WORLD_CHECK(false, "no UsageError for " << needle);
                        };
                        auto world = tdist::default_group();
                        auto self = world->new_group({pg.rank()});
                        Counter a(world), b(self);
                        expect_usage([&] { tdist::Join j(std::vector<tdist::Joinable*>{}); }, "at least one");
                        expect_usage([&] { tdist::Join j({&a, nullptr}); }, "null");
                        expect_usage([&] { tdist::Join j({&a, &a}); }, "twice");
                        expect_usage([&] { tdist::Join j({&a, &b}); }, "another process group");
                        expect_usage(
                            [&] {
                              tdist::Join j({&a});
                              tdist::Join k({&a});
                            },
                            "already held");
                        // A Join whose constructor threw let go of its joinables: a new one works.
                        {
                          tdist::Join j({&a});
                          a.step();
                        }
                        WORLD_CHECK(a.total == 2, "counted " << a.total);
                        torch::manual_seed(7);
                        tdist::FullyShardedDataParallelOptions o;
                        tdist::FSDP<Net> model(Net(&o), o);
                        expect_usage([&] { tdist::Join j({model.get()}); }, "set_join_step");
                        model->set_join_step([] {});
                        tdist::JoinOptions jo;
                        jo.divide_by_initial_world_size = false;
                        expect_usage([&] { tdist::Join j({model.get()}, jo); }, "divide_by_initial_world_size");
                        // Disabled: nothing is shadowed and no collective is made.
                        jo = {};
                        jo.enable = false;
                        {
                          tdist::Join j({&a}, jo);
                          a.step();
                        }
                        WORLD_CHECK(a.total == 4, "counted " << a.total);
                      }),
            "");
}

}  // namespace
