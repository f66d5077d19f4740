// tdist-run --rdzv-backend etcd (issue 53): launchers on "nodes" (several
// tdist-run processes on this machine) meet in a three-member etcd cluster
// on loopback, each node with its own member. Losing any node, the first
// included, with its etcd member, leaves the others to go on from the
// latest checkpoint; a frozen node is named by the node that watches it;
// values not written with the job's token are refused.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <regex>
#include <thread>

#include "run/etcd_client.h"
#include "tests/util/etcd.h"
#include "tests/util/process.h"
#include "tests/util/resume_check.h"
#include "tests/util/skip.h"
#include "tests/util/paths.h"

using namespace std::chrono_literals;
namespace test = tdist::test;

namespace {

const std::string kRun = tdist::test::bin_dir() + "/tdist-run";
const std::string kMnist = tdist::test::bin_dir() + "/fashion_mnist";
const std::string kTrain = kMnist + " --batch-size 1000 --epochs 2 --max-steps 24 --quiet --checkpoint-every 3";

pid_t start_node(const std::string& args, const std::string& log) {
  const std::string cmd =
      "exec env TDIST_STORE_TOKEN=etcd-test-token OMP_NUM_THREADS=1 " + kRun + " " + args + " > " + log + " 2>&1";
  return test::fork_child([cmd] {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    return 127;
  });
}

int latest_step(const std::string& dir) { return test::latest_checkpoint_step(dir); }
bool ok(int status) { return test::exited_ok(status); }

// Node i lists its own member first, as a node with a local member would.
std::string endpoints_for(const test::EtcdCluster& c, int i, int members) {
  std::string s = "127.0.0.1:" + std::to_string(c.client_port(i));
  for (int j = 0; j < members; ++j) {
    if (j != i) s += ",127.0.0.1:" + std::to_string(c.client_port(j));
  }
  return s;
}

// The three nodes' launchers on a fresh cluster; the cluster is started here.
struct ThreeNodes {
  explicit ThreeNodes(const std::string& d) : dir(d), etcd(d, 3) {}
  bool start(const std::string& extra) {
    if (!etcd.start()) return false;
    for (int i = 0; i < 3; ++i) {
      pid[i] = start_node("--nnodes 2:3 --max-restarts 1 --rdzv-backend etcd --rdzv-id job --rdzv-endpoint " +
                              endpoints_for(etcd, i, 3) + " --rdzv-conf last_call_timeout=1 " + extra + kTrain +
                              " --checkpoint-dir " + dir + "/ckpt --json " + dir + "/elastic" + std::to_string(i) +
                              ".json",
                          log_path(i));
    }
    return true;
  }
  std::string log_path(int i) const { return dir + "/node" + std::to_string(i); }
  // The node that started the job: node 0 of round 0.
  int first() const {
    for (int i = 0; i < 3; ++i) {
      if (test::read_all(log_path(i)).find("round 0: node 0 of 3") != std::string::npos) return i;
    }
    return -1;
  }
  std::string dir;
  test::EtcdCluster etcd;
  pid_t pid[3] = {-1, -1, -1};
};

bool wait_for_checkpoint(const std::string& dir, int step) {
  for (int i = 0; i < 2400 && latest_step(dir) < step; ++i) std::this_thread::sleep_for(50ms);
  return latest_step(dir) >= step;
}

}  // namespace

// The node that started the job is lost (its launcher, hence its ranks,
// and its etcd member): the other two form the next round, at world size
// 2, from the latest checkpoint, and end with the very weights of a job
// restarted by hand at world size 2 from that checkpoint.
TEST(EtcdRun, LosingTheFirstNodeLeavesTheOthersToGoOnAsARestartByHandWould) {
  if (test::etcd_program().empty()) TDIST_SKIP_OR_FAIL_IN_CI("etcd is not installed (Debian's etcd-server)");
  test::TempDir tmp;
  const std::string d = tmp.path();
  ThreeNodes job(d);
  ASSERT_TRUE(job.start("")) << job.etcd.log(0);
  ASSERT_TRUE(wait_for_checkpoint(d + "/ckpt", 6)) << test::read_all(job.log_path(0));
  const int victim = job.first();
  ASSERT_GE(victim, 0) << test::read_all(job.log_path(0));
  kill(job.pid[victim], SIGKILL);
  job.etcd.kill_member(victim);
  std::string log, json;
  for (int n = 0; n < 3; ++n) {
    const int st = test::wait_child(job.pid[n], 240s);
    const std::string mine = test::read_all(job.log_path(n));
    log += "--- node " + std::to_string(n) + "\n" + mine;
    if (n == victim) continue;
    EXPECT_TRUE(ok(st)) << test::describe_status(st) << "\n" << mine;
    if (mine.find("[rank 0]: test accuracy") != std::string::npos) json = d + "/elastic" + std::to_string(n) + ".json";
  }
  EXPECT_NE(log.find("joined etcd at 127.0.0.1:"), std::string::npos) << log;
  test::expect_a_by_hand_restart_to_match(kRun, kMnist, kTrain, d, log, json, 24);
}

// A node frozen (its launcher and ranks stopped, as by SIGSTOP or a hung
// machine): its peers' ranks would wait in a collective until their
// timeout; the node watching it names it within ~10 s and the others go
// on without it.
TEST(EtcdRun, AFrozenNodeIsNamedAndTheOthersGoOn) {
  if (test::etcd_program().empty()) TDIST_SKIP_OR_FAIL_IN_CI("etcd is not installed (Debian's etcd-server)");
  test::TempDir tmp;
  const std::string d = tmp.path();
  ThreeNodes job(d);
  ASSERT_TRUE(job.start("")) << job.etcd.log(0);
  ASSERT_TRUE(wait_for_checkpoint(d + "/ckpt", 3)) << test::read_all(job.log_path(0));
  const int frozen = (job.first() + 1) % 3;
  std::smatch place;
  const std::string before = test::read_all(job.log_path(frozen));
  ASSERT_TRUE(std::regex_search(before, place, std::regex(R"(round (\d+): node (\d+) of 3)"))) << before;
  const std::string named_as = "node " + place[2].str() + " of round " + place[1].str() + " went silent";
  std::vector<pid_t> ranks = test::children_named(job.pid[frozen], "fashion_mnist");
  ASSERT_FALSE(ranks.empty());
  kill(job.pid[frozen], SIGSTOP);
  for (pid_t r : ranks) kill(r, SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  std::string log;
  bool named = false;
  for (int i = 0; i < 600 && !named; ++i) {
    std::this_thread::sleep_for(100ms);
    for (int n = 0; n < 3; ++n) {
      if (n != frozen && test::read_all(job.log_path(n)).find("went silent") != std::string::npos) named = true;
    }
  }
  const auto noticed = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(named);
  EXPECT_LT(noticed, 25s);
  for (int n = 0; n < 3; ++n) {
    if (n == frozen) continue;
    const int st = test::wait_child(job.pid[n], 240s);
    const std::string mine = test::read_all(job.log_path(n));
    log += "--- node " + std::to_string(n) + "\n" + mine;
    EXPECT_TRUE(ok(st)) << test::describe_status(st) << "\n" << mine;
  }
  kill(job.pid[frozen], SIGKILL);
  for (pid_t r : ranks) kill(r, SIGKILL);
  test::wait_child(job.pid[frozen], 10s);
  EXPECT_NE(log.find(named_as + ": its launcher has not answered for 10.0 s"), std::string::npos) << log;
  EXPECT_NE(log.find("of a world of 2 (was 3)"), std::string::npos) << log;
  EXPECT_NE(log.find("[rank 0]: test accuracy"), std::string::npos) << log;
}

// A value in the job's keys that was not written with the job's token
// (another job under the same id, or anyone who can reach etcd) is refused
// by name; the launcher does not act on it.
TEST(EtcdRun, AValueWithoutTheJobsTokenIsRefusedByName) {
  if (test::etcd_program().empty()) TDIST_SKIP_OR_FAIL_IN_CI("etcd is not installed (Debian's etcd-server)");
  test::TempDir tmp;
  const std::string d = tmp.path();
  test::EtcdCluster etcd(d, 1);
  ASSERT_TRUE(etcd.start()) << etcd.log(0);
  tdist_run::EtcdClient c({{"127.0.0.1", etcd.client_port(0)}}, tdist_run::EtcdTimeouts{});
  c.put("tdist-run/job/round", "7");
  const auto r = test::run_command("TDIST_STORE_TOKEN=etcd-test-token " + kRun +
                                       " --nnodes 1:2 --rdzv-backend etcd --rdzv-id job --rdzv-endpoint 127.0.0.1:" +
                                       std::to_string(etcd.client_port(0)) + " --rdzv-conf join_timeout=20 " + kMnist +
                                       " --max-steps 1 --quiet",
                                   60s);
  EXPECT_EQ(WEXITSTATUS(r.status), 1) << r.output;
  EXPECT_NE(r.output.find("holds a value under 'tdist-run/job/round' that was not written with this job's token"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("[rank 0]"), std::string::npos) << r.output;
}

// Bad etcd endpoints are refused up front, naming the option.
TEST(EtcdRun, RejectsBadEtcdArguments) {
  for (const std::string& args : {std::string("--rdzv-endpoint https://h:2379"), std::string("--rdzv-endpoint h:0"),
                                  std::string("--rdzv-endpoint h1:2379,,h2:2379")}) {
    const auto r = test::run_command(kRun + " --nnodes 1:2 --no-token --rdzv-backend etcd " + args + " true", 30s);
    EXPECT_EQ(WEXITSTATUS(r.status), 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find("--rdzv-endpoint"), std::string::npos) << r.output;
  }
  const auto r = test::run_command(kRun + " --nnodes 1:2 --no-token --rdzv-backend zookeeper --rdzv-endpoint h:1 true", 30s);
  EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.output;
  EXPECT_NE(r.output.find("'zookeeper' is not one tdist-run has (c10d, etcd)"), std::string::npos) << r.output;
}
