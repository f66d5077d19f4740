// Hybrid sharding (HSDP) on 4 real processes as 2 x 2: shards within each
// pair, replicas across them. Every way of asking for it (a 2-D mesh,
// torch_xla's sharding_groups, HYBRID_SHARD over LOCAL_WORLD_SIZE, the
// ZeRO-2 form) trains to the one-process weights and to FULL_SHARD's at
// world 4, with less traffic across the pairs; sharded checkpoints are the
// first replica's files, loaded by every replica or resharded elsewhere.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "fsdp/fsdp_model.h"
#include "tests/fsdp/models.h"
#include "tests/util/process.h"
#include "tests/util/world.h"
#include "tdist/device_mesh.h"
#include "tdist/sharded_checkpoint.h"
#include "tdist/state_dict.h"

using tdist::ProcessGroup;
using tdist::ShardingStrategy;
using tdist::test::Net;
using tdist::test::run_world;

namespace {

constexpr int kSteps = 12;
constexpr int kBatch = 12;
constexpr int kWorld = 4;

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(1000 + step);
  return {torch::randn({kBatch, 6}), torch::randn({kBatch, 3})};
}

using Weights = std::map<std::string, torch::Tensor>;

Weights train_reference() {
  torch::manual_seed(7);
  Net net;
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < kSteps; ++step) {
    for (auto p : net->parameters()) p.mutable_grad().reset();
    auto [x, y] = batch(step);
    torch::mse_loss(net->forward(x), y).backward();
    opt.step();
  }
  Weights out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

struct Trained {
  std::unique_ptr<tdist::FSDP<Net>> model;
  std::unique_ptr<torch::optim::Adam> opt;
};

// The nested Net (3 block units and the root's) with these options, trained
// for `steps` on this rank's rows of the whole batch.
Trained train(ProcessGroup& world, const tdist::FullyShardedDataParallelOptions& o, int steps = kSteps) {
  torch::manual_seed(7);
  Trained t;
  t.model = std::make_unique<tdist::FSDP<Net>>(Net(&o), o);
  t.opt = std::make_unique<torch::optim::Adam>((*t.model)->parameters(), torch::optim::AdamOptions(1e-2));
  const int64_t rows = kBatch / world.size();
  for (int step = 0; step < steps; ++step) {
    for (auto p : (*t.model)->parameters()) p.mutable_grad().reset();
    auto [x, y] = batch(step);
    const int64_t first = world.rank() * rows;
    // (as float: a compute dtype's forward returns it)
    torch::mse_loss((*t.model)(x.narrow(0, first, rows)).to(torch::kFloat), y.narrow(0, first, rows)).backward();
    t.opt->step();
  }
  return t;
}

Weights summoned(tdist::FSDP<Net>& model) {
  auto full = model->summon_full_params(/*writeback=*/false);
  Weights out;
  for (const auto& p : model->named_parameters()) {
    out[tdist::test::strip_wrappers(p.key())] = p.value().detach().clone();
  }
  return out;
}

double max_relative(const Weights& a, const Weights& b) {
  double worst = 0;
  for (const auto& [name, want] : b) {
    const auto it = a.find(name);
    if (it == a.end() || it->second.sizes() != want.sizes()) return 1e30;
    worst = std::max(worst, (it->second - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-12));
  }
  return a.size() == b.size() ? worst : 1e30;
}

// Bytes per rank and step that FSDP moved over `pg`.
double bytes_of(const ProcessGroup& pg, int steps) {
  double bytes = 0;
  for (const auto& [op, c] : pg.collective_counts()) {
    if (op == "all_gather_into_tensor_coalesced") bytes += static_cast<double>(c.output_bytes);
    if (op == "reduce_scatter_tensor_coalesced" || op == "all_reduce_coalesced") bytes += static_cast<double>(c.input_bytes);
  }
  return bytes / steps;
}

TEST(HybridShard, EveryFormMatchesFullShardAndOneProcess) {
  EXPECT_EQ(run_world(kWorld, [](ProcessGroup& world) {
    const Weights reference = train_reference();
    tdist::FullyShardedDataParallelOptions full_shard;
    world.reset_collective_counts();
    const Weights fs = summoned(*train(world, full_shard).model);
    const double fs_cross = bytes_of(world, kSteps);  // every collective spans both pairs
    WORLD_CHECK(max_relative(fs, reference) <= 1e-5, "FULL_SHARD vs one process: " << max_relative(fs, reference));

    auto mesh = tdist::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    WORLD_CHECK(mesh->get_group("shard")->size() == 2 && mesh->get_group("replicate")->size() == 2, "mesh groups");
    WORLD_CHECK(mesh->get_local_rank("shard") == world.rank() % 2 && mesh->get_local_rank(0) == world.rank() / 2,
                "coordinates " << mesh->get_local_rank(0) << "," << mesh->get_local_rank(1));
    struct Form {
      const char* name;
      tdist::FullyShardedDataParallelOptions o;
      bool local_world_size = false;
    };
    std::vector<Form> forms(4);
    forms[0].name = "2-D mesh, FULL_SHARD";
    forms[0].o.device_mesh = mesh;
    forms[1].name = "sharding_groups";
    forms[1].o.sharding_strategy = ShardingStrategy::HYBRID_SHARD;
    forms[1].o.sharding_groups = {{0, 1}, {2, 3}};
    forms[2].name = "HYBRID_SHARD_ZERO2 on the mesh";
    forms[2].o.device_mesh = mesh;
    forms[2].o.sharding_strategy = ShardingStrategy::HYBRID_SHARD_ZERO2;
    forms[3].name = "HYBRID_SHARD over LOCAL_WORLD_SIZE";
    forms[3].o.sharding_strategy = ShardingStrategy::HYBRID_SHARD;
    forms[3].local_world_size = true;
    for (auto& f : forms) {
      if (f.local_world_size) setenv("LOCAL_WORLD_SIZE", "2", 1);
      Trained t = train(world, f.o, 1);  // one step to make the groups, then count a clean run
      auto replicate = tdist::detail::FsdpModel::of(**t.model)->replicate_group();
      auto shard = tdist::detail::FsdpModel::of(**t.model)->group();
      WORLD_CHECK(replicate && replicate->size() == 2 && shard->size() == 2, f.name << ": groups");
      replicate->reset_collective_counts();
      t = train(world, f.o);
      unsetenv("LOCAL_WORLD_SIZE");
      replicate = tdist::detail::FsdpModel::of(**t.model)->replicate_group();
      const Weights got = summoned(*t.model);
      WORLD_CHECK(max_relative(got, reference) <= 1e-5, f.name << " vs one process: " << max_relative(got, reference));
      WORLD_CHECK(max_relative(got, fs) <= 1e-6, f.name << " vs FULL_SHARD at world 4: " << max_relative(got, fs));
      const auto md = (*t.model)->get_shard_metadata();
      WORLD_CHECK(md.world_size == 2 && md.rank == world.rank() % 2, f.name << ": shard metadata " << md.rank << " of "
                                                                            << md.world_size);
      // Across the pairs only the shard gradients' all-reduce.
      const double cross = bytes_of(*replicate, kSteps);
      WORLD_CHECK(cross > 0 && cross < fs_cross / 2, f.name << ": " << cross << " bytes across pairs per step vs "
                                                            << fs_cross << " under FULL_SHARD");
      if (world.rank() == 0) {
        std::printf("%s: %.0f bytes per rank and step across the pairs (FULL_SHARD at world 4: %.0f)\n", f.name, cross,
                    fs_cross);
      }
    }
  }), "");
}

TEST(HybridShard, CheckpointsAreTheFirstReplicasFiles) {
  tdist::test::TempDir dir;
  const std::string prefix = dir.path() + "/hsdp";
  EXPECT_EQ(run_world(kWorld, [&](ProcessGroup& world) {
    auto mesh = tdist::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    tdist::FullyShardedDataParallelOptions o;
    o.device_mesh = mesh;
    Trained a = train(world, o, 3);
    auto world_ptr = tdist::default_group();
    tdist::save_sharded_checkpoint(prefix, *world_ptr, **a.model, a.opt.get());
    size_t files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      const std::string name = e.path().filename().string();
      WORLD_CHECK(name.find("-of-2.pt") != std::string::npos, "unexpected file " << name);
      ++files;
    }
    WORLD_CHECK(files == 2, files << " files, want the first replica's 2");
    // Every replica loads them into a fresh model...
    Trained b = train(world, o, 0);
    tdist::load_sharded_checkpoint(prefix, *mesh->get_group("shard"), **b.model, b.opt.get());
    const Weights want = summoned(*a.model);
    WORLD_CHECK(max_relative(summoned(*b.model), want) == 0, "loaded weights differ");
    const auto sa = tdist::sharded_optimizer_state_dict(**a.model, *a.opt);
    const auto sb = tdist::sharded_optimizer_state_dict(**b.model, *b.opt);
    WORLD_CHECK(sa.state.size() == sb.state.size() && sa.state.size() > 0, "optimizer state sizes");
    for (const auto& item : sa.state) {
      const auto& other = sb.state[item.key()];
      for (const auto& field : item.value()) {
        WORLD_CHECK(other.contains(field.key()) && at::equal(other[field.key()], field.value()),
                    "optimizer state " << item.key() << "." << field.key() << " differs after the load");
      }
    }
    // ...and FULL_SHARD at world 4 reshards them.
    tdist::FullyShardedDataParallelOptions fs;
    Trained c = train(world, fs, 0);
    tdist::load_sharded_checkpoint(prefix, world, **c.model, c.opt.get());
    WORLD_CHECK(max_relative(summoned(*c.model), want) == 0, "resharded weights differ");
    // A full state dict, rank 0 of all four only.
    const auto full = tdist::full_state_dict(**a.model);
    WORLD_CHECK((world.rank() == 0) == (full.size() > 0), "rank0_only state dict on rank " << world.rank());
  }), "");
}

// Gathers of the world group per step (FSDP's, before any summon).
int64_t gathers_of(const ProcessGroup& pg) {
  const auto counts = pg.collective_counts();
  const auto it = counts.find("all_gather_into_tensor_coalesced");
  return it == counts.end() ? 0 : it->second.calls;
}

// reshard_after_forward as an int (ZeRO++ hpZ): after forward each pair
// keeps the full parameters split two ways, and a unit's backward gathers
// within the pair. Training matches FULL_SHARD; the backward gathers leave
// the world group; a share taken before the parameters changed is not used.
TEST(ReshardAfterForward, AnIntGathersTheBackwardWithinBlocksOfThatSize) {
  EXPECT_EQ(run_world(kWorld, [](ProcessGroup& world) {
    const Weights reference = train_reference();
    tdist::FullyShardedDataParallelOptions full_shard, hpz;
    hpz.reshard_after_forward = 2;
    world.reset_collective_counts();
    Trained fs = train(world, full_shard);
    const int64_t fs_gathers = gathers_of(world);
    world.reset_collective_counts();
    Trained t = train(world, hpz);
    const int64_t hpz_gathers = gathers_of(world);
    // 4 units (3 blocks and the root): FULL_SHARD gathers 4 in forward and
    // the 3 blocks again in backward, all over the world group; hpZ gathers
    // the blocks' backward within the pairs.
    WORLD_CHECK(fs_gathers == 7 * kSteps, "FULL_SHARD: " << fs_gathers << " gathers");
    WORLD_CHECK(hpz_gathers == 4 * kSteps, "hpZ: " << hpz_gathers << " gathers over the world group, want "
                                                   << 4 * kSteps);
    const Weights want = summoned(*fs.model);
    const Weights got = summoned(*t.model);
    WORLD_CHECK(max_relative(got, want) <= 1e-6, "hpZ vs FULL_SHARD: " << max_relative(got, want));
    WORLD_CHECK(max_relative(got, reference) <= 1e-5, "hpZ vs one process: " << max_relative(got, reference));

    // A forward whose backward never comes, then the shards change (as an
    // optimizer step changes them): the next backward must see the new
    // values, not the share kept from that forward.
    for (Trained* m : {&fs, &t}) {
      auto [x, y] = batch(99);
      const int64_t rows = kBatch / world.size(), first = world.rank() * rows;
      (void)(*m->model)(x.narrow(0, first, rows));  // kept shares, no backward
      {
        torch::NoGradGuard no_grad;
        for (auto p : (*m->model)->parameters()) p.mul_(0.5);
      }
      for (auto p : (*m->model)->parameters()) p.mutable_grad().reset();
      torch::mse_loss((*m->model)(x.narrow(0, first, rows)), y.narrow(0, first, rows)).backward();
      m->opt->step();
    }
    const double after = max_relative(summoned(*t.model), summoned(*fs.model));
    WORLD_CHECK(after <= 1e-6, "after a forward without backward and a change of the shards: " << after);

    // With a compute dtype the share is kept in it: the same bf16 values
    // as FULL_SHARD gathers again.
    full_shard.mixed_precision.param_dtype = torch::kBFloat16;
    hpz.mixed_precision.param_dtype = torch::kBFloat16;
    const Weights fs_bf16 = summoned(*train(world, full_shard, 4).model);
    const Weights hpz_bf16 = summoned(*train(world, hpz, 4).model);
    WORLD_CHECK(max_relative(hpz_bf16, fs_bf16) <= 1e-6, "bf16 hpZ vs FULL_SHARD: " << max_relative(hpz_bf16, fs_bf16));

    // k must divide the shard group.
    tdist::FullyShardedDataParallelOptions bad;
    bad.reshard_after_forward = 3;
    try {
      tdist::FSDP<Net> model(Net(&bad), bad);
      WORLD_CHECK(false, "reshard_after_forward=3 at world 4 was accepted");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(std::string(e.what()).find("reshard_after_forward=3 must divide the shard group's 4 ranks") !=
                      std::string::npos, e.what());
    }
  }), "");
}

TEST(HybridShard, MisuseIsNamed) {
  EXPECT_EQ(run_world(kWorld, [](ProcessGroup&) {
    const auto refuses = [](const tdist::FullyShardedDataParallelOptions& o, const std::string& words) {
      try {
        tdist::FSDP<Net> model(Net(), o);
      } catch (const tdist::UsageError& e) {
        WORLD_CHECK(std::string(e.what()).find(words) != std::string::npos, e.what());
        return;
      }
      WORLD_CHECK(false, "accepted; wanted an error with '" << words << "'");
    };
    tdist::FullyShardedDataParallelOptions o;
    o.sharding_strategy = ShardingStrategy::HYBRID_SHARD;
    unsetenv("LOCAL_WORLD_SIZE");
    refuses(o, "LOCAL_WORLD_SIZE");
    setenv("LOCAL_WORLD_SIZE", "3", 1);
    refuses(o, "LOCAL_WORLD_SIZE is '3'");
    unsetenv("LOCAL_WORLD_SIZE");
    o.sharding_groups = {{0, 1, 2}, {3}};
    refuses(o, "every row (sharding group) needs the same size");
    o.sharding_groups = {{0, 1}, {1, 2}};
    refuses(o, "every rank of the group once");
    o.sharding_groups.clear();
    o.device_mesh = tdist::init_device_mesh("cpu", {4});
    refuses(o, "needs a 2-D device_mesh");
    o.sharding_strategy = ShardingStrategy::NO_SHARD;
    o.device_mesh = tdist::init_device_mesh("cpu", {2, 2});
    refuses(o, "NO_SHARD with a 2-D device_mesh");
    try {
      tdist::init_device_mesh("cpu", {3, 2});
      WORLD_CHECK(false, "a mesh of 6 over 4 ranks was accepted");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(std::string(e.what()).find("holds 6 ranks") != std::string::npos, e.what());
    }
  }), "");
}

}  // namespace
