// tdist-ckpt and the files tdist opens, against hostile names and outputs:
// a FIFO, a directory or a device named where a rank file, a consolidated
// file, a safetensors file, a token file or a store file is expected is a
// clear error naming the path and its type, within seconds (each case runs
// in its own process with a deadline, so a hang fails the test instead of
// stalling it); consolidate and reshard refuse outputs that are, or would
// join, their input (another spelling, a hard link, a name the input's
// pattern matches, a prefix holding another world size), in the library as
// in the tool, and leave the checkpoint loadable; inspect escapes the names
// it prints and lists the records it does not show, and reads a
// Checkpointer's directory (its root, through the latest marker, or a step
// folder), refusing a bad marker by name; every usage error of tdist-ckpt,
// tdist-bench and tdist-store-server exits 2.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_tree.h"
#include "formats/pt_file.h"
#include "tdist/tdist.h"
#include "tests/fsdp/models.h"
#include "tests/util/process.h"
#include "tests/util/world.h"
#include "tests/util/paths.h"

namespace {

namespace test = tdist::test;
using tdist::FSDP;
using tdist::ProcessGroup;
using tdist::checkpoint::PtReader;
using tdist::checkpoint::PtTensorRef;
using tdist::checkpoint::PtValue;
using tdist::checkpoint::PtWriter;

// TDIST_TEST_BIN_DIR runs the same checks against another build's programs
// (an older tdist, to see them fail).
const std::string kBin = tdist::test::bin_dir();
constexpr auto kDeadline = std::chrono::seconds(30);

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A command's exit code (-1: killed by a signal, or past the deadline) and output.
struct Ran {
  int code = -1;
  std::string output;
};
Ran sh(const std::string& command) {
  const auto r = test::run_command(command + " 2>&1", kDeadline);
  return {r.status >= 0 && WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1, r.output};
}

// An FSDP Net with Adam saved at world 2 as prefix's files.
void make_checkpoint(const std::string& prefix) {
  ASSERT_EQ(test::run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(1);
    FSDP<test::Net> model(test::Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    model(torch::randn({4, 6})).pow(2).sum().backward();
    opt.step();
    tdist::save_sharded_checkpoint(prefix, pg, *model, &opt);
  }), "");
}

class CkptTool : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_.path() + "/ck";
    make_checkpoint(prefix_);
    r0_ = prefix_ + "_rank-0-of-2.pt";
    r1_ = prefix_ + "_rank-1-of-2.pt";
    good0_ = slurp(r0_);
    good1_ = slurp(r1_);
  }
  // The checkpoint is as saved and still loads.
  void expect_intact() {
    EXPECT_TRUE(slurp(r0_) == good0_) << r0_ << " changed";
    EXPECT_TRUE(slurp(r1_) == good1_) << r1_ << " changed";
    EXPECT_EQ(tdist::inspect_sharded_checkpoint(prefix_).world_size, 2);
  }
  test::TempDir dir_;
  std::string prefix_, r0_, r1_, good0_, good1_;
};

// Runs fn in a child process with a deadline: what it threw (its type and
// message), or "hung" / "no error".
std::string error_in_child(const std::function<void()>& fn, const std::string& dir) {
  const std::string out = dir + "/child-error";
  const pid_t pid = test::fork_child([&] {
    std::string what = "no error";
    try {
      fn();
    } catch (const tdist::CheckpointError& e) {
      what = std::string("CheckpointError: ") + e.what();
    } catch (const tdist::StoreError& e) {
      what = std::string("StoreError: ") + e.what();
    } catch (const tdist::UsageError& e) {
      what = std::string("UsageError: ") + e.what();
    } catch (const std::exception& e) {
      what = std::string("other: ") + e.what();
    }
    std::ofstream(out) << what;
    return 0;
  });
  const int status = test::wait_child(pid, std::chrono::seconds(20));
  if (status == -1) return "hung";
  return slurp(out);
}

// Each special file that can stand where a regular one is expected, made at
// `path` (its description as tdist names it).
std::vector<std::pair<std::string, std::function<void(const std::string&)>>> special_kinds() {
  return {
      {"is a FIFO (named pipe), not a regular file", [](const std::string& p) { ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0); }},
      {"is a directory, not a regular file", [](const std::string& p) { ASSERT_EQ(::mkdir(p.c_str(), 0700), 0); }},
      {"is a character device, not a regular file",
       [](const std::string& p) { ASSERT_EQ(::symlink("/dev/zero", p.c_str()), 0); }},
  };
}

TEST_F(CkptTool, ASpecialFileNamedLikeARankFileIsRefusedNotWaitedOn) {
  for (const auto& [says, make] : special_kinds()) {
    for (const std::string& victim : {r0_, r1_}) {
      std::remove(victim.c_str());
      make(victim);
      for (const std::string& cmd : {"inspect --ckpt-prefix " + prefix_, "consolidate --ckpt-prefix " + prefix_,
                                    "reshard --world-size 3 --ckpt-prefix " + prefix_}) {
        const auto t = std::chrono::steady_clock::now();
        const Ran r = sh(kBin + "/tdist-ckpt " + cmd);
        EXPECT_EQ(r.code, 1) << cmd << " with " << victim << " " << says << ":\n" << r.output;
        EXPECT_NE(r.output.find(victim + ": " + says), std::string::npos) << r.output;
        EXPECT_LT(std::chrono::steady_clock::now() - t, std::chrono::seconds(10));
      }
      // The library too.
      const std::string err = error_in_child([&] { tdist::inspect_sharded_checkpoint(prefix_); }, dir_.path());
      EXPECT_EQ(err, "CheckpointError: " + victim + ": " + says);
      ::rmdir(victim.c_str());
      std::remove(victim.c_str());
      std::ofstream(victim, std::ios::binary) << (victim == r0_ ? good0_ : good1_);
    }
  }
  expect_intact();
}

TEST(OpenRegular, EveryKindOfInputRefusesASpecialFileWithinSeconds) {
  test::TempDir dir;
  for (const auto& [says, make] : special_kinds()) {
    const std::string p = dir.path() + "/input";
    make(p);
    EXPECT_EQ(error_in_child([&] { tdist::load_consolidated_checkpoint(p); }, dir.path()),
              "CheckpointError: " + p + ": " + says);
    EXPECT_EQ(error_in_child([&] { tdist::load_safetensors(p); }, dir.path()), "CheckpointError: " + p + ": " + says);
    // A FileStore at the path (not through a link: the device's link is refused as a link).
    const std::string store = error_in_child([&] { tdist::FileStore s(p); }, dir.path());
    EXPECT_EQ(store.rfind("StoreError: FileStore: " + p + ": ", 0), 0u) << store;
    EXPECT_TRUE(store.find(says) != std::string::npos || store.find("symbolic link") != std::string::npos) << store;
    // A token file, through the server that reads it.
    const Ran server = sh("TDIST_STORE_TOKEN_FILE=" + p + " " + kBin + "/tdist-store-server --port 0");
    EXPECT_EQ(server.code, 2) << server.output;
    EXPECT_NE(server.output.find(p), std::string::npos) << server.output;
    // The peak-memory file tdist-ckpt writes on request: reported, not waited on.
    const Ran peak = sh("TDIST_CKPT_PEAK_RSS_FILE=" + p + " " + kBin + "/tdist-ckpt --help");
    EXPECT_EQ(peak.code, 0) << peak.output;
    EXPECT_NE(peak.output.find("TDIST_CKPT_PEAK_RSS_FILE " + p), std::string::npos) << peak.output;
    ::rmdir(p.c_str());
    std::remove(p.c_str());
  }
}

TEST_F(CkptTool, ConsolidateRefusesToWriteOverOrBesideItsInput) {
  ASSERT_EQ(::link(r1_.c_str(), (dir_.path() + "/hard.pt").c_str()), 0);
  ASSERT_EQ(::mkdir((dir_.path() + "/sub").c_str(), 0700), 0);
  for (const std::string& out : {r0_, dir_.path() + "/sub/../ck_rank-1-of-2.pt", dir_.path() + "/hard.pt",
                                 prefix_ + "_rank-0-of-3.pt", dir_.path() + "/./ck_rank-2-of-2.pt"}) {
    for (const char* format : {"pt", "safetensors"}) {
      const Ran r = sh(kBin + "/tdist-ckpt consolidate --ckpt-prefix " + prefix_ + " --format " + format +
                       " --save-path " + out);
      EXPECT_EQ(r.code, 2) << out << ":\n" << r.output;
      EXPECT_NE(r.output.find("the output " + out), std::string::npos) << r.output;
    }
    EXPECT_THROW(tdist::consolidate_sharded_model_checkpoints(prefix_, "_rank-*-of-*.pt", out), tdist::UsageError);
    tdist::ConsolidateOptions lt;
    lt.format = tdist::CheckpointFormat::libtorch;
    EXPECT_THROW(tdist::consolidate_sharded_model_checkpoints(prefix_, "_rank-*-of-*.pt", out, lt), tdist::UsageError);
    expect_intact();
    EXPECT_FALSE(std::ifstream(prefix_ + "_rank-0-of-3.pt").good());
  }
  // Elsewhere it writes.
  const Ran ok = sh(kBin + "/tdist-ckpt consolidate --ckpt-prefix " + prefix_ + " --save-path " + dir_.path() + "/full.pt");
  EXPECT_EQ(ok.code, 0) << ok.output;
  expect_intact();
}

TEST_F(CkptTool, ReshardRefusesAPrefixThatHoldsTheInputOrAnotherWorld) {
  ASSERT_EQ(::mkdir((dir_.path() + "/same").c_str(), 0700), 0);
  // The same prefix spelled differently, at the same and another world size.
  for (const std::string& out : {dir_.path() + "/same/../ck", dir_.path() + "/./ck"}) {
    for (const int world : {2, 3}) {
      const Ran r = sh(kBin + "/tdist-ckpt reshard --ckpt-prefix " + prefix_ + " --world-size " +
                       std::to_string(world) + " --out-prefix " + out);
      EXPECT_EQ(r.code, 2) << out << " " << world << ":\n" << r.output;
      EXPECT_THROW(tdist::reshard_sharded_checkpoint(prefix_, "_rank-*-of-*.pt", world, out), tdist::UsageError);
      expect_intact();
    }
  }
  // A prefix holding another checkpoint (world 2) cannot take world 3; world 2 again replaces its files.
  const std::string other = dir_.path() + "/other";
  ASSERT_EQ(sh(kBin + "/tdist-ckpt reshard --ckpt-prefix " + prefix_ + " --world-size 2 --out-prefix " + other).code, 0);
  const Ran mixed = sh(kBin + "/tdist-ckpt reshard --ckpt-prefix " + prefix_ + " --world-size 3 --out-prefix " + other);
  EXPECT_EQ(mixed.code, 2) << mixed.output;
  EXPECT_NE(mixed.output.find("already holds another checkpoint"), std::string::npos) << mixed.output;
  EXPECT_THROW(tdist::reshard_sharded_checkpoint(prefix_, "_rank-*-of-*.pt", 3, other), tdist::UsageError);
  EXPECT_EQ(tdist::inspect_sharded_checkpoint(other).world_size, 2);
  EXPECT_EQ(sh(kBin + "/tdist-ckpt reshard --ckpt-prefix " + prefix_ + " --world-size 2 --out-prefix " + other).code, 0);
  // A hard link of an input under the output prefix.
  ASSERT_EQ(::link(r0_.c_str(), (dir_.path() + "/linked_rank-0-of-2.pt").c_str()), 0);
  EXPECT_EQ(sh(kBin + "/tdist-ckpt reshard --ckpt-prefix " + prefix_ + " --world-size 2 --out-prefix " +
               dir_.path() + "/linked").code, 2);
  expect_intact();
}

// Rewrites a rank file with `edit` applied to its root (the tensors' bytes
// copied as they are).
void rewrite(const std::string& path, const std::function<void(PtValue&)>& edit) {
  std::map<std::string, PtTensorRef> refs;
  std::string bytes;
  PtValue root;
  {
    const PtReader in(path);
    std::function<void(const PtValue&)> walk = [&](const PtValue& v) {
      if (v.kind() == PtValue::Kind::Tensor) refs.emplace(v.as_tensor().storage_key, v.as_tensor());
      if (v.kind() == PtValue::Kind::List || v.kind() == PtValue::Kind::Tuple) for (const auto& i : v.items()) walk(i);
      if (v.kind() == PtValue::Kind::Dict) for (const auto& e : v.entries()) walk(e.second);
    };
    walk(in.root());
    root = in.root();
    edit(root);
    PtWriter out(path + ".new");
    out.begin(root);
    for (const auto& key : tdist::checkpoint::tensor_keys(root)) {
      out.begin_storage(key);
      in.stream_storage(refs.at(key), [&](const char* d, size_t n) { out.append(d, n); });
      out.end_storage();
    }
    out.finish();
  }
  ASSERT_EQ(std::rename((path + ".new").c_str(), path.c_str()), 0);
}

TEST_F(CkptTool, InspectListsTheRecordsItDoesNotShow) {
  rewrite(r1_, [](PtValue& root) {
    for (auto& [name, v] : root.mutable_entries()) {
      if (name == "comm_hook") v = PtValue::string(std::string(100, 'x'));
    }
    root.mutable_entries().emplace_back("payload", PtValue::dict({{"a", PtValue::integer(1)}}));
  });
  const Ran text = sh(kBin + "/tdist-ckpt inspect --ckpt-prefix " + prefix_);
  ASSERT_EQ(text.code, 0) << text.output;
  EXPECT_NE(text.output.find(r1_ + ": comm_hook (a string of 100 bytes; malformed DDP comm hook state, loads refuse it"),
            std::string::npos)
      << text.output;
  EXPECT_NE(text.output.find(r1_ + ": payload (a dict of 1 entries; unknown to tdist)"), std::string::npos)
      << text.output;
  const auto json = nlohmann::json::parse(sh(kBin + "/tdist-ckpt inspect --json --ckpt-prefix " + prefix_).output);
  EXPECT_EQ(json["other_records"].size(), 2u) << json.dump();
  EXPECT_EQ(tdist::inspect_sharded_checkpoint(prefix_).other_records.size(), 2u);
  // A checkpoint as tdist saves it has none.
  std::ofstream(r1_, std::ios::binary) << good1_;
  EXPECT_TRUE(tdist::inspect_sharded_checkpoint(prefix_).other_records.empty());
}

TEST_F(CkptTool, ReshardRefusesDdpBucketsThatAreNotIndexLists) {
  // Copied into every resharded file, so checked first: a tensor hidden
  // there would otherwise surface as a writer-order error, a string as junk.
  for (const PtValue& odd : {PtValue::string("x"), PtValue::list({PtValue::list({PtValue::integer(-1)})}),
                             PtValue::list({PtValue::list({PtValue::string("0")})})}) {
    rewrite(r0_, [&](PtValue& root) {
      for (auto& [name, v] : root.mutable_entries()) {
        if (name != "tdist") continue;
        for (auto& [key, tag] : v.mutable_entries()) {
          if (key == "ddp_buckets") tag = odd;
        }
      }
    });
    test::TempDir out;
    const Ran r = sh(kBin + "/tdist-ckpt reshard --ckpt-prefix " + prefix_ + " --world-size 3 --out-prefix " +
                     out.path() + "/ck");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(r0_ + ": tdist.ddp_buckets "), std::string::npos) << r.output;
    std::ofstream(r0_, std::ios::binary) << good0_;
  }
}

TEST_F(CkptTool, InspectEscapesNamesAsJsonDoes) {
  const std::string evil = "fc1.w\x1b]0;owned\x07\x1b[2J\xc2\x9b" "31m";
  // The first model entry of each file renamed (one not sharded, rank 0's alone).
  std::string renamed;
  for (const std::string& path : {r0_, r1_}) {
    rewrite(path, [&](PtValue& root) {
      for (auto& [name, v] : root.mutable_entries()) {
        if (name != "model") continue;
        for (auto& [tensor, t] : v.mutable_entries()) {
          if (renamed.empty()) renamed = tensor;
          if (tensor == renamed) tensor = evil;
        }
      }
    });
  }
  const Ran text = sh(kBin + "/tdist-ckpt inspect --ckpt-prefix " + prefix_);
  EXPECT_EQ(text.code, 0) << text.output;
  EXPECT_NE(text.output.find("fc1.w\\u001b]0;owned\\u0007\\u001b[2J\\u009b31m"), std::string::npos) << text.output;
  EXPECT_EQ(text.output.find('\x1b'), std::string::npos) << text.output;
  EXPECT_EQ(text.output.find('\x07'), std::string::npos) << text.output;
  EXPECT_EQ(text.output.find("\xc2\x9b"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("\\u001b"), std::string::npos) << text.output;
  const Ran json = sh(kBin + "/tdist-ckpt inspect --json --ckpt-prefix " + prefix_);
  EXPECT_EQ(json.output.find('\x1b'), std::string::npos) << json.output;
}

// A Checkpointer's directory after two real saves, at steps 1 and 2, of an
// FSDP Net with Adam at world 2: dir/latest lists step 2's folder, then
// step 1's.
void make_checkpointer_dir(const std::string& dir) {
  ASSERT_EQ(test::run_world(2, [&](ProcessGroup&) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(1);
    FSDP<test::Net> model(test::Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    tdist::CheckpointerOptions c;
    c.dir = dir;
    c.async = false;
    tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, c);
    for (int64_t step = 1; step <= 2; ++step) {
      model(torch::randn({4, 6})).pow(2).sum().backward();
      opt.step();
      ckpt.save(step);
    }
  }), "");
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

TEST(CkptInspectCheckpointer, ReadsTheNewestCheckpointThroughTheRootAndAStepFolder) {
  test::TempDir tmp;
  const std::string dir = tmp.path() + "/run";
  make_checkpointer_dir(dir);
  const auto folders = lines_of(slurp(dir + "/latest"));
  ASSERT_EQ(folders.size(), 2u);
  ASSERT_EQ(folders[0].rfind("step-00000002-", 0), 0u) << folders[0];
  ASSERT_EQ(folders[1].rfind("step-00000001-", 0), 0u) << folders[1];
  const std::string newest = dir + "/" + folders[0] + "/model", older = dir + "/" + folders[1] + "/model";

  // The root: the folder the marker names first, and it says so.
  const Ran root = sh(kBin + "/tdist-ckpt inspect " + dir);
  ASSERT_EQ(root.code, 0) << root.output;
  EXPECT_NE(root.output.find("checkpoint " + newest + " (the newest of the 2 checkpoints that " + dir +
                             "/latest lists)"),
            std::string::npos)
      << root.output;
  EXPECT_NE(root.output.find("world size 2, 2 files"), std::string::npos) << root.output;
  // The same through --ckpt-prefix (a trailing slash too), as JSON.
  const Ran as_json = sh(kBin + "/tdist-ckpt inspect --json --ckpt-prefix " + dir + "/");
  ASSERT_EQ(as_json.code, 0) << as_json.output;
  const auto j = nlohmann::json::parse(as_json.output);
  EXPECT_EQ(j["ckpt_prefix"], newest);
  EXPECT_EQ(j["files"][0], newest + "_rank-0-of-2.pt");
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["model"].size(), tdist::inspect_sharded_checkpoint(newest).model.size());
  EXPECT_EQ(j["optimizer"], "Adam");

  // A step folder: its own model files, whichever the marker names first.
  const Ran step = sh(kBin + "/tdist-ckpt inspect " + dir + "/" + folders[1]);
  ASSERT_EQ(step.code, 0) << step.output;
  EXPECT_NE(step.output.find("checkpoint " + older + " (a Checkpointer's step folder)"), std::string::npos)
      << step.output;
  EXPECT_NE(step.output.find("world size 2, 2 files"), std::string::npos) << step.output;

  // A prefix is read as before, and says nothing more.
  const Ran plain = sh(kBin + "/tdist-ckpt inspect --ckpt-prefix " + older);
  ASSERT_EQ(plain.code, 0) << plain.output;
  EXPECT_EQ(plain.output.find("checkpoint "), std::string::npos) << plain.output;
}

// The marker is read with a bound and never through a link or into a
// FIFO; what it names must be there. Each case is an error naming the
// marker (exit 1) within the command's deadline, and the good marker reads
// again afterwards.
TEST(CkptInspectCheckpointer, ABadLatestMarkerIsRefusedByName) {
  test::TempDir tmp;
  const std::string dir = tmp.path() + "/run", marker = dir + "/latest";
  make_checkpointer_dir(dir);
  const std::string good = slurp(marker);
  const std::vector<std::tuple<std::string, std::function<void()>, std::string>> cases = {
      {"a link to a good copy",
       [&] {
         std::ofstream(dir + "/copy") << good;
         ASSERT_EQ(::symlink("copy", marker.c_str()), 0);
       },
       "a symbolic link, not followed here"},
      {"a FIFO", [&] { ASSERT_EQ(::mkfifo(marker.c_str(), 0600), 0); }, "is a FIFO (named pipe), not a regular file"},
      {"a directory", [&] { ASSERT_EQ(::mkdir(marker.c_str(), 0700), 0); }, "is a directory, not a regular file"},
      {"huge", [&] { std::ofstream(marker) << good << std::string(1 << 20, '1'); }, "is over 65536 bytes"},
      {"garbage", [&] { std::ofstream(marker) << "../../etc\n"; }, "holds a line that names no step folder"},
      {"empty", [&] { std::ofstream(marker) << "\n\n"; }, "names no step folder"},
      {"a folder that is gone", [&] { std::ofstream(marker) << "step-00000009-0123456789abcdef\n" << good; },
       "names step-00000009-0123456789abcdef, but " + dir + "/step-00000009-0123456789abcdef is not there"},
  };
  for (const auto& [kind, make, says] : cases) {
    std::filesystem::remove_all(marker);
    make();
    const Ran r = sh(kBin + "/tdist-ckpt inspect " + dir);
    EXPECT_EQ(r.code, 1) << kind << ":\n" << r.output;
    EXPECT_NE(r.output.find("latest marker"), std::string::npos) << kind << ":\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << kind << ":\n" << r.output;
  }
  std::filesystem::remove_all(marker);
  std::ofstream(marker) << good;
  EXPECT_EQ(sh(kBin + "/tdist-ckpt inspect " + dir).code, 0);
  // A directory that is neither a Checkpointer's nor a step folder.
  const Ran empty = sh(kBin + "/tdist-ckpt inspect " + tmp.path());
  EXPECT_EQ(empty.code, 1) << empty.output;
  EXPECT_NE(empty.output.find("no checkpoint in " + tmp.path() + ": a directory with neither"), std::string::npos)
      << empty.output;
}

TEST(CkptUsage, EveryUsageErrorExits2AndSaysWhat) {
  test::TempDir dir;
  const std::string p = dir.path() + "/none";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/tdist-ckpt", "a subcommand is required: one of consolidate, reshard, inspect"},
      {"/tdist-ckpt frobnicate", "unknown subcommand 'frobnicate'; the subcommands are consolidate, reshard, inspect"},
      {"/tdist-ckpt reshard --ckpt-prefix " + p + " --world-size 0", "'0' is not a number in [1, 65536]"},
      {"/tdist-ckpt reshard --ckpt-prefix " + p + " --world-size -3", "not a number in [1, 65536]"},
      {"/tdist-ckpt reshard --ckpt-prefix " + p + " --world-size 99999999", "not a number in [1, 65536]"},
      {"/tdist-ckpt inspect --ckpt-prefix " + p + " --ckpt-suffix nostar", "checkpoint suffix 'nostar'"},
      {"/tdist-ckpt consolidate --ckpt-prefix " + p + " --format zip", "--format"},
      {"/tdist-ckpt inspect", "--ckpt-prefix"},
      {"/tdist-ckpt inspect " + p + " --ckpt-prefix " + p, "a PATH or --ckpt-prefix, not both"},
      {"/tdist-bench frobnicate", "unknown subcommand 'frobnicate'"},
      {"/tdist-bench", "a subcommand is required"},
      {"/tdist-bench checkpoint --size-mib -1", "'-1' is not a number in [1, 1048576]"},
      {"/tdist-bench checkpoint --size-mib nan", "is not a number"},
      {"/tdist-bench checkpoint --layers 0", "not a number in [1, 1024]"},
      {"/tdist-bench checkpoint --repeats 0", "not a number in [1, 1000]"},
      {"/tdist-bench store --seconds -1", "not a number in"},
      {"/tdist-bench store --value-bytes -1", "not a number in"},
      {"/tdist-bench store --clients 0,2", "bad --clients entry '0'"},
      {"/tdist-bench collectives --step-factor inf", "not a number in [2, 1024]"},
      {"/tdist-bench collectives --min-bytes 99999999999G", "bad size"},
      {"/tdist-bench collectives --min-bytes 1M --max-bytes 4K", "is over --max-bytes"},
      {"/tdist-bench collectives --dtype complex7", "unknown --dtype"},
      {"/tdist-bench ddp --bucket-cap-mb 0", "not a number in"},
      {"/tdist-bench fsdp --width 0", "not a number in [1, 65536]"},
      {"/tdist-store-server --port 70000", "--port"},
  };
  for (const auto& [cmd, says] : cases) {
    const Ran r = sh(kBin + cmd);
    EXPECT_EQ(r.code, 2) << cmd << ":\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << cmd << ":\n" << r.output;
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << cmd << ":\n" << r.output;  // c10
    EXPECT_LT(r.output.size(), 600u) << cmd << ":\n" << r.output;  // a line or two, not a range of 300 digits
  }
  EXPECT_EQ(sh(kBin + "/tdist-ckpt --help").code, 0);
  EXPECT_EQ(sh(kBin + "/tdist-bench --help").code, 0);
}

}  // namespace
