// FSDP trains to the same weights as one process on the whole batch: every
// sharding strategy, flat (one unit) and nested (a unit per block plus the
// root's), SGD with momentum and Adam, clip_grad_norm_ and gradient
// accumulation under no_sync, on worlds of 1-4 real processes. Also what
// each unit sends per step (process-group calls, and shm's own ops), and
// when prefetching gathers each unit (the flight recorder's order of the
// gathers against the blocks' forwards and backwards).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tdist/trace.h"
#include "tests/fsdp/models.h"
#include "tests/util/process.h"
#include "tests/util/shm_ops.h"
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

// What a unit sends per step, as the process group is called and as the
// backend sends it. Each unit is one process-group call each way on every
// backend (all_gather_into_tensor_coalesced, reduce_scatter_tensor_coalesced),
// nothing per parameter: a step of the nested model (3 blocks and the root:
// 4 units) gathers each unit once in forward and, under FULL_SHARD, once
// more in backward (not the root, which stays gathered), and reduces each
// unit once. Below the process group the backends differ:
//  - shm packs the pieces whose share per rank is under
//    TDIST_SHM_SMALL_BYTES (32 KiB) into one op and sends each larger piece
//    as an op of its own: with a hidden width of 4096 a block's two weights
//    (37-56 KiB a rank at worlds 2 and 3) go alone and its biases and gate
//    go packed, three shm ops per block each way; the root's small pieces
//    are one. Counted here from the shm backend's own numbering of its ops.
//  - gloo (and mpi) pack every piece of a call into one buffer: one
//    all-gather per call, and for the reduce-scatter one all-reduce of the
//    packed buffer (gloo has no reduce-scatter). Their ops cannot be
//    counted from outside the backend; the process-group count is checked.
// The weights match the one-process run: the nested-adam case on the
// small model, and the wide model (both shm paths) on each backend.
class CollectivesPerUnit : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

constexpr int64_t kWide = 4096;  // the blocks' hidden width here: weights of 4096 x 7

// Sets an environment variable while it lives (ranks forked meanwhile
// inherit it), then puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* v = std::getenv(name)) old_ = v;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

std::string counts_text(const std::map<std::string, tdist::CollectiveCount>& counts) {
  std::string out;
  for (const auto& [op, c] : counts) out += (out.empty() ? "" : ", ") + op + " x" + std::to_string(c.calls);
  return "{" + out + "}";
}

TEST_P(CollectivesPerUnit, OneGroupCallEachWayAndOnShmOneOpPerLargePiece) {
  const auto [backend, world] = GetParam();
  const ScopedEnv small("TDIST_SHM_SMALL_BYTES", "32768");  // the default, pinned: the counts below depend on it
  tdist::test::WorldOptions wo;
  wo.backend = backend;
  for (ShardingStrategy strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
    EXPECT_EQ(run_world(world, [strategy, shm = backend == "shm"](ProcessGroup& pg) {
      train_sharded(pg, strategy, kCases[1]);  // nested-adam
      torch::manual_seed(7);
      Net plain(nullptr, 3, kWide);
      torch::optim::SGD plain_opt(plain->parameters(), 1e-3);  // small steps: 4096-wide gradients are large
      torch::manual_seed(7);
      tdist::FullyShardedDataParallelOptions o;
      o.sharding_strategy = strategy;
      tdist::FSDP<Net> model(Net(&o, 3, kWide), o);
      torch::optim::SGD opt(model->parameters(), 1e-3);
      const int64_t rows = kBatch / pg.size();
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = batch(step, 0);
        zero_grads(plain->parameters());
        torch::mse_loss(plain->forward(x), y).backward();
        plain_opt.step();
        zero_grads(model->parameters());
        const bool counting = step == 2;  // a step like any later one
        int64_t shm_before = 0;
        if (counting) {
          pg.reset_collective_counts();
          shm_before = tdist::test::shm_collectives_started(pg.size(), pg.rank());
        }
        torch::mse_loss(model(x.narrow(0, pg.rank() * rows, rows)), y.narrow(0, pg.rank() * rows, rows)).backward();
        if (counting) {
          const auto counts = pg.collective_counts();
          const auto calls = [&](const char* op) { return counts.count(op) ? counts.at(op).calls : 0; };
          const int64_t units = 4, blocks = 3;
          const int64_t gathers = strategy == ShardingStrategy::FULL_SHARD ? 2 * units - 1 : units;
          WORLD_CHECK(calls("all_gather_into_tensor_coalesced") == gathers && calls("reduce_scatter_tensor_coalesced") == units,
                      "group calls per step: " << counts_text(counts) << "; want " << gathers << " gathers and " << units
                                               << " reductions");
          WORLD_CHECK(static_cast<int64_t>(counts.size()) == 2, "other group calls in a step: " << counts_text(counts));
          if (shm) {
            const int64_t shm_after = tdist::test::shm_collectives_started(pg.size(), pg.rank());
            WORLD_CHECK(shm_before >= 0 && shm_after >= 0, "no shm segment of this group found in /proc/self/maps");
            // Each call of the root: one op. Each call of a block: two weights alone and one op of the rest.
            const int64_t block_gathers = gathers - 1, block_reductions = blocks;
            const int64_t want = 1 + 3 * block_gathers + 1 + 3 * block_reductions;
            WORLD_CHECK(shm_after - shm_before == want,
                        "shm ops per step: " << shm_after - shm_before << ", want " << want << " (group calls "
                                             << counts_text(counts) << ")");
          }
        }
        opt.step();
      }
      auto full = model->summon_full_params(/*writeback=*/false);
      for (const auto& p : model->named_parameters()) {
        const std::string name = tdist::test::strip_wrappers(p.key());
        const auto want = plain->named_parameters()[name];
        const double err = (p.value() - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-12);
        WORLD_CHECK(err <= 1e-5, name << " differs by " << err << " (relative)");
      }
    }, wo), "") << strategy_name(strategy);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, CollectivesPerUnit,
                         ::testing::Combine(::testing::Values("shm", "gloo"), ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
                         });

// ---- when each unit is gathered, from the flight recorder -------------------------------

// The FSDP units' all-gathers that the world group queued after the
// record `after`, oldest first, each by its calling site (the unit's name),
// and the last record: this rank's flight recorder, dumped now (into
// $TDIST_DUMP_DIR). By record, not by op number: an op is numbered when it
// starts, and a prefetch may be queued and not started yet.
struct Recorded {
  uint64_t last = 0;
  std::vector<std::string> gathers;
};

Recorded recorded_since(uint64_t after) {
  const std::string path = tdist::trace::dump_flight_recorder();
  WORLD_CHECK(!path.empty(), "no flight recorder dump (is TDIST_DUMP_DIR set?)");
  const auto dump = nlohmann::json::parse(tdist::test::read_all(path));
  Recorded r;
  for (const auto& e : dump["entries"]) r.last = std::max(r.last, e["record_id"].get<uint64_t>());
  for (const auto& e : dump["entries"]) {
    if (e["process_group"][0] != "world" || e["profiling_name"] != "tdist:all_gather_into_tensor_coalesced") continue;
    if (e["record_id"].get<uint64_t>() <= after) continue;
    r.gathers.push_back(e["site"].is_string() ? e["site"].get<std::string>() : "(no site)");
  }
  return r;
}

std::string listed(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return "[" + out + "]";
}

// The gathers a nested Net has queued (since start()) when each block's
// forward is about to run, and when each block's backward begins (a hook
// on the block's output, which runs after its wrapper's own hook there has
// gathered it and started its prefetches).
struct GatherWatch {
  bool on = false;
  uint64_t since = 0;
  std::map<size_t, std::vector<std::string>> before_forward, at_backward;

  void start() {
    since = recorded_since(UINT64_MAX).last;
    before_forward.clear();
    at_backward.clear();
    on = true;
  }
  void attach(tdist::test::NetImpl& net) {
    net.before_block = [this](size_t i, const torch::Tensor&) {
      if (on) before_forward[i] = recorded_since(since).gathers;
    };
    net.after_block = [this](size_t i, const torch::Tensor& h) {
      if (!on || !h.requires_grad()) return;
      h.register_hook([this, i](torch::Tensor) {
        if (on) at_backward[i] = recorded_since(since).gathers;
      });
    };
  }
};

// v's first n entries.
std::vector<std::string> first_n(const std::vector<std::string>& v, size_t n) {
  return {v.begin(), v.begin() + static_cast<std::ptrdiff_t>(std::min(n, v.size()))};
}

bool distinct(const std::vector<std::string>& v) { return std::set<std::string>(v.begin(), v.end()).size() == v.size(); }

// forward_prefetch and BACKWARD_PRE: a unit's forward starts gathering the
// unit that followed it in the last iteration, a unit's backward the unit
// before it in forward: one unit ahead, no more. Off, each unit is gathered
// as it runs. Both seen in the order of the gathers against the blocks'
// forwards and backwards.
TEST(Prefetch, OptionsGatherOneUnitAheadInForwardAndBackward) {
  tdist::test::TempDir dumps;
  EXPECT_EQ(run_world(2, [&](ProcessGroup&) {
    setenv("TDIST_DUMP_DIR", dumps.path().c_str(), 1);
    for (const bool on : {true, false}) {
      torch::manual_seed(7);
      tdist::FullyShardedDataParallelOptions o;
      o.forward_prefetch = on;
      o.backward_prefetch = on ? tdist::BackwardPrefetch::BACKWARD_PRE : tdist::BackwardPrefetch::NONE;
      tdist::FSDP<Net> model(Net(&o), o);
      GatherWatch w;
      w.attach(*model->module());
      auto [x, y] = batch(0, 0);
      for (int step = 0; step < 2; ++step) {  // forward prefetch follows the order of the step before
        if (step == 1) w.start();
        auto out = model(x);
        if (!w.on) {
          torch::mse_loss(out, y).backward();
          continue;
        }
        const auto forward = recorded_since(w.since).gathers;  // root, block0, block1, block2
        WORLD_CHECK(forward.size() == 4 && distinct(forward), "the forward's gathers: " << listed(forward));
        const auto before = w.before_forward;
        for (size_t i = 0; i < 3; ++i) {
          // The root and the blocks before i; with prefetch also block i (the forward before it started it).
          const auto want = first_n(forward, on ? i + 2 : i + 1);
          WORLD_CHECK(before.count(i) && before.at(i) == want,
                      (on ? "prefetch" : "no prefetch") << ": before block " << i << "'s forward the gathers were "
                                                        << listed(before.count(i) ? before.at(i) : std::vector<std::string>{})
                                                        << ", want " << listed(want));
        }
        w.start();
        torch::mse_loss(out, y).backward();
        w.on = false;
        const std::vector<std::string> backward_order = {forward[3], forward[2], forward[1]};  // the root stays gathered
        for (size_t i = 0; i < 3; ++i) {
          // block2 down to block i; with prefetch also the block before it.
          const auto want = first_n(backward_order, on ? 4 - i : 3 - i);
          WORLD_CHECK(w.at_backward.count(i) && w.at_backward.at(i) == want,
                      (on ? "prefetch" : "no prefetch")
                          << ": as block " << i << "'s backward began the gathers were "
                          << listed(w.at_backward.count(i) ? w.at_backward.at(i) : std::vector<std::string>{})
                          << ", want " << listed(want));
        }
      }
    }
  }), "");
}

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
  tdist::test::TempDir dumps;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dumps.path().c_str(), 1);
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
    // The order of the gathers in the first step (seen before each block's
    // forward and as each block's backward begins) shows the lists at work.
    GatherWatch w;
    w.attach(*model->module());
    std::vector<std::string> forward;  // the first forward's gathers: root, block0, block1, block2
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
        if (step == 0) w.start();
        pg.reset_collective_counts();
        auto out = model(x.narrow(0, pg.rank() * rows, rows));
        const auto counts = pg.collective_counts();
        const int64_t gathers = counts.count("all_gather_into_tensor_coalesced")
                                    ? counts.at("all_gather_into_tensor_coalesced").calls
                                    : 0;
        if (m == 1) forward_gathers_kept = gathers;
        if (step == 0 && m == 0) {
          // block0's forward starts block1's and block2's gathers: all four
          // units are gathering before block1 runs.
          forward = recorded_since(w.since).gathers;
          WORLD_CHECK(forward.size() == 4 && distinct(forward), "the first forward's gathers: " << listed(forward));
          const std::vector<std::vector<std::string>> want = {first_n(forward, 1), forward, forward};
          for (size_t i = 0; i < 3; ++i) {
            WORLD_CHECK(w.before_forward[i] == want[i], "before block " << i << "'s forward the gathers were "
                                                                      << listed(w.before_forward[i]) << ", want "
                                                                      << listed(want[i]));
          }
        }
        if (step == 0) w.start();
        pg.reset_collective_counts();
        torch::mse_loss(out, y.narrow(0, pg.rank() * rows, rows)).backward();
        const auto after = pg.collective_counts();
        WORLD_CHECK(last == (after.count("reduce_scatter_tensor_coalesced") > 0),
                    "micro-batch " << m << (last ? " reduced nothing" : " reduced with gradient sync off"));
        if (step == 0) {
          // block2's backward starts block1's and block0's gathers: all
          // three are gathering before block1's backward (the root stays
          // gathered).
          w.on = false;
          const std::vector<std::string> want = {forward[3], forward[2], forward[1]};
          for (size_t i = 0; i < 3; ++i) {
            WORLD_CHECK(w.at_backward[i] == want, "micro-batch " << m << ": as block " << i
                                                                 << "'s backward began the gathers were "
                                                                 << listed(w.at_backward[i]) << ", want " << listed(want));
          }
        }
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
  tdist::test::TempDir dumps;
  EXPECT_EQ(run_world(2, [&](ProcessGroup&) {
    setenv("TDIST_DUMP_DIR", dumps.path().c_str(), 1);
    torch::manual_seed(7);
    tdist::FullyShardedDataParallelOptions o;
    tdist::FSDP<SkipNet> model(SkipNet(o), o);
    model->module()->a->set_modules_to_forward_prefetch({model->module()->b.ptr()});
    const auto x = torch::randn({4, 7});
    model->module()->use_b = false;  // b is prefetched by a's forward, then never runs
    uint64_t since = recorded_since(UINT64_MAX).last;
    auto skipped = model(x);
    // a, and b: a's forward started b's gather (the root holds no parameter of its own).
    const auto prefetched = recorded_since(since).gathers;
    WORLD_CHECK(prefetched.size() == 2 && distinct(prefetched), "the forward without b gathered " << listed(prefetched));
    skipped.sum().backward();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->module()->b->parameters()) p.mul_(2);  // its shards change
    }
    model->module()->use_b = true;
    since = recorded_since(UINT64_MAX).last;
    const auto first = model(x).detach();
    const auto gathered = recorded_since(since).gathers;
    WORLD_CHECK(gathered == prefetched, "the next forward gathered " << listed(gathered) << ", want b again: "
                                                                       << listed(prefetched));
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
