// The checkpoint tools and the failure cases of sharded checkpoints:
// `tdist-ckpt consolidate` (pt, safetensors, libtorch) gives the full
// state that the plain model loads, that Python's torch.load puts into an
// equivalent nn.Module (torch 1.13 and 2.x) and that the safetensors
// package reads; `tdist-ckpt inspect` lists it; the per-rank files load in
// Python; a kill -9 of a rank during a save leaves the previous checkpoint
// loadable; a missing, duplicated, truncated, corrupted, mixed or foreign
// file is a CheckpointError naming the file, and the model is unchanged.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "formats/pt_file.h"
#include "tdist/tdist.h"
#include "tests/checkpoint/rewrite.h"
#include "tests/fsdp/models.h"
#include "tests/util/damage.h"
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
namespace test = tdist::test;

const std::string kBin = tdist::test::bin_dir();
const std::string kVenvPython = tdist::test::source_dir() + "/.venv/bin/python";
const std::string kCheck = tdist::test::source_dir() + "/tests/checkpoint/consolidated_check.py";
const std::string kSafetensorsCheck = tdist::test::source_dir() + "/tests/checkpoint/safetensors_check.py";

std::string run(const std::string& command) {
  const auto r = test::run_command(command + " 2>&1", std::chrono::seconds(120));
  if (!test::exited_ok(r.status)) throw std::runtime_error(command + " failed:\n" + r.output);
  return r.output;
}

// An FSDP Net trained 2 steps at world 2 and saved as prefix's files; its
// full state (and Adam's) kept in `full`.
void make_checkpoint(const std::string& prefix, const std::string& full) {
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(1);
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    for (int s = 0; s < 2; ++s) {
      torch::manual_seed(80 + s);
      opt.zero_grad();
      model(torch::randn({8, 6}).narrow(0, 4 * pg.rank(), 4)).pow(2).sum().backward();
      opt.step();
    }
    tdist::save_sharded_checkpoint(prefix, pg, *model, &opt);
    const StateDict state = tdist::full_state_dict(*model);
    const auto optim = tdist::full_optimizer_state_dict(*model, opt);
    if (pg.rank() == 0) {
      StateDict all = state;
      for (const auto& p : optim.state) {
        for (const auto& f : p.value()) all.insert(p.key() + "/" + f.key(), f.value());
      }
      tdist::save_safetensors(full, all);
    }
  }), "");
}

class Tools : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_.path() + "/ckpt";
    full_ = dir_.path() + "/full.safetensors";
    make_checkpoint(prefix_, full_);
  }
  TempDir dir_;
  std::string prefix_, full_;
};

TEST_F(Tools, ConsolidateWritesTheFullStateThatEveryoneReads) {
  const StateDict want = tdist::load_safetensors(full_);
  const std::string out = dir_.path() + "/model.pt";
  run(kBin + "/tdist-ckpt consolidate --ckpt_prefix " + prefix_ + " --ckpt_suffix '_rank-*-of-*.pt' --save-path " +
      out + " --optimizer");
  // C++: the whole state by name, into the plain model.
  const auto c = tdist::load_consolidated_checkpoint(out);
  ASSERT_TRUE(c.has_optimizer);
  EXPECT_EQ(c.optimizer.optimizer, "Adam");
  size_t n = 0;
  for (const auto& item : c.model) {
    ASSERT_TRUE(want.contains(item.key())) << item.key();
    EXPECT_TRUE(torch::equal(item.value(), want[item.key()])) << item.key();
    ++n;
  }
  for (const auto& p : c.optimizer.state) {
    for (const auto& f : p.value()) {
      EXPECT_TRUE(torch::equal(f.value(), want[p.key() + "/" + f.key()])) << p.key() << "/" << f.key();
      ++n;
    }
  }
  EXPECT_EQ(n, want.size());
  Net plain;
  tdist::load_full_state_dict(*plain, c.model);
  const auto x = torch::arange(12, torch::kFloat).reshape({2, 6}) / 10;
  const at::Tensor mine = plain(x).flatten();
  // Python, torch 1.13 and 2.x: load_state_dict into the nn.Module twin, the same forward.
  for (const std::string& python : {std::string("/usr/bin/python3"), kVenvPython}) {
    const auto seen = nlohmann::json::parse(run(python + " " + kCheck + " module " + out));
    const auto out_values = seen["out"].get<std::vector<float>>();
    ASSERT_EQ(out_values.size(), 6u) << python;
    for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(out_values[i], mine[static_cast<int64_t>(i)].item<float>(), 1e-5) << python;
    EXPECT_EQ(seen["optimizer"], "Adam");
    EXPECT_EQ(seen["state"].size(), want.size() - c.model.size()) << python;
  }
  // safetensors: the package reads the same names, shapes and bytes.
  const std::string st = dir_.path() + "/model.safetensors";
  run(kBin + "/tdist-ckpt consolidate --ckpt-prefix " + prefix_ + " --format safetensors --save-path " + st);
  const auto listed = nlohmann::json::parse(run(kVenvPython + " " + kSafetensorsCheck + " read " + st));
  EXPECT_EQ(listed["tensors"].size(), c.model.size());
  const StateDict back = tdist::load_safetensors(st);
  for (const auto& item : c.model) {
    ASSERT_TRUE(listed["tensors"].contains(item.key())) << item.key();
    EXPECT_EQ(listed["tensors"][item.key()][1].get<std::vector<int64_t>>(), item.value().sizes().vec());
    EXPECT_TRUE(torch::equal(back[item.key()], item.value())) << item.key();
  }
  // libtorch: LibTorch's archive cannot hold a module named "in" (Net's
  // first layer); the tool says so and writes nothing.
  const std::string lt = dir_.path() + "/model.libtorch.pt";
  const auto refused = test::run_command(kBin + "/tdist-ckpt consolidate --ckpt-prefix " + prefix_ +
                                             " --format libtorch --save-path " + lt + " 2>&1",
                                         std::chrono::seconds(60));
  EXPECT_FALSE(test::exited_ok(refused.status));
  EXPECT_NE(refused.output.find("'in' has the step 'in', a Python keyword"), std::string::npos)
      << refused.output;
  EXPECT_FALSE(std::filesystem::exists(lt));
}

// The libtorch format: torch::load puts it into the plain module.
TEST(ToolsLibtorch, ConsolidatesIntoTorchLoadsArchive) {
  TempDir dir;
  const std::string prefix = dir.path() + "/seq", lt = dir.path() + "/seq.libtorch.pt";
  const auto make = [] {
    return torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::ReLU(), torch::nn::Linear(5, 3),
                                 torch::nn::BatchNorm1d(3));
  };
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    torch::manual_seed(1);
    FSDP<torch::nn::Sequential> model(make());
    tdist::save_sharded_checkpoint(prefix, pg, *model);
    const StateDict full = tdist::full_state_dict(*model);
    if (pg.rank() == 0) tdist::save_safetensors(dir.path() + "/want.safetensors", full);
  }), "");
  run(kBin + "/tdist-ckpt consolidate --ckpt-prefix " + prefix + " --format libtorch --save-path " + lt);
  const StateDict want = tdist::load_safetensors(dir.path() + "/want.safetensors");
  torch::manual_seed(7);
  auto plain = make();
  torch::load(plain, lt);
  size_t n = 0;
  for (const auto& p : plain->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << p.key();
    ++n;
  }
  for (const auto& b : plain->named_buffers()) {
    EXPECT_TRUE(torch::equal(b.value(), want[b.key()])) << b.key();
    ++n;
  }
  EXPECT_EQ(n, want.size());
}

TEST_F(Tools, InspectAndPythonSeeThePerRankFiles) {
  const auto info = nlohmann::json::parse(run(kBin + "/tdist-ckpt inspect --ckpt-prefix " + prefix_ + " --json"));
  EXPECT_EQ(info["world_size"], 2);
  EXPECT_EQ(info["optimizer"], "Adam");
  bool seen = false;
  for (const auto& t : info["model"]) {
    if (t["name"] == "block1.fc1.weight") {
      seen = true;
      EXPECT_EQ(t["shape"], nlohmann::json::array({5, 7}));
      EXPECT_EQ(t["bytes"], 5 * 7 * 4);
      EXPECT_EQ(t["sharded"], true);
    }
  }
  EXPECT_TRUE(seen);
  EXPECT_NE(run(kBin + "/tdist-ckpt inspect --ckpt-prefix " + prefix_).find("world size 2"), std::string::npos);
  for (const std::string& python : {std::string("/usr/bin/python3"), kVenvPython}) {
    const auto file = nlohmann::json::parse(run(python + " " + kCheck + " rank " + prefix_ + "_rank-1-of-2.pt"));
    EXPECT_EQ(file["keys"], nlohmann::json::array({"comm_hook", "model", "optimizer", "shard_metadata", "tdist"}));
    EXPECT_EQ(file["world_size"], 2);
    EXPECT_EQ(file["rank"], 1);
    EXPECT_EQ(file["model"]["block1.fc1.weight"], nlohmann::json::array({2, 7}));  // rows 3..4 of 5
  }
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
void spit(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// Loading prefix's checkpoint into a world-2 FSDP Net fails with `says` on
// every rank, and the model keeps its weights.
void expect_refused(const std::string& prefix, const std::string& says) {
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(99);
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.5);
    const StateDict before = tdist::full_state_dict(*model, false);
    try {
      tdist::load_sharded_checkpoint(prefix, pg, *model, &opt);
      WORLD_CHECK(false, "loaded: " << says);
    } catch (const CheckpointError& e) {
      WORLD_CHECK(std::string(e.what()).find(says) != std::string::npos, "'" << e.what() << "' lacks '" << says << "'");
    }
    for (const auto& item : tdist::full_state_dict(*model, false)) {
      WORLD_CHECK(torch::equal(item.value(), before[item.key()]), item.key() << " changed by a refused load");
    }
  }), "") << says;
}

TEST_F(Tools, EveryBrokenCheckpointIsNamed) {
  const std::string r0 = prefix_ + "_rank-0-of-2.pt", r1 = prefix_ + "_rank-1-of-2.pt";
  const std::string good0 = slurp(r0), good1 = slurp(r1);
  const auto restore = [&] {
    spit(r0, good0);
    spit(r1, good1);
  };
  // A missing rank (a reshard or consolidate run finds it too).
  std::remove(r1.c_str());
  expect_refused(prefix_, "rank 1 of 2 is missing: no " + r1);
  EXPECT_NE(test::run_command(kBin + "/tdist-ckpt consolidate --ckpt-prefix " + prefix_ + " 2>&1",
                              std::chrono::seconds(60)).output.find("rank 1 of 2 is missing"),
            std::string::npos);
  restore();
  // A duplicated rank.
  spit(prefix_ + "_rank-01-of-2.pt", good1);
  EXPECT_THROW(tdist::inspect_sharded_checkpoint(prefix_), CheckpointError);
  std::remove((prefix_ + "_rank-01-of-2.pt").c_str());
  // Mixed world sizes under one prefix.
  spit(prefix_ + "_rank-2-of-3.pt", good1);
  try {
    tdist::consolidate_sharded_model_checkpoints(prefix_, "_rank-*-of-*.pt", dir_.path() + "/x.pt");
    ADD_FAILURE() << "mixed world sizes consolidated";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("different world sizes"), std::string::npos) << e.what();
  }
  std::remove((prefix_ + "_rank-2-of-3.pt").c_str());
  // Truncated: the zip directory is gone.
  spit(r1, good1.substr(0, good1.size() / 2));
  expect_refused(prefix_, r1);
  // A flipped byte in the middle (tensor data or pickle): a checksum says so.
  std::string bad = good1;
  ASSERT_NO_FATAL_FAILURE(test::flip_byte(bad, bad.size() / 3, 0x40));
  spit(r1, bad);
  expect_refused(prefix_, r1);
  restore();
  // Another save's file for one rank: the ranks' files disagree.
  const std::string other = dir_.path() + "/other";
  make_checkpoint(other, dir_.path() + "/other.safetensors");
  spit(r1, slurp(other + "_rank-1-of-2.pt"));
  expect_refused(prefix_, "different saves");
  restore();
  // Another optimizer than the one saved: refused before the model changes.
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(99);
    FSDP<Net> model(Net(&o), o);
    torch::optim::SGD opt(model->parameters(), 0.1);
    const StateDict before = tdist::full_state_dict(*model, false);
    try {
      tdist::load_sharded_checkpoint(prefix_, pg, *model, &opt);
      WORLD_CHECK(false, "Adam's state loaded into SGD");
    } catch (const CheckpointError& e) {
      WORLD_CHECK(std::string(e.what()).find("the state is Adam's, the optimizer SGD") != std::string::npos, e.what());
    }
    for (const auto& item : tdist::full_state_dict(*model, false)) {
      WORLD_CHECK(torch::equal(item.value(), before[item.key()]), item.key() << " changed by a refused load");
    }
  }), "");
  // A checkpoint of another model: the names say so.
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(3);
    FSDP<Net> model(Net(&o, /*blocks=*/2), o);
    try {
      tdist::load_sharded_checkpoint(prefix_, pg, *model);
      WORLD_CHECK(false, "another model's checkpoint loaded");
    } catch (const CheckpointError& e) {
      WORLD_CHECK(std::string(e.what()).find("block2") != std::string::npos, e.what());
    }
  }), "");
  // And the restored files load.
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    FSDP<Net> model(Net(&o), o);
    tdist::load_sharded_checkpoint(prefix_, pg, *model);
  }), "");
}

// An optimizer record with a tensor where a number goes (param_groups'
// lr) or other odd values: a CheckpointError naming the field, from the
// tools and the loads, never a library's exception ("unordered_map::at").
TEST_F(Tools, AnOddOptimizerRecordIsNamed) {
  using tdist::checkpoint::PtValue;
  using test::entry;
  const std::string r0 = prefix_ + "_rank-0-of-2.pt", r1 = prefix_ + "_rank-1-of-2.pt";
  const std::string good0 = slurp(r0), good1 = slurp(r1);
  const at::Tensor lr = torch::ones({1});
  struct Case {
    std::string what;
    std::function<void(PtValue&)> edit;  // of the optimizer record
    std::string says;
  };
  const auto group0 = [](PtValue& opt) -> PtValue& { return entry(opt, "param_groups").mutable_items()[0]; };
  const std::vector<Case> cases = {
      {"a tensor as lr", [&](PtValue& o) { entry(group0(o), "lr") = test::tensor_value("lr", lr); },
       "optimizer.param_groups[0].lr: expected a float, found a tensor"},
      {"a NaN lr", [&](PtValue& o) { entry(group0(o), "lr") = PtValue::floating(NAN); },
       "optimizer.param_groups[0].lr: not a finite number"},
      {"a tensor as the kind", [&](PtValue& o) { entry(o, "optimizer") = test::tensor_value("lr", lr); },
       "optimizer.optimizer: expected a string, found a tensor"},
      {"a number as a parameter name", [&](PtValue& o) { entry(group0(o), "params").mutable_items()[0] = PtValue::integer(7); },
       "optimizer.param_groups[0].params[0]: expected a string, found an int"},
      {"a rank past the world", [&](PtValue& o) { entry(o, "rank") = PtValue::integer(int64_t{1} << 32); },
       "optimizer.rank: 4294967296 is outside [0, 1]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    spit(r0, good0);
    spit(r1, good1);
    for (const auto& path : {r0, r1}) {
      test::rewrite_pt(path, [&](PtValue& root) { c.edit(entry(root, "optimizer")); }, {{"lr", lr}});
    }
    for (const auto format : {tdist::CheckpointFormat::pt, tdist::CheckpointFormat::safetensors}) {
      try {
        tdist::consolidate_sharded_model_checkpoints(prefix_, "_rank-*-of-*.pt", dir_.path() + "/out",
                                                     {format, /*optimizer=*/true});
        ADD_FAILURE() << "consolidated";
      } catch (const CheckpointError& e) {
        EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << e.what();
      }
    }
    const auto cli = test::run_command(kBin + "/tdist-ckpt consolidate --optimizer --ckpt-prefix " + prefix_ +
                                           " --save-path " + dir_.path() + "/out.pt 2>&1",
                                       std::chrono::seconds(60));
    EXPECT_FALSE(test::exited_ok(cli.status));
    EXPECT_NE(cli.output.find(c.says), std::string::npos) << cli.output;
    expect_refused(prefix_, c.says);
  }
  spit(r0, good0);
  spit(r1, good1);
}

void kill_self(int) { ::kill(::getpid(), SIGKILL); }

// Rank 1 is killed (SIGKILL, from inside) in the middle of the second save:
// a file-size limit of 4 KiB stops its first write past that into its
// temporary file with SIGXFSZ, whose handler kills the process, so the kill
// lands there every time however the machine schedules. Rank 0's save fails
// without replacing its file, and the first checkpoint loads whole.
TEST_F(Tools, AKillDuringASaveLeavesThePreviousCheckpoint) {
  const std::string r1 = prefix_ + "_rank-1-of-2.pt";
  const std::string before0 = slurp(prefix_ + "_rank-0-of-2.pt"), before1 = slurp(r1);
  ASSERT_GT(before1.size(), 4096u) << "rank 1's file must outgrow the limit below";
  test::WorldOptions w;
  w.final_barrier = false;
  w.timeout = std::chrono::seconds(5);
  const std::string failures = run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(5);
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    if (pg.rank() == 1) {
      ::signal(SIGXFSZ, kill_self);
      const rlimit limit{4096, 4096};
      ::setrlimit(RLIMIT_FSIZE, &limit);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // rank 1 writes first
    }
    tdist::ShardedCheckpointOptions c;
    c.timeout = std::chrono::seconds(5);
    try {
      tdist::save_sharded_checkpoint(prefix_, pg, *model, &opt, c);
      WORLD_CHECK(false, "the save went through with a rank killed");
    } catch (const CheckpointError& e) {
      WORLD_CHECK(std::string(e.what()).find("nothing was replaced") != std::string::npos, e.what());
    }
  }, w);
  EXPECT_NE(failures.find("rank 1"), std::string::npos) << failures;
  EXPECT_EQ(failures.find("rank 0"), std::string::npos) << failures;
  EXPECT_EQ(slurp(prefix_ + "_rank-0-of-2.pt"), before0);
  EXPECT_EQ(slurp(r1), before1);
  for (const auto& entry : std::filesystem::directory_iterator(dir_.path())) {
    const std::string name = entry.path().filename().string();
    if (name.find(".tmp-") != std::string::npos && name.find("rank-0") != std::string::npos) {
      ADD_FAILURE() << "rank 0 left " << name;
    }
  }
  EXPECT_NO_THROW(tdist::consolidate_sharded_model_checkpoints(prefix_, "_rank-*-of-*.pt", dir_.path() + "/c.pt"));
}

// The streaming tools hand a record's bytes on before its CRC is known; a
// corrupt record must still leave nothing behind: no output under its
// name, no temporary file. (The libtorch format reads each tensor whole
// before writing anything; and Net's module "in" keeps it from this model.)
TEST_F(Tools, ACorruptRecordFailsEveryToolAndLeavesNoOutput) {
  const std::string r1 = prefix_ + "_rank-1-of-2.pt";
  std::string bytes = slurp(r1);
  // The last byte before the local header that follows the largest
  // stretch between two storage records' names (before the zip's central
  // directory): the last byte of tensor data.
  const size_t directory = bytes.find(std::string("PK\x01\x02", 4));
  size_t best_at = 0, best_len = 0;
  for (size_t at = bytes.find("/data/"); at < directory;) {
    const size_t next = bytes.find("/data/", at + 1);
    if (next >= directory) break;
    if (next - at > best_len) best_at = at, best_len = next - at;
    at = next;
  }
  ASSERT_GT(best_len, 0u);
  const size_t next_header = bytes.rfind(std::string("PK\x03\x04", 4), best_at + best_len);
  ASSERT_GT(next_header, best_at);
  ASSERT_NO_FATAL_FAILURE(test::flip_byte(bytes, next_header - 1));
  spit(r1, bytes);
  const std::vector<std::string> commands = {
      "consolidate --ckpt-prefix " + prefix_ + " --optimizer --save-path " + dir_.path() + "/out.pt",
      "consolidate --ckpt-prefix " + prefix_ + " --format safetensors --save-path " + dir_.path() + "/out.st",
      "reshard --ckpt-prefix " + prefix_ + " --world-size 3 --out-prefix " + dir_.path() + "/re"};
  for (const auto& c : commands) {
    const auto r = test::run_command(kBin + "/tdist-ckpt " + c + " 2>&1", std::chrono::seconds(60));
    EXPECT_FALSE(test::exited_ok(r.status)) << c;
    EXPECT_NE(r.output.find(r1 + ": record"), std::string::npos) << c << ": " << r.output;
    EXPECT_NE(r.output.find("is corrupt"), std::string::npos) << c << ": " << r.output;
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir_.path())) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(name.rfind("ckpt_rank-", 0) == 0 || name == "full.safetensors") << "left behind: " << name;
  }
}

// tdist-ckpt streams without LibTorch (its memory is what it moves): it
// must not link libtorch_cpu; tdist-ckpt-libtorch, which it runs for the
// libtorch format, does.
TEST(ToolsLinking, TdistCkptLoadsC10ButNotLibTorch) {
  const auto needed = [](const std::string& exe) {
    const auto r = test::run_command("readelf -d " + exe + " 2>&1", std::chrono::seconds(30));
    if (!test::exited_ok(r.status)) throw std::runtime_error("readelf failed: " + r.output);
    return r.output;
  };
  const std::string plain = needed(kBin + "/tdist-ckpt"), with = needed(kBin + "/tdist-ckpt-libtorch");
  EXPECT_NE(plain.find("[libc10"), std::string::npos) << plain;
  // The NEEDED lines only ("[libname]"): a runpath may well say "libtorch".
  EXPECT_EQ(plain.find("[libtorch"), std::string::npos) << plain;
  EXPECT_EQ(plain.find("[libtdist"), std::string::npos) << plain;
  EXPECT_NE(with.find("[libtdist"), std::string::npos) << with;
}

}  // namespace
