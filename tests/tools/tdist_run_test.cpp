// tdist-run: environment of each rank, output prefixes, failure summaries,
// and the 4-rank rendezvous demo end to end.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <thread>

#include "tests/util/process.h"
#include "tests/util/resume_check.h"
#include "tests/util/paths.h"

using namespace std::chrono_literals;
namespace test = tdist::test;

namespace {

const std::string kRun = tdist::test::bin_dir() + "/tdist-run";

TEST(TdistRun, SetsTorchrunVariablesAndPrefixesLines) {
  auto r = test::run_command(
      "env -u OMP_NUM_THREADS " + kRun +
          " --nproc-per-node 3 --master-port 23456 sh -c "
          "'echo \"R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK "
          "A=$MASTER_ADDR P=$MASTER_PORT O=$OMP_NUM_THREADS\"'",
      30s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  const std::string omp = std::to_string(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN) / 3));
  for (int rank = 0; rank < 3; ++rank) {
    const std::string want = "[rank " + std::to_string(rank) + "]: R=" + std::to_string(rank) + " L=" +
                             std::to_string(rank) + " W=3 LW=3 G=0 A=127.0.0.1 P=23456 O=" + omp;
    EXPECT_NE(r.output.find(want), std::string::npos) << "missing: " << want << "\n" << r.output;
  }
}

TEST(TdistRun, AFailingRankStopsTheOthersAndIsNamed) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = test::run_command(kRun + " --nproc-per-node 3 --grace-seconds 2 sh -c "
                                    "'if [ $RANK = 1 ]; then exit 7; fi; sleep 60'",
                             30s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s) << "the other ranks were not stopped";
  ASSERT_NE(r.status, -1);
  EXPECT_FALSE(test::exited_ok(r.status));
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("failed first: exit code 7"), std::string::npos) << r.output;
}

TEST(TdistRun, AKilledRankIsNamedWithItsSignal) {
  auto r = test::run_command(kRun + " --nproc-per-node 2 --grace-seconds 1 sh -c "
                                    "'if [ $RANK = 0 ]; then kill -9 $$; fi; sleep 60'",
                             30s);
  EXPECT_NE(r.output.find("rank 0 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("killed by signal 9"), std::string::npos) << r.output;
}

TEST(TdistRun, RestartsTheWholeGroup) {
  test::TempDir dir;
  // Fails the first time (no marker file yet), succeeds the second.
  const std::string marker = dir.path() + "/ran-once";
  auto r = test::run_command(kRun + " --nproc-per-node 2 --max-restarts 2 sh -c "
                                    "'if [ $RANK = 0 ] && [ ! -e " + marker + " ]; then touch " + marker +
                                 "; exit 3; fi; echo finished'",
                             30s);
  EXPECT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("restarting all ranks (restart 1 of 2)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: finished"), std::string::npos) << r.output;
}

// A progress line a rank redraws with "\r": in a log only what a terminal
// would finally show of each line; on a terminal (a pty from script(1)) the
// ranks are told so (TDIST_TTY=1) and the line is redrawn in place.
TEST(TdistRun, ShowsARedrawnLineAsATerminalWould) {
  auto r = test::run_command(kRun + " --nproc-per-node 1 sh -c "
                                    "'echo \"TTY=${TDIST_TTY:-unset}\"; printf \"step 1\\rstep 2\\rstep 3\\n\"'",
                             30s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: TTY=unset"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: step 3\n"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 1"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find('\r'), std::string::npos) << r.output;

  // CRLF endings, a blank CRLF line, a line that ends in '\r': each line's own text, once.
  auto c = test::run_command(kRun + " --nproc-per-node 1 sh -c "
                                    "'printf \"a\\r\\n\\r\\nb\\n50%%\\r100%%\\r\\nc\\n\"'",
                             30s);
  ASSERT_TRUE(test::exited_ok(c.status)) << c.output;
  EXPECT_NE(c.output.find("[rank 0]: a\n[rank 0]: \n[rank 0]: b\n[rank 0]: 100%\n[rank 0]: c\n"), std::string::npos)
      << c.output;

  // script(1) gives tdist-run a terminal; the rank's partial line appears before its newline does.
  auto t = test::run_command(
      "script -qec \"" + kRun +
          R"( --nproc-per-node 1 sh -c 'echo TTY=\$TDIST_TTY; printf \"\\rstep 1\"; sleep 0.5; printf \"\\rstep 2\\n\"'" /dev/null)",
      30s);
  ASSERT_TRUE(test::exited_ok(t.status)) << t.output;
  EXPECT_NE(t.output.find("[rank 0]: TTY=1"), std::string::npos) << t.output;
  EXPECT_NE(t.output.find("\r[rank 0]: step 1"), std::string::npos) << t.output;
  EXPECT_NE(t.output.find("[rank 0]: step 2"), std::string::npos) << t.output;
}

TEST(TdistRun, RejectsBadArguments) {
  auto r = test::run_command(kRun + " --nproc-per-node zero true", 10s);
  EXPECT_EQ(WEXITSTATUS(r.status), 2);
  EXPECT_NE(r.output.find("--nproc-per-node needs an integer"), std::string::npos) << r.output;
  r = test::run_command(kRun + " --nproc-per-node 2", 10s);
  EXPECT_NE(r.output.find("no program given"), std::string::npos) << r.output;
}

TEST(TdistRun, KillingOneRankOfAJobNamesItEverywhere) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = test::run_command(kRun + " --nproc-per-node 3 " + tdist::test::bin_dir() + "/allreduce_demo --iters 100000 "
                                    "--numel 4096 --die-rank 1 --die-at 200",
                             60s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
  EXPECT_FALSE(test::exited_ok(r.status));
  // The survivors say who died, in their own words...
  EXPECT_NE(r.output.find("[rank 0]: rank 0: peer rank 1 failed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 2]: rank 2: peer rank 1 failed"), std::string::npos) << r.output;
  // ...and so does the launcher's summary.
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("failed first: killed by signal 9"), std::string::npos) << r.output;
}

TEST(TdistRun, ForwardsSigtermToEveryRank) {
  test::TempDir dir;
  // Each rank records the SIGTERM it receives, then exits.
  const std::string cmd = "exec " + kRun + " --nproc-per-node 2 sh -c "
                          "'trap \"touch " + dir.path() + "/got-$RANK; exit 0\" TERM; "
                          "touch " + dir.path() + "/up-$RANK; while true; do sleep 0.05; done'";
  pid_t pid = test::fork_child([&] {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    return 127;
  });
  const auto up = [&](const char* what) {
    for (int i = 0; i < 200; ++i) {
      if (access((dir.path() + "/" + what + "-0").c_str(), F_OK) == 0 &&
          access((dir.path() + "/" + what + "-1").c_str(), F_OK) == 0) {
        return true;
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  };
  ASSERT_TRUE(up("up"));
  kill(pid, SIGTERM);
  const int st = test::wait_child(pid, 20s);
  EXPECT_TRUE(up("got")) << "a rank never saw the SIGTERM";
  ASSERT_NE(st, -1) << "tdist-run did not exit after SIGTERM";
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGTERM) << test::describe_status(st);
}

// Whether pid is gone: no such process, or a zombie (which holds nothing:
// its parent is gone, and reaping it is up to whoever adopted it).
bool gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t p = text.rfind(')');
  return p == std::string::npos || p + 2 >= text.size() || text[p + 2] == 'Z' || text[p + 2] == 'X';
}

int read_pid(const std::string& path) {
  std::ifstream in(path);
  int pid = 0;
  in >> pid;
  return pid;
}

// Issue 34, item 8: kill -9 of tdist-run must not leave its ranks (or what
// they started) running, nor their shared memory in /dev/shm. Before, the
// ranks ran on, adopted by init.
TEST(TdistRun, KillingTheLauncherWithSigkillEndsEveryRank) {
  test::TempDir dir;
  // Each rank records its pid, starts a child of its own, and leaves a
  // /dev/shm segment named as the shm backend names them, then waits.
  const std::string d = dir.path();
  const std::string cmd = "exec " + kRun + " --nproc-per-node 3 sh -c "
                          "'touch /dev/shm/tdist-shm-$$-test; sleep 1000 & echo $! > " + d + "/child-$RANK; "
                          "echo $$ > " + d + "/rank-$RANK; wait'";
  pid_t launcher = test::fork_child([&] {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    return 127;
  });
  std::vector<int> pids;
  for (int i = 0; i < 300 && pids.size() < 6; ++i) {
    pids.clear();
    for (int r = 0; r < 3; ++r) {
      for (const char* what : {"rank-", "child-"}) {
        const int pid = read_pid(d + "/" + what + std::to_string(r));
        if (pid > 0) pids.push_back(pid);
      }
    }
    if (pids.size() < 6) std::this_thread::sleep_for(50ms);
  }
  ASSERT_EQ(pids.size(), 6u) << "the ranks did not start";
  std::vector<std::string> segments;
  for (int r = 0; r < 3; ++r) {
    segments.push_back("/dev/shm/tdist-shm-" + std::to_string(read_pid(d + "/rank-" + std::to_string(r))) + "-test");
    ASSERT_EQ(access(segments.back().c_str(), F_OK), 0) << segments.back();
  }
  kill(launcher, SIGKILL);
  ASSERT_NE(test::wait_child(launcher, 10s), -1);
  const auto t0 = std::chrono::steady_clock::now();
  auto all_gone = [&] {
    for (int pid : pids) {
      if (!gone(pid)) return false;
    }
    return true;
  };
  while (!all_gone() && std::chrono::steady_clock::now() - t0 < 5s) std::this_thread::sleep_for(50ms);
  for (int pid : pids) {
    EXPECT_TRUE(gone(pid)) << "pid " << pid << " still runs after its launcher was killed";
    if (!gone(pid)) kill(pid, SIGKILL);
  }
  for (const auto& seg : segments) {
    for (int i = 0; i < 100 && access(seg.c_str(), F_OK) == 0; ++i) std::this_thread::sleep_for(50ms);
    EXPECT_NE(access(seg.c_str(), F_OK), 0) << seg << " was left behind";
    unlink(seg.c_str());
  }
}

// The issue 34 summary bug: under load, the launcher named a survivor
// (which exited with an error after noticing its peer's death) as the rank
// that failed first, instead of the rank that was killed. CPU hogs make
// the killed rank slow to tear down.
TEST(TdistRun, TheKilledRankIsNamedFirstUnderLoad) {
  // One busy process per core: ranks wait for the CPU, as on a loaded node.
  std::vector<pid_t> hogs;
  for (unsigned i = 0; i < std::max(2u, std::thread::hardware_concurrency()); ++i) {
    hogs.push_back(test::fork_child([] {
      for (volatile uint64_t x = 0;; ++x) {
      }
      return 0;
    }));
  }
  int named_right = 0;
  std::string outputs;
  for (int run = 0; run < 2; ++run) {
    auto r = test::run_command(kRun + " --nproc-per-node 3 " + tdist::test::bin_dir() + "/allreduce_demo --iters 100000 "
                                      "--numel 4096 --die-rank 1 --die-at 50",
                               90s);
    if (r.output.find("rank 1 (pid") != std::string::npos &&
        r.output.find("failed first: killed by signal 9") != std::string::npos) {
      ++named_right;
    } else {
      outputs += r.output;
    }
  }
  for (pid_t h : hogs) {
    kill(h, SIGKILL);
    test::wait_child(h, 10s);
  }
  EXPECT_EQ(named_right, 2) << outputs;
}

TEST(AllreduceDemo, RunsOnFourRanks) {
  auto r = test::run_command(kRun + " --nproc-per-node 4 " + tdist::test::bin_dir() + "/allreduce_demo --iters 50", 60s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("50 all_reduces of 1048576 floats on 4 ranks (shm): all correct"), std::string::npos)
      << r.output;
}

TEST(FashionMnist, OneEpochOnTwoRanksWithTheFp16Hook) {
  test::TempDir dir;
  const std::string json = dir.path() + "/result.json";
  auto r = test::run_command(kRun + " --nproc-per-node 2 " + tdist::test::bin_dir() + "/fashion_mnist --epochs 1 --hook fp16 --json " +
                                 json,
                             300s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  std::ifstream f(json);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto result = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(result.is_object()) << text;
  ASSERT_TRUE(result.contains("test_accuracy")) << text;
  EXPECT_GE(result["test_accuracy"].get<double>(), 0.84) << text;  // one epoch; make demo trains four and reaches 88 %
  EXPECT_EQ(result["world_size"].get<int>(), 2) << text;
  EXPECT_EQ(result["steps"].get<int>(), 469) << text;  // 60000 / 2 ranks / 64 per batch
  EXPECT_EQ(result["hook"].get<std::string>(), "fp16") << text;
  EXPECT_NE(r.output.find("[rank 0]: test accuracy"), std::string::npos) << r.output;
  // In a log (no terminal): rank 0's plain progress line at the last step at
  // least, with its rate and ETA; nothing from rank 1.
  EXPECT_NE(r.output.find("[rank 0]: epoch 1/1  step 469/469  loss "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" samples/s  ETA 0:00\n"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[rank 1]: "), std::string::npos) << r.output;
}

// Issue 37: a rank killed with SIGKILL in the middle of a run with
// --checkpoint-dir; tdist-run restarts every rank, they resume from the
// latest checkpoint by themselves and end with the very weights of a run
// that never stopped. 30 steps per epoch: the run crosses an epoch.
TEST(FashionMnist, AKilledRankRestartsAndResumesBitForBit) {
  test::expect_a_killed_rank_to_resume_bit_for_bit(kRun + " --nproc-per-node 2", tdist::test::bin_dir() + "/fashion_mnist",
                                                   "fashion_mnist", "--batch-size 1000 --epochs 2 --max-steps 45 --quiet",
                                                   3, 9, 45);
}

// The same for FSDP (FULL_SHARD, every stage a unit of its own, its
// sharded optimizer state in the checkpoint).
TEST(FsdpMnist, AKilledRankRestartsAndResumesBitForBit) {
  test::expect_a_killed_rank_to_resume_bit_for_bit(kRun + " --nproc-per-node 2", tdist::test::bin_dir() + "/fsdp_mnist",
                                                   "fsdp_mnist",
                                                   "--batch-size 500 --epochs 2 --max-steps 20 --use-nested-fsdp --quiet",
                                                   4, 8, 20);
}

// --quiet: no progress lines, the summaries stay; --all-ranks: every rank's.
TEST(FashionMnist, QuietAndAllRanks) {
  auto q = test::run_command(kRun + " --nproc-per-node 2 " + tdist::test::bin_dir() + "/fashion_mnist --epochs 1 --max-steps 20 --quiet",
                             300s);
  ASSERT_TRUE(test::exited_ok(q.status)) << q.output;
  EXPECT_EQ(q.output.find("step 20/20"), std::string::npos) << q.output;
  EXPECT_NE(q.output.find("[rank 0]: epoch 1/1: 20 steps"), std::string::npos) << q.output;
  EXPECT_NE(q.output.find("[rank 0]: test accuracy"), std::string::npos) << q.output;

  auto a = test::run_command(
      kRun + " --nproc-per-node 2 " + tdist::test::bin_dir() + "/fashion_mnist --epochs 1 --max-steps 20 --all-ranks", 300s);
  ASSERT_TRUE(test::exited_ok(a.status)) << a.output;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string want = "[rank " + std::to_string(rank) + "]: rank " + std::to_string(rank) +
                             ": epoch 1/1  step 20/20  loss ";
    EXPECT_NE(a.output.find(want), std::string::npos) << "missing: " << want << "\n" << a.output;
  }
}

TEST(RendezvousDemo, FourRanksLearnAboutEachOther) {
  auto r = test::run_command(kRun + " --nproc-per-node 4 " + tdist::test::bin_dir() + "/rendezvous_demo", 60s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "]: rank " + std::to_string(rank) + " of 4"),
              std::string::npos)
        << r.output;
  }
  EXPECT_NE(r.output.find("all 4 ranks rendezvoused"), std::string::npos) << r.output;
  // Tickets from the shared counter are exactly 1..4, each once.
  for (int t = 1; t <= 4; ++t) {
    EXPECT_NE(r.output.find("drew ticket " + std::to_string(t) + ";"), std::string::npos) << r.output;
  }
}

}  // namespace
