// The check every example with --checkpoint-dir/--checkpoint-every must
// pass: run it straight through; run it again under tdist-run
// --max-restarts with a checkpoint every few steps, kill one of its ranks
// with SIGKILL once a few checkpoints are in, and see tdist-run restart the
// ranks, the ranks resume from the latest checkpoint by themselves, and the
// run end with the very weights of the straight one (the examples write
// "weights_fingerprint" into their --json). Header-only: the tests that use
// it link no LibTorch.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>

#include "tests/util/process.h"

namespace tdist::test {

// The "weights_fingerprint" of an example's --json file ("" when none).
inline std::string fingerprint_in(const std::string& json) {
  const auto j = nlohmann::json::parse(read_all(json), nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("weights_fingerprint") ? j["weights_fingerprint"].get<std::string>() : "";
}

// The step of the latest checkpoint under `ckpt` (its `latest` marker's
// first "step-N"), or -1.
inline int latest_checkpoint_step(const std::string& ckpt) {
  const std::string latest = read_all(ckpt + "/latest");
  const auto at = latest.find("step-");
  return at == std::string::npos ? -1 : std::atoi(latest.c_str() + at + 5);
}

// `launch`: tdist-run and its options up to the program; `program`: the
// example's path; `name`: its process name; `args`: its arguments (with no
// --json or --checkpoint-*), which run `steps` steps. Kills a rank once the
// latest checkpoint is at `kill_after` steps or later, with checkpoints
// every `every` steps. The kill is polled for, so on a fast machine it
// could land after the last step's checkpoint, and the resumed run would
// train nothing and match trivially: a resume from step `steps` fails.
inline void expect_a_killed_rank_to_resume_bit_for_bit(const std::string& launch, const std::string& program,
                                                       const std::string& name, const std::string& args,
                                                       int every, int kill_after, int steps) {
  using namespace std::chrono_literals;
  TempDir dir;
  const std::string d = dir.path();
  const auto straight = run_command(launch + " " + program + " " + args + " --json " + d + "/straight.json", 600s);
  ASSERT_TRUE(exited_ok(straight.status)) << straight.output;
  const std::string cmd = "exec " + launch + " --max-restarts 2 " + program + " " + args + " --checkpoint-dir " + d +
                          "/ckpt --checkpoint-every " + std::to_string(every) + " --json " + d + "/resumed.json > " +
                          d + "/log 2>&1";
  const pid_t launcher = fork_child([&] {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    return 127;
  });
  bool killed = false;
  for (int i = 0; i < 2400 && !killed; ++i) {
    if (latest_checkpoint_step(d + "/ckpt") >= kill_after) {
      const auto ranks = children_named(launcher, name);
      if (!ranks.empty()) killed = kill(ranks.back(), SIGKILL) == 0;
    }
    if (!killed) std::this_thread::sleep_for(50ms);
  }
  const int st = wait_child(launcher, 600s);
  const std::string log = read_all(d + "/log");
  ASSERT_TRUE(killed) << "no checkpoint of step " << kill_after << " or later appeared:\n" << log;
  ASSERT_NE(st, -1) << log;
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << describe_status(st) << "\n" << log;
  EXPECT_NE(log.find("restarting all ranks"), std::string::npos) << log;
  EXPECT_NE(log.find("[rank 0]: resumed from " + d + "/ckpt/step-"), std::string::npos) << log;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex(R"(\[rank 0\]: resumed from \S*/ckpt/step-0*(\d+))"))) << log;
  EXPECT_LT(std::stoi(m[1]), steps) << "the rank was killed after the last step's checkpoint: the resumed run "
                                       "trained nothing (give the run more steps)\n" << log;
  const std::string want = fingerprint_in(d + "/straight.json");
  EXPECT_EQ(want.size(), 16u) << straight.output;
  EXPECT_EQ(fingerprint_in(d + "/resumed.json"), want) << log;
}

// The elastic tests' check after one node of three was lost: the log names
// the resume ("resumed from ... (step S at world size 3): continuing at
// step ... at world size 2"), and the same job by hand (world 3 up to step
// S, then world 2 from that checkpoint, in `d`/hand) ends with the very
// weights the elastic run's rank 0 wrote to `json`. `run`: tdist-run;
// `mnist`: fashion_mnist; `train`: fashion_mnist with the arguments the
// elastic job gave it (--batch-size 1000 --epochs 2 --checkpoint-every 3),
// `steps` its --max-steps: a resume from there (the node was lost after the
// training had ended, as could happen on a fast machine) trained nothing
// at world size 2, and fails.
inline void expect_a_by_hand_restart_to_match(const std::string& run, const std::string& mnist,
                                              const std::string& train, const std::string& d,
                                              const std::string& log, const std::string& json, int steps) {
  using namespace std::chrono_literals;
  EXPECT_NE(log.find("of a world of 2 (was 3)"), std::string::npos) << log;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      log, m,
      std::regex(R"(\[rank 0\]: resumed from \S+ \(step (\d+) at world size 3\): continuing at step \d+ at world size 2)")))
      << log;
  const std::string step = m[1];
  EXPECT_LT(std::stoi(step), steps) << "the node was lost after the training had ended\n" << log;
  ASSERT_FALSE(json.empty()) << log;
  const std::string hand = " --checkpoint-dir " + d + "/hand";
  const auto r3 = run_command("OMP_NUM_THREADS=1 " + run + " --nproc-per-node 3 " + mnist +
                                  " --batch-size 1000 --epochs 2 --quiet --checkpoint-every 3 --max-steps " + step + hand,
                              240s);
  ASSERT_TRUE(exited_ok(r3.status)) << r3.output;
  EXPECT_EQ(latest_checkpoint_step(d + "/hand"), std::stoi(step));
  const auto r2 =
      run_command("OMP_NUM_THREADS=1 " + run + " --nproc-per-node 2 " + train + hand + " --json " + d + "/hand.json", 240s);
  ASSERT_TRUE(exited_ok(r2.status)) << r2.output;
  EXPECT_NE(r2.output.find("(step " + step + " at world size 3)"), std::string::npos) << r2.output;
  const std::string want = fingerprint_in(d + "/hand.json");
  EXPECT_EQ(want.size(), 16u);
  EXPECT_EQ(fingerprint_in(json), want) << log << r2.output;
}

}  // namespace tdist::test
