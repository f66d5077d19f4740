// Sharded checkpoints in real processes: a resume is bit for bit (FSDP with
// Adam; DDP with a PowerSGD hook's state); a checkpoint saved at world N
// loads at world M (2->3, 3->2, 4->1, into a plain model and into DDP), by
// itself or resharded by `tdist-ckpt reshard`, to exactly the saved full
// state; `tdist-ckpt consolidate` writes the full state (and optimizer
// state) that the plain model, Python's torch.load into an equivalent
// nn.Module and the safetensors package all read; a kill -9 during a save
// leaves the previous checkpoint loadable; every kind of broken checkpoint
// is a CheckpointError naming the file, and the model keeps its weights.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include <nlohmann/json.hpp>

#include <torch/csrc/jit/runtime/print_handler.h>

#include "formats/pt_file.h"
#include "tdist/tdist.h"
#include "tests/checkpoint/rewrite.h"
#include "tests/fsdp/models.h"
#include "tests/util/process.h"
#include "tests/util/world.h"
#include "tests/util/paths.h"

namespace {

using tdist::CheckpointError;
using tdist::FSDP;
using tdist::ProcessGroup;
using tdist::StateDict;
using tdist::test::Net;
using tdist::test::run_world;
using tdist::test::TempDir;

const std::string kBin = tdist::test::bin_dir();

at::Tensor batch(int step, int world) {
  torch::manual_seed(70 + step);
  return torch::randn({4 * world, 6});
}

template <typename M>
void train(M& model, torch::optim::Optimizer& opt, ProcessGroup& pg, int from, int to) {
  for (int s = from; s < to; ++s) {
    opt.zero_grad();
    model(batch(s, pg.size()).narrow(0, 4 * pg.rank(), 4)).pow(2).mean().backward();
    opt.step();
  }
}

// The full model and optimizer state, as a safetensors file of rank 0's
// (optimizer tensors as "<param>/<field>").
void save_reference(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& opt, int rank) {
  const StateDict full = tdist::full_state_dict(model);
  const auto optim = tdist::full_optimizer_state_dict(model, opt);
  if (rank != 0) return;
  StateDict all = full;
  for (const auto& p : optim.state) {
    for (const auto& f : p.value()) all.insert(p.key() + "/" + f.key(), f.value());
  }
  tdist::save_safetensors(path, all);
}

void expect_reference(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& opt,
                      const std::string& what) {
  const StateDict want = tdist::load_safetensors(path);
  const StateDict full = tdist::full_state_dict(model, false);
  const auto optim = tdist::full_optimizer_state_dict(model, opt, false);
  size_t n = 0;
  for (const auto& item : full) {
    WORLD_CHECK(want.contains(item.key()) && torch::equal(want[item.key()], item.value()),
                what << ": '" << item.key() << "' differs");
    ++n;
  }
  for (const auto& p : optim.state) {
    for (const auto& f : p.value()) {
      const std::string name = p.key() + "/" + f.key();
      WORLD_CHECK(want.contains(name) && torch::equal(want[name], f.value()), what << ": '" << name << "' differs");
      ++n;
    }
  }
  WORLD_CHECK(n == want.size(), what << ": " << n << " tensors against " << want.size());
}

tdist::FullyShardedDataParallelOptions wrap_options() { return {}; }

// Trains an FSDP Net 2 steps at `world`, saves the sharded checkpoint, and
// keeps its full state as the reference.
void save_at(int world, const std::string& prefix, const std::string& reference) {
  ASSERT_EQ(run_world(world, [&](ProcessGroup& pg) {
    auto o = wrap_options();
    torch::manual_seed(1);
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01).amsgrad(true));
    train(model, opt, pg, 0, 2);
    tdist::save_sharded_checkpoint(prefix, pg, *model, &opt);
    save_reference(reference, *model, opt, pg.rank());
  }), "");
}

TEST(ShardedCheckpoint, FsdpResumesBitForBitInNewProcesses) {
  TempDir dir;
  const std::string prefix = dir.path() + "/ckpt", straight = dir.path() + "/straight.safetensors";
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    auto o = wrap_options();
    torch::manual_seed(1);
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    train(model, opt, pg, 0, 2);
    tdist::save_sharded_checkpoint(prefix, pg, *model, &opt);
    train(model, opt, pg, 2, 5);
    save_reference(straight, *model, opt, pg.rank());
  }), "");
  struct stat st {};
  for (int r = 0; r < 2; ++r) {
    const std::string file = prefix + "_rank-" + std::to_string(r) + "-of-2.pt";
    EXPECT_EQ(::stat(file.c_str(), &st), 0) << file;
  }
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    auto o = wrap_options();
    torch::manual_seed(99);  // other weights: the checkpoint must set them
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.5);
    tdist::load_sharded_checkpoint(prefix, pg, *model, &opt);
    train(model, opt, pg, 2, 5);
    expect_reference(straight, *model, opt, "resumed");
  }), "");
}

// Both hooks: the per-gradient one keeps 1-d Q memories, the batched one
// [side, r] matrices. The hook's state is stored as plain values in each
// rank's file (no LibTorch archive).
class DdpPowerSgd : public ::testing::TestWithParam<bool> {};

TEST_P(DdpPowerSgd, ResumesBitForBit) {
  TempDir dir;
  const std::string prefix = dir.path() + "/ddp", straight = dir.path() + "/straight.safetensors";
  tdist::PowerSGDOptions p;
  p.matrix_approximation_rank = 1;
  p.start_powerSGD_iter = 2;
  p.min_compression_rate = 0;
  const auto hook = GetParam() ? tdist::batched_powerSGD_hook : tdist::powerSGD_hook;
  const auto make = [&](int seed, std::shared_ptr<tdist::PowerSGDState>& state) {
    torch::manual_seed(seed);
    tdist::DistributedDataParallel<Net> ddp{Net()};
    state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), p);
    ddp->register_comm_hook(state, hook);
    return ddp;
  };
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    std::shared_ptr<tdist::PowerSGDState> state;
    auto ddp = make(1, state);
    torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.02).momentum(0.9));
    train(ddp, opt, pg, 0, 4);
    tdist::ShardedCheckpointOptions c;
    c.comm_hook_state = state;
    tdist::save_sharded_checkpoint(prefix, pg, *ddp, &opt, c);
    train(ddp, opt, pg, 4, 8);
    WORLD_CHECK(state->compression_stats().numel_before > 0, "PowerSGD compressed nothing");
    save_reference(straight, *ddp, opt, pg.rank());
  }), "");
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    std::shared_ptr<tdist::PowerSGDState> state;
    auto ddp = make(99, state);
    torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.02).momentum(0.9));
    tdist::ShardedCheckpointOptions c;
    // A hook state of other options is refused before anything changes.
    tdist::PowerSGDOptions other = p;
    other.matrix_approximation_rank = 2;
    c.comm_hook_state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), other);
    const auto before = tdist::full_state_dict(*ddp, false);
    try {
      tdist::load_sharded_checkpoint(prefix, pg, *ddp, &opt, c);
      WORLD_CHECK(false, "a hook state of other options loaded");
    } catch (const CheckpointError& e) {
      WORLD_CHECK(std::string(e.what()).find("different options") != std::string::npos, e.what());
    }
    for (const auto& item : tdist::full_state_dict(*ddp, false)) {
      WORLD_CHECK(torch::equal(item.value(), before[item.key()]), item.key() << " changed by a refused load");
    }
    c.comm_hook_state = state;
    tdist::load_sharded_checkpoint(prefix, pg, *ddp, &opt, c);
    WORLD_CHECK(state->iter() == 4, "the hook's iteration: " << state->iter());
    train(ddp, opt, pg, 4, 8);
    expect_reference(straight, *ddp, opt, "resumed with the hook's state");
  }), "");
  const tdist::checkpoint::PtReader r(prefix + "_rank-1-of-2.pt");
  const auto& hook_record = r.root().at("comm_hook");
  ASSERT_EQ(hook_record.kind(), tdist::checkpoint::PtValue::Kind::Dict);
  EXPECT_EQ(hook_record.at("kind").as_string(), "PowerSGD");
  EXPECT_EQ(hook_record.at("iter").as_int(), 4);
  ASSERT_FALSE(hook_record.at("buckets").items().empty());
  const auto& q = hook_record.at("buckets").items()[0].at("q").as_tensor();
  EXPECT_EQ(q.sizes.size(), GetParam() ? 2u : 1u);
}
INSTANTIATE_TEST_SUITE_P(Hooks, DdpPowerSgd, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "batched" : "per_gradient"); });

// A DDP Net with a PowerSGD hook trained 4 steps at world 2 (2 compressed)
// and saved with the hook's state under `prefix`.
void save_ddp_powersgd(const std::string& prefix, const tdist::PowerSGDOptions& p) {
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    torch::manual_seed(1);
    tdist::DistributedDataParallel<Net> ddp{Net()};
    auto state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), p);
    ddp->register_comm_hook(state, tdist::powerSGD_hook);
    torch::optim::SGD opt(ddp->parameters(), 0.02);
    train(ddp, opt, pg, 0, 4);
    tdist::ShardedCheckpointOptions c;
    c.comm_hook_state = state;
    tdist::save_sharded_checkpoint(prefix, pg, *ddp, &opt, c);
  }), "");
}

tdist::PowerSGDOptions hook_options() {
  tdist::PowerSGDOptions p;
  p.start_powerSGD_iter = 2;
  p.min_compression_rate = 0;
  return p;
}

// What TorchScript's print() printed in this process (its print handler).
std::string& printed() {
  static std::string text;
  return text;
}

// Loading prefix (with the hook's state) fails on both ranks with `says`,
// prints nothing from the file, and changes neither the model nor the hook.
void expect_hook_refused(const std::string& prefix, const std::string& says) {
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    torch::jit::setPrintHandler([](const std::string& s) { printed() += s; });
    torch::manual_seed(99);
    tdist::DistributedDataParallel<Net> ddp{Net()};
    auto state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), hook_options());
    torch::optim::SGD opt(ddp->parameters(), 0.02);
    const StateDict before = tdist::full_state_dict(*ddp, false);
    tdist::ShardedCheckpointOptions c;
    c.comm_hook_state = state;
    std::string error = "(it loaded)";
    try {
      tdist::load_sharded_checkpoint(prefix, pg, *ddp, &opt, c);
    } catch (const CheckpointError& e) {
      error = e.what();
    }
    WORLD_CHECK(printed().empty(), "code from the checkpoint ran: it printed '" << printed() << "'");
    WORLD_CHECK(error.find(says) != std::string::npos, "wanted '" << says << "', got: " << error);
    WORLD_CHECK(state->iter() == 0, "the hook's state changed");
    for (const auto& item : tdist::full_state_dict(*ddp, false)) {
      WORLD_CHECK(torch::equal(item.value(), before[item.key()]), item.key() << " changed by a refused load");
    }
  }), "");
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A rank file whose comm_hook record is a TorchScript archive (the layout
// tdist used to write, which LibTorch's loader would run): its
// __setstate__ prints. The load refuses it by its kind, before anything
// reads it, and nothing prints; without comm_hook_state the rest loads.
TEST(ShardedCheckpoint, ALegacyArchiveHookRecordIsRefusedAndRunsNothing) {
  const std::string archive = read_file(tdist::test::source_dir() + "/tests/checkpoint/data/hostile_setstate_archive.pt");
  ASSERT_GT(archive.size(), 1000u);
  {
    // The fixture is live: LibTorch's archive loader runs its code.
    printed().clear();
    torch::jit::setPrintHandler([](const std::string& s) { printed() += s; });
    torch::serialize::InputArchive a;
    a.load_from(archive.data(), archive.size());
    EXPECT_NE(printed().find("TDIST-HOSTILE-SETSTATE ran"), std::string::npos) << printed();
    torch::jit::setPrintHandler(torch::jit::getDefaultPrintHandler());
    printed().clear();
  }
  TempDir dir;
  const std::string prefix = dir.path() + "/ddp";
  save_ddp_powersgd(prefix, hook_options());
  at::Tensor blob = torch::empty({static_cast<int64_t>(archive.size())}, torch::kByte);
  std::memcpy(blob.data_ptr(), archive.data(), archive.size());
  for (int r = 0; r < 2; ++r) {
    tdist::test::rewrite_pt(
        prefix + "_rank-" + std::to_string(r) + "-of-2.pt",
        [&](tdist::checkpoint::PtValue& root) { tdist::test::entry(root, "comm_hook") = tdist::test::tensor_value("hook", blob); },
        {{"hook", blob}});
  }
  expect_hook_refused(prefix, "comm_hook record is a LibTorch archive");
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::DistributedDataParallel<Net> ddp{Net()};
    tdist::load_sharded_checkpoint(prefix, pg, *ddp);
  }), "");
}

// Hook records of tdist's layout with something wrong: each a
// CheckpointError naming the file and the field, before anything changes.
TEST(ShardedCheckpoint, ABadHookRecordIsNamedAndChangesNothing) {
  TempDir dir;
  const std::string prefix = dir.path() + "/ddp";
  save_ddp_powersgd(prefix, hook_options());
  const std::string r0 = prefix + "_rank-0-of-2.pt", r1 = prefix + "_rank-1-of-2.pt";
  const std::string good0 = read_file(r0), good1 = read_file(r1);
  using tdist::checkpoint::PtValue;
  using tdist::test::entry;
  struct Case {
    std::string what;
    std::function<void(PtValue&)> edit;
    std::string says;
  };
  const at::Tensor ints = torch::arange(6, torch::kLong);
  const std::vector<Case> cases = {
      {"an unknown key", [](PtValue& h) { entry(h, "code") = PtValue::string("os.system"); },
       "comm_hook: an unexpected key 'code'"},
      {"integer Q memory",
       [&](PtValue& h) { entry(entry(h, "buckets").mutable_items()[0], "q") = tdist::test::tensor_value("ints", ints); },
       "comm_hook.buckets[0].q: a Long tensor, not floating point"},
      {"a corrupt random state", [](PtValue& h) { entry(h, "rng") = PtValue::string("12 x"); },
       "the random state is corrupt"},
      {"a negative iteration", [](PtValue& h) { entry(h, "iter") = PtValue::integer(-1); }, "comm_hook.iter: -1"},
      {"a bucket DDP does not have",
       [](PtValue& h) { entry(entry(h, "buckets").mutable_items()[0], "index") = PtValue::integer(999); },
       "comm_hook record has bucket 999 but its DDP layout"},
      {"other options",
       [](PtValue& h) { entry(entry(h, "options"), "matrix_approximation_rank") = PtValue::integer(3); },
       "different options"},
      {"a string where a number goes",
       [](PtValue& h) { entry(entry(h, "stats"), "numel_before") = PtValue::string("many"); },
       "comm_hook.stats.numel_before: expected an int, found a string"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::ofstream(r0, std::ios::binary) << good0;
    std::ofstream(r1, std::ios::binary) << good1;
    tdist::test::rewrite_pt(r1, [&](PtValue& root) { c.edit(entry(root, "comm_hook")); }, {{"ints", ints}});
    expect_hook_refused(prefix, c.says);
  }
}

enum class Into { fsdp, plain, ddp };
struct Move {
  int from, to;
  Into into;
};

class Resharding : public ::testing::TestWithParam<Move> {};

TEST_P(Resharding, LoadsTheSavedFullStateExactly) {
  const Move m = GetParam();
  TempDir dir;
  const std::string prefix = dir.path() + "/ckpt", reference = dir.path() + "/full.safetensors";
  save_at(m.from, prefix, reference);
  const auto load_and_check = [&](const std::string& from_prefix, const std::string& what) {
    EXPECT_EQ(run_world(m.to, [&](ProcessGroup& pg) {
      torch::manual_seed(99);
      auto o = wrap_options();
      if (m.into == Into::fsdp) {
        FSDP<Net> model(Net(&o), o);
        torch::optim::Adam opt(model->parameters(), 0.5);
        tdist::load_sharded_checkpoint(from_prefix, pg, *model, &opt);
        expect_reference(reference, *model, opt, what);
        train(model, opt, pg, 2, 3);  // and it trains on, the ranks agreeing
        const auto head = tdist::full_state_dict(*model, false)["head.weight"];
        at::Tensor first = head.clone();
        pg.broadcast(first)->wait();
        WORLD_CHECK(torch::equal(first, head), what << ": the ranks differ after a step");
      } else if (m.into == Into::plain) {
        Net model;
        torch::optim::Adam opt(model->parameters(), 0.5);
        tdist::load_sharded_checkpoint(from_prefix, pg, *model, &opt);
        expect_reference(reference, *model, opt, what);
      } else {
        tdist::DistributedDataParallel<Net> ddp{Net()};
        torch::optim::Adam opt(ddp->parameters(), 0.5);
        tdist::load_sharded_checkpoint(from_prefix, pg, *ddp, &opt);
        expect_reference(reference, *ddp, opt, what);
      }
    }), "");
  };
  load_and_check(prefix, "loaded from world " + std::to_string(m.from));
  if (m.into != Into::fsdp) return;
  // Resharded by the tool first: each rank then reads only its own file.
  const auto r = tdist::test::run_command(kBin + "/tdist-ckpt reshard --ckpt_prefix " + prefix + " --world-size " +
                                              std::to_string(m.to) + " --out-prefix " + prefix + "_re",
                                          std::chrono::seconds(60));
  ASSERT_EQ(r.status, 0) << r.output;
  load_and_check(prefix + "_re", "resharded by tdist-ckpt");
}

// 2 -> 4: fc1's 5 rows leave rank 3 none, its first row past the end.
const Move kMoves[] = {{2, 3, Into::fsdp}, {3, 2, Into::fsdp}, {4, 1, Into::fsdp}, {2, 4, Into::fsdp},
                       {2, 1, Into::plain}, {2, 2, Into::ddp}};
// A DDP checkpoint (whole tensors, no shard metadata) into FSDP at world 3:
// each rank takes its rows of the model and of Adam's state.
TEST(ShardedCheckpoint, ADdpCheckpointLoadsIntoFsdp) {
  TempDir dir;
  const std::string prefix = dir.path() + "/ddp", reference = dir.path() + "/full.safetensors";
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    torch::manual_seed(1);
    tdist::DistributedDataParallel<Net> ddp{Net()};
    torch::optim::Adam opt(ddp->parameters(), 0.01);
    train(ddp, opt, pg, 0, 2);
    tdist::save_sharded_checkpoint(prefix, pg, *ddp, &opt);
    save_reference(reference, *ddp, opt, pg.rank());
  }), "");
  EXPECT_EQ(run_world(3, [&](ProcessGroup& pg) {
    auto o = wrap_options();
    torch::manual_seed(99);
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.5);
    tdist::load_sharded_checkpoint(prefix, pg, *model, &opt);
    expect_reference(reference, *model, opt, "DDP's checkpoint in FSDP");
  }), "");
}

// A save at another world size under the same prefix replaces the older
// save's files; a prefix holding two world sizes is refused on load.
TEST(ShardedCheckpoint, ASaveAtAnotherWorldSizeReplacesTheOlderFiles) {
  TempDir dir;
  const std::string prefix = dir.path() + "/ckpt", two = dir.path() + "/two.safetensors",
                    three = dir.path() + "/three.safetensors";
  save_at(2, prefix, two);
  const std::string stale = prefix + "_rank-0-of-2.pt", kept = dir.path() + "/stale.pt";
  std::filesystem::copy_file(stale, kept);
  save_at(3, prefix, three);
  // Checkpoint files are their user's alone.
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    if (e.path().string().rfind(prefix, 0) != 0) continue;
    const auto perms = std::filesystem::status(e.path()).permissions();
    EXPECT_EQ(perms & (std::filesystem::perms::group_all | std::filesystem::perms::others_all),
              std::filesystem::perms::none)
        << e.path();
  }
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_FALSE(std::filesystem::exists(prefix + "_rank-1-of-2.pt"));
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {  // the world-3 save, resharded
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.5);
    tdist::load_sharded_checkpoint(prefix, pg, *model, &opt);
    expect_reference(three, *model, opt, "the newer save");
  }), "");
  std::filesystem::copy_file(kept, stale);  // an older save's file back beside the newer ones
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    try {
      tdist::load_sharded_checkpoint(prefix, pg, *model);
      WORLD_CHECK(false, "a prefix of two world sizes loaded");
    } catch (const CheckpointError& e) {
      WORLD_CHECK(std::string(e.what()).find("different world sizes") != std::string::npos, e.what());
    }
  }), "");
}

std::string move_name(const ::testing::TestParamInfo<Move>& info) {
  static const char* const kInto[] = {"fsdp", "plain", "ddp"};
  return std::to_string(info.param.from) + "to" + std::to_string(info.param.to) + "_" +
         kInto[static_cast<int>(info.param.into)];
}
INSTANTIATE_TEST_SUITE_P(Worlds, Resharding, ::testing::ValuesIn(kMoves), move_name);

}  // namespace
