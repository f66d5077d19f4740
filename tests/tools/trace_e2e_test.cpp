// Hangs and stalls injected into a training loop as a user writes one
// (tests/trace/faulty_training.cpp), run under tdist-run and diagnosed
// with the tools alone: the flight recorder's dumps, tdist-trace analyze,
// tdist-run's stall detection and status lines, the timeline and
// tdist-trace summary.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "tests/util/process.h"
#include "tests/util/paths.h"

namespace {

using tdist::test::run_command;
using tdist::test::TempDir;

const std::string kBin = tdist::test::bin_dir();

std::string job(const std::string& env, const std::string& launcher_flags, const std::string& program_flags) {
  return env + " " + kBin + "/tdist-run --nproc-per-node 3 " + launcher_flags + " " + kBin + "/faulty_training " +
         program_flags + " 2>&1";
}

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

// The line of `text` that contains `what` ("" when none).
std::string line_with(const std::string& text, const std::string& what) {
  const size_t at = text.find(what);
  if (at == std::string::npos) return "";
  const size_t begin = text.rfind('\n', at);
  const size_t end = text.find('\n', at);
  return text.substr(begin == std::string::npos ? 0 : begin + 1,
                     (end == std::string::npos ? text.size() : end) - (begin == std::string::npos ? 0 : begin + 1));
}

// Rank 1 thinks its loss looks wrong at step 5 and skips the loss's
// all_reduce: its next collective is DDP's bucket where the others average
// the loss. Every rank dumps on the mismatch; analyze names rank 1 and
// the op.
TEST(TraceEndToEnd, ASkippedAllReduceIsNamedByAnalyze) {
  TempDir dir;
  const auto run = run_command(job("TDIST_DUMP_DIR=" + dir.path(), "--stall-seconds 0",
                                   "--steps 12 --timeout-s 30 --skip-rank 1 --skip-step 5"),
                               std::chrono::seconds(120));
  EXPECT_NE(exit_code(run.status), 0) << run.output;
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(std::filesystem::exists(dir.path() + "/rank-" + std::to_string(r) + ".json")) << run.output;
  }
  const auto a = run_command(kBin + "/tdist-trace analyze " + dir.path() + " 2>&1", std::chrono::seconds(60));
  EXPECT_EQ(exit_code(a.status), 1) << a.output;
  // The first line is the finding: the mismatch, rank 1 the odd one out.
  const std::string first = a.output.substr(0, a.output.find('\n'));
  EXPECT_NE(first.find("rank 1"), std::string::npos) << a.output;
  EXPECT_NE(first.find("all_reduce"), std::string::npos) << a.output;
  EXPECT_NE(first.find("mismatch"), std::string::npos) << a.output;
  EXPECT_EQ(first.find("rank 0 "), std::string::npos) << a.output;
  // --json says the same to a program.
  const auto j = run_command(kBin + "/tdist-trace analyze --json " + dir.path(), std::chrono::seconds(60));
  const auto doc = nlohmann::json::parse(j.output);
  ASSERT_FALSE(doc["findings"].empty()) << j.output;
  EXPECT_EQ(doc["findings"][0]["kind"], "mismatch") << j.output;
  EXPECT_EQ(doc["findings"][0]["ranks"], nlohmann::json::parse("[1]")) << j.output;
}

// Rank 2's data loader hangs for 12 s at step 4 under a 60 s collective
// timeout: tdist-run sees no op complete for 3 s, has every rank dump,
// and prints the analysis naming rank 2, long before the timeout; the
// status lines flag rank 2; the job then finishes.
TEST(TraceEndToEnd, AStuckDataLoaderIsNamedBeforeTheTimeout) {
  TempDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  const auto run = run_command(job("TDIST_DUMP_DIR=" + dir.path(), "--stall-seconds 3 --status-interval 1",
                                   "--steps 8 --timeout-s 60 --sleep-rank 2 --sleep-step 4 --sleep-s 12"),
                               std::chrono::seconds(120));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(exit_code(run.status), 0) << run.output;
  EXPECT_LT(took, 50) << run.output;  // not a timeout's 60 s
  const std::string stalled = line_with(run.output, "looks stalled");
  EXPECT_NE(stalled.find("in no op: rank 2"), std::string::npos) << run.output;
  // The analysis, printed by tdist-run: rank 2 never called the op the others wait in.
  const std::string never = line_with(run.output, "never called");
  EXPECT_NE(never.find("rank 2"), std::string::npos) << run.output;
  EXPECT_NE(never.find("all_reduce"), std::string::npos) << run.output;
  EXPECT_LT(run.output.find("looks stalled"), run.output.find("never called")) << run.output;
  const std::string behind = line_with(run.output, "BEHIND");
  EXPECT_NE(behind.find("rank 2 is in no op"), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("TimeoutError"), std::string::npos) << run.output;
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(std::filesystem::exists(dir.path() + "/rank-" + std::to_string(r) + ".json")) << run.output;
  }
}

// A rank that set SIGUSR1 back to its default (SIGUSR1 would kill it) is
// never sent it: it writes no heartbeat once the handler is not ours, and
// tdist-run checks /proc before signalling. The job still ends well.
TEST(TraceEndToEnd, AStallNeverSignalsARankWhoseSigusrOneIsNotOurs) {
  TempDir dir;
  const auto run = run_command(job("TDIST_DUMP_DIR=" + dir.path(), "--stall-seconds 2",
                                   "--steps 6 --timeout-s 60 --sleep-rank 2 --sleep-step 3 --sleep-s 6 "
                                   "--default-sigusr1-rank 1"),
                               std::chrono::seconds(120));
  EXPECT_EQ(exit_code(run.status), 0) << run.output;
  EXPECT_NE(run.output.find("looks stalled"), std::string::npos) << run.output;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/rank-1.json")) << run.output;
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/rank-0.json")) << run.output;
  EXPECT_NE(run.output.find("rank 1 wrote no dump"), std::string::npos) << run.output;
}

// A healthy run's timelines: one per rank, merged into one file with a
// process per rank; summary accounts for every rank's six steps.
TEST(TraceEndToEnd, AHealthyRunsTimelinesMergeAndSumUp) {
  TempDir dir;
  const auto run = run_command(job("TDIST_TRACE=" + dir.path() + "/trace.json", "", "--steps 6"),
                               std::chrono::seconds(120));
  ASSERT_EQ(exit_code(run.status), 0) << run.output;
  EXPECT_EQ(run.output.find("looks stalled"), std::string::npos) << run.output;
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(std::filesystem::exists(dir.path() + "/trace.rank-" + std::to_string(r) + ".json")) << run.output;
  }
  const auto merged = run_command(kBin + "/tdist-trace merge " + dir.path() + " -o " + dir.path() + "/all.json 2>&1",
                                  std::chrono::seconds(60));
  ASSERT_EQ(exit_code(merged.status), 0) << merged.output;
  const auto doc = nlohmann::json::parse(tdist::test::read_all(dir.path() + "/all.json"));
  std::set<int> pids;
  for (const auto& e : doc["traceEvents"]) pids.insert(e["pid"].get<int>());
  EXPECT_EQ(pids, (std::set<int>{0, 1, 2}));
  const auto s = run_command(kBin + "/tdist-trace summary " + dir.path() + "/all.json 2>&1", std::chrono::seconds(60));
  ASSERT_EQ(exit_code(s.status), 0) << s.output;
  EXPECT_NE(s.output.find("exposed"), std::string::npos) << s.output;
  const auto j = run_command(kBin + "/tdist-trace summary --json " + dir.path(), std::chrono::seconds(60));
  const auto steps = nlohmann::json::parse(j.output)["steps"];
  EXPECT_EQ(steps.size(), 18u) << j.output;
  for (const auto& st : steps) {
    EXPECT_GT(st["step_ms"].get<double>(), 0) << st;
    EXPECT_GT(st["comm_ms"].get<double>(), 0) << st;  // DDP's bucket and the loss every step
    EXPECT_LE(st["exposed_ms"].get<double>(), st["step_ms"].get<double>() + 1e-9) << st;
  }
}

}  // namespace
