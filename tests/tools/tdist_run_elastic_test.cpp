// tdist-run --nnodes MIN:MAX (issue 37): launchers on "nodes" (here,
// several tdist-run processes on this machine, each a node) meet at a
// rendezvous endpoint and run as one world; a node lost for good, or a
// node that comes later, restarts the job with whoever is there, and the
// examples resume from their latest checkpoint at the new world size.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <regex>
#include <set>
#include <thread>

#include "store/socket.h"
#include "tests/util/process.h"
#include "tests/util/resume_check.h"
#include "tests/util/paths.h"

using namespace std::chrono_literals;
namespace test = tdist::test;

namespace {

const std::string kRun = tdist::test::bin_dir() + "/tdist-run";
const std::string kMnist = tdist::test::bin_dir() + "/fashion_mnist";

// One node's launcher, its output in `log`; returns tdist-run's pid. One
// OpenMP thread per rank, whatever the node's rank count (as for the runs
// by hand it is compared with): the same arithmetic, bit for bit.
// `env`: more NAME=VALUE words for the launcher's environment.
pid_t start_node(const std::string& args, const std::string& log, const std::string& env = "") {
  const std::string cmd = "exec env TDIST_STORE_TOKEN=elastic-test-token OMP_NUM_THREADS=1 " + env + " " + kRun + " " +
                          args + " > " + log + " 2>&1";
  return test::fork_child([cmd] {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    return 127;
  });
}

std::string endpoint() { return "127.0.0.1:" + std::to_string(tdist::detail::find_free_port()); }

int latest_step(const std::string& dir) { return test::latest_checkpoint_step(dir); }
bool ok(int status) { return test::exited_ok(status); }

}  // namespace

// Ranks are numbered in the order the nodes joined, each node with its own
// --nproc-per-node; every rank gets the same world and the round's store.
TEST(ElasticRun, NodesOfDifferentSizesMakeOneWorld) {
  test::TempDir dir;
  const std::string d = dir.path(), ep = endpoint();
  const std::string prog =
      " sh -c 'echo \"R=$RANK W=$WORLD_SIZE G=$GROUP_RANK/$GROUP_WORLD_SIZE L=$LOCAL_RANK/$LOCAL_WORLD_SIZE "
      "M=$MASTER_ADDR:$MASTER_PORT C=$TORCHELASTIC_RESTART_COUNT\"'";
  const pid_t a = start_node("--nnodes 2:2 --nproc-per-node 2 --rdzv-endpoint " + ep + prog, d + "/a");
  const pid_t b = start_node("--nnodes 2:2 --nproc-per-node 1 --rdzv-endpoint " + ep + prog, d + "/b");
  const int sa = test::wait_child(a, 60s), sb = test::wait_child(b, 60s);
  const std::string log = test::read_all(d + "/a") + test::read_all(d + "/b");
  ASSERT_TRUE(ok(sa) && ok(sb)) << log;
  std::set<std::string> ranks, masters;
  const std::regex line(R"(R=(\d) W=3 G=(\d)/2 L=(\d)/(\d) M=(\S+) C=0)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it) {
    ranks.insert((*it)[1]);
    masters.insert((*it)[5]);
  }
  EXPECT_EQ(ranks, (std::set<std::string>{"0", "1", "2"})) << log;
  EXPECT_EQ(masters.size(), 1u) << log;
  EXPECT_NE(log.find("hosting the rendezvous at " + ep), std::string::npos) << log;
}

// An elastic PyTorchJob without min/max replicas: Kubeflow's operator
// gives each pod torchrun's flags as PET_* with a fixed node count and a
// rendezvous endpoint (and PET_NODE_RANK, which a rendezvous does not use;
// and WORLD_SIZE/RANK counting pods). That is a rendezvous of exactly that
// many nodes, as torchrun's "--nnodes 2 --rdzv-endpoint ..." is.
TEST(ElasticRun, AFixedNodeCountWithAnEndpointIsARendezvousOfThatMany) {
  test::TempDir dir;
  const std::string d = dir.path(), ep = endpoint();
  const std::string prog = " sh -c 'echo \"R=$RANK W=$WORLD_SIZE G=$GROUP_RANK/$GROUP_WORLD_SIZE\"'";
  auto pod = [&](int index) {
    return start_node(prog, d + "/pod" + std::to_string(index),
                      "PET_NNODES=2 PET_NPROC_PER_NODE=2 PET_RDZV_BACKEND=c10d PET_RDZV_ENDPOINT=" + ep +
                          " PET_RDZV_ID=pj PET_NODE_RANK=" + std::to_string(index) + " WORLD_SIZE=2 RANK=" +
                          std::to_string(index));
  };
  const pid_t a = pod(0), b = pod(1);
  const int sa = test::wait_child(a, 60s), sb = test::wait_child(b, 60s);
  const std::string log = test::read_all(d + "/pod0") + test::read_all(d + "/pod1");
  ASSERT_TRUE(ok(sa) && ok(sb)) << log;
  std::set<std::string> ranks;
  const std::regex line(R"(R=(\d) W=4 G=\d/2)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it) {
    ranks.insert((*it)[1]);
  }
  EXPECT_EQ(ranks, (std::set<std::string>{"0", "1", "2", "3"})) << log;
  EXPECT_NE(log.find("(2 to 2 nodes)"), std::string::npos) << log;
}

// Too few nodes: the join timeout ends the wait, and says how many came.
TEST(ElasticRun, TooFewNodesTimeOutAndSaySo) {
  test::TempDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t a = start_node("--nnodes 2:3 --rdzv-endpoint " + endpoint() + " --rdzv-conf join_timeout=2 true",
                             dir.path() + "/a");
  const int st = test::wait_child(a, 60s);
  const std::string log = test::read_all(dir.path() + "/a");
  EXPECT_TRUE(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 1) << test::describe_status(st) << log;
  EXPECT_NE(log.find("1 node(s) came, the job needs 2 to 3"), std::string::npos) << log;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);
}

// A rank that fails every time: the nodes restart together, and when one
// is out of restarts every node gives up, none waits forever.
TEST(ElasticRun, OutOfRestartsEveryNodeGivesUp) {
  test::TempDir dir;
  const std::string d = dir.path(), ep = endpoint();
  const std::string prog = " sh -c 'sleep 0.3; test $RANK != 1'";
  const pid_t a = start_node("--nnodes 2:2 --max-restarts 1 --rdzv-endpoint " + ep + prog, d + "/a");
  const pid_t b = start_node("--nnodes 2:2 --max-restarts 1 --rdzv-endpoint " + ep + prog, d + "/b");
  const int sa = test::wait_child(a, 90s), sb = test::wait_child(b, 90s);
  const std::string log = test::read_all(d + "/a") + test::read_all(d + "/b");
  EXPECT_TRUE(sa != -1 && WIFEXITED(sa) && WEXITSTATUS(sa) != 0) << log;
  EXPECT_TRUE(sb != -1 && WIFEXITED(sb) && WEXITSTATUS(sb) != 0) << log;
  EXPECT_NE(log.find("round 1:"), std::string::npos) << log;  // restarted once
  EXPECT_EQ(log.find("round 2:"), std::string::npos) << log;  // and no more
  EXPECT_NE(log.find("out of restarts (--max-restarts 1)"), std::string::npos) << log;
}

// The node that hosts the rendezvous store is killed: the other node's
// launcher notices and ends its ranks, loudly.
TEST(ElasticRun, LosingTheStoresHostEndsTheOtherNodesLoudly) {
  test::TempDir dir;
  const std::string d = dir.path(), ep = endpoint();
  const pid_t host = start_node("--nnodes 2:2 --rdzv-endpoint " + ep + " sleep 60", d + "/host");
  for (int i = 0; i < 200 && test::read_all(d + "/host").find("hosting") == std::string::npos; ++i) {
    std::this_thread::sleep_for(50ms);
  }
  const pid_t other = start_node("--nnodes 2:2 --rdzv-endpoint " + ep + " sleep 60", d + "/other");
  for (int i = 0; i < 400 && test::read_all(d + "/other").find("round 0") == std::string::npos; ++i) {
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_NE(test::read_all(d + "/other").find("round 0"), std::string::npos) << test::read_all(d + "/other");
  const auto t0 = std::chrono::steady_clock::now();
  kill(host, SIGKILL);
  test::wait_child(host, 10s);
  const int st = test::wait_child(other, 40s);
  const std::string log = test::read_all(d + "/other");
  EXPECT_TRUE(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 1) << test::describe_status(st) << log;
  EXPECT_NE(log.find("the rendezvous store is gone"), std::string::npos) << log;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);
}

// The store's host frozen for 11 s (its node cut off or stalled, not gone;
// longer than a node may stay silent): each launcher's calls time out
// within a few seconds instead of blocking it for a minute, the launchers
// say so and keep their ranks, and when the host answers again nobody is
// taken for silent (no node could beat while it was frozen): the job ends
// as if nothing happened.
TEST(ElasticRun, AFrozenStoreHostIsRiddenOutWithoutBlockingTheLaunchers) {
  test::TempDir dir;
  const std::string d = dir.path(), ep = endpoint();
  const pid_t host = start_node("--nnodes 2:2 --rdzv-endpoint " + ep + " sleep 20", d + "/host");
  for (int i = 0; i < 200 && test::read_all(d + "/host").find("hosting") == std::string::npos; ++i) {
    std::this_thread::sleep_for(50ms);
  }
  const pid_t other = start_node("--nnodes 2:2 --rdzv-endpoint " + ep + " sleep 20", d + "/other");
  for (int i = 0; i < 400 && test::read_all(d + "/other").find("round 0") == std::string::npos; ++i) {
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_NE(test::read_all(d + "/other").find("round 0"), std::string::npos) << test::read_all(d + "/other");
  const auto store = test::children_named(host, "tdist-run-store");
  ASSERT_EQ(store.size(), 1u);
  kill(store[0], SIGSTOP);
  std::this_thread::sleep_for(11s);
  // Within the freeze each launcher has noticed (its calls bounded by ~5 s).
  const std::string during = test::read_all(d + "/other");
  kill(store[0], SIGCONT);
  const int so = test::wait_child(other, 60s), sh = test::wait_child(host, 60s);
  const std::string log = test::read_all(d + "/host") + test::read_all(d + "/other");
  EXPECT_TRUE(ok(so) && ok(sh)) << log;
  EXPECT_NE(during.find("cannot reach the rendezvous at " + ep), std::string::npos) << during;
  EXPECT_NE(log.find("answers again"), std::string::npos) << log;
  EXPECT_EQ(log.find("went silent"), std::string::npos) << log;
  EXPECT_EQ(log.find("restart"), std::string::npos) << log;
}

// A round starts only once every node of the round before has stopped its
// ranks: here node 1's rank ignores SIGTERM (it stops only at the grace
// period's SIGKILL), and node 0 must not start a world of one meanwhile.
TEST(ElasticRun, ARoundWaitsUntilTheLastRoundsRanksAreGone) {
  test::TempDir dir;
  const std::string d = dir.path(), ep = endpoint();
  const std::string args = "--nnodes 1:2 --max-restarts 2 --grace-seconds 2 --rdzv-endpoint " + ep +
                           " --rdzv-conf last_call_timeout=0 sh -c 'trap \"\" TERM; echo start $RANK/$WORLD_SIZE; "
                           "if [ $RANK = 0 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then sleep 1; exit 3; fi; sleep 3'";
  const pid_t a = start_node(args, d + "/a");
  for (int i = 0; i < 200 && test::read_all(d + "/a").find("hosting") == std::string::npos; ++i) {
    std::this_thread::sleep_for(20ms);
  }
  const pid_t b = start_node(args, d + "/b");
  const int sa = test::wait_child(a, 120s), sb = test::wait_child(b, 120s);
  const std::string log = test::read_all(d + "/a") + test::read_all(d + "/b");
  EXPECT_TRUE(ok(sa) && ok(sb)) << log;
  EXPECT_NE(log.find("failed first: exit code 3"), std::string::npos) << log;
  // After the failure, only worlds of two: never the two nodes apart.
  const size_t failure = log.find("to the rendezvous again (restart 1");
  ASSERT_NE(failure, std::string::npos) << log;
  EXPECT_EQ(log.find("of a world of 1 (was 2)"), std::string::npos) << log;
  EXPECT_NE(log.find("start 1/2"), std::string::npos) << log;
}

// A node whose ranks finished while a late node asks to join goes on with
// the job at its new size: a membership change takes no restart, even
// with --max-restarts 0.
TEST(ElasticRun, AFinishedNodeTakesALateNodeInWithoutARestart) {
  test::TempDir dir;
  const std::string d = dir.path(), ep = endpoint();
  const std::string args = "--nnodes 2:3 --rdzv-endpoint " + ep +
                           " --rdzv-conf last_call_timeout=1 sh -c 'echo run $RANK/$WORLD_SIZE; "
                           "if [ $GROUP_RANK != 1 ]; then sleep 4; fi'";
  const pid_t a = start_node(args, d + "/a");
  const pid_t b = start_node(args, d + "/b");
  for (int i = 0; i < 400 && test::read_all(d + "/a").find("run ") == std::string::npos; ++i) {
    std::this_thread::sleep_for(20ms);
  }
  std::this_thread::sleep_for(500ms);  // node 1's rank has finished
  const pid_t c = start_node(args, d + "/c");
  const int sa = test::wait_child(a, 60s), sb = test::wait_child(b, 60s), sc = test::wait_child(c, 60s);
  const std::string log = test::read_all(d + "/a") + test::read_all(d + "/b") + test::read_all(d + "/c");
  EXPECT_TRUE(ok(sa) && ok(sb) && ok(sc)) << log;
  EXPECT_NE(log.find("finished, but the job restarts: membership: a node is waiting to join"), std::string::npos)
      << log;
  EXPECT_NE(log.find("of a world of 3 (was 2)"), std::string::npos) << log;
}

TEST(ElasticRun, RejectsBadArguments) {
  for (const char* args : {"--nnodes 3:2 --rdzv-endpoint 127.0.0.1:1 true",
                           "--nnodes 1:2 --node-rank 0 --rdzv-endpoint 127.0.0.1:1 true", "--nnodes 1:2 true",
                           "--nnodes 1:2 --rdzv-endpoint 127.0.0.1:1 --rdzv-conf bogus=1 true",
                           "--nnodes 1:2 --rdzv-endpoint nowhere true", "--nnodes 2 --node-rank 1 --rdzv-endpoint 127.0.0.1:1 true",
                           "--nnodes 1:2 --rdzv-endpoint 127.0.0.1:1 --rdzv-id 'a/b' true", "--rdzv-id x true"}) {
    auto r = test::run_command(kRun + " " + args, 30s);
    EXPECT_TRUE(r.status != -1 && WIFEXITED(r.status) && WEXITSTATUS(r.status) == 2) << args << "\n" << r.output;
  }
}

// Issue 37's elastic target: three nodes, one killed for good mid-run; the
// other two go on at world size 2 from the latest checkpoint, and end with
// the very weights of a job restarted by hand at world size 2 from that
// checkpoint. The data position is kept in samples, so the world-2 run
// continues from the first sample not yet drawn.
TEST(ElasticRun, ThreeNodesLoseOneAndGoOnAtWorldTwoAsARestartByHandWould) {
  test::TempDir dir;
  const std::string d = dir.path(), ep = endpoint();
  const std::string train = kMnist + " --batch-size 1000 --epochs 2 --max-steps 24 --quiet --checkpoint-every 3";
  pid_t nodes[3];
  for (int i = 0; i < 3; ++i) {
    nodes[i] = start_node("--nnodes 2:3 --max-restarts 1 --rdzv-endpoint " + ep +
                              " --rdzv-conf last_call_timeout=1 " + train + " --checkpoint-dir " + d +
                              "/ckpt --json " + d + "/elastic" + std::to_string(i) + ".json",
                          d + "/node" + std::to_string(i));
  }
  // Once a few checkpoints are in, kill a node that does not host the store.
  int victim = -1;
  for (int i = 0; i < 2400 && victim < 0; ++i) {
    if (latest_step(d + "/ckpt") >= 6) {
      for (int n = 0; n < 3 && victim < 0; ++n) {
        if (test::read_all(d + "/node" + std::to_string(n)).find("joined the rendezvous") != std::string::npos) {
          victim = n;
        }
      }
    }
    if (victim < 0) std::this_thread::sleep_for(50ms);
  }
  ASSERT_GE(victim, 0);
  kill(nodes[victim], SIGKILL);
  std::string log;
  std::string json;
  for (int n = 0; n < 3; ++n) {
    const int st = test::wait_child(nodes[n], 240s);
    const std::string mine = test::read_all(d + "/node" + std::to_string(n));
    log += "--- node " + std::to_string(n) + "\n" + mine;
    if (n != victim) {
      EXPECT_TRUE(ok(st)) << test::describe_status(st) << "\n" << mine;
      if (mine.find("[rank 0]: test accuracy") != std::string::npos) json = d + "/elastic" + std::to_string(n) + ".json";
    }
  }
  test::expect_a_by_hand_restart_to_match(kRun, kMnist, train, d, log, json, 24);
}

// A node that comes while the job runs (below MAX nodes) is let in: the
// running nodes stop, all meet again, and the job goes on at the larger
// world from its latest checkpoint. A membership change is no failure: it
// takes none of --max-restarts 0.
TEST(ElasticRun, ANodeThatComesLaterIsLetIn) {
  test::TempDir dir;
  const std::string d = dir.path(), ep = endpoint();
  const std::string args = "--nnodes 2:3 --max-restarts 0 --rdzv-endpoint " + ep + " --rdzv-conf last_call_timeout=1 " +
                           kMnist + " --batch-size 1000 --epochs 2 --max-steps 48 --quiet --checkpoint-every 3 "
                           "--checkpoint-dir " + d + "/ckpt";
  const pid_t a = start_node(args, d + "/a");
  const pid_t b = start_node(args, d + "/b");
  for (int i = 0; i < 2400 && latest_step(d + "/ckpt") < 3; ++i) std::this_thread::sleep_for(50ms);
  ASSERT_GE(latest_step(d + "/ckpt"), 3) << test::read_all(d + "/a") << test::read_all(d + "/b");
  const pid_t c = start_node(args, d + "/c");
  const int sa = test::wait_child(a, 240s), sb = test::wait_child(b, 240s), sc = test::wait_child(c, 240s);
  const std::string log = test::read_all(d + "/a") + test::read_all(d + "/b") + test::read_all(d + "/c");
  EXPECT_TRUE(ok(sa) && ok(sb) && ok(sc)) << log;
  EXPECT_NE(log.find("a node is waiting to join"), std::string::npos) << log;
  // Stopped mid-run, not let in after the running nodes had finished (what
  // AFinishedNodeTakesALateNodeIn tests; a fast machine could get there).
  EXPECT_NE(log.find("this node's ranks were stopped: membership"), std::string::npos) << log;
  EXPECT_NE(log.find("of a world of 3 (was 2)"), std::string::npos) << log;
  EXPECT_NE(log.find("at world size 2): continuing at step"), std::string::npos) << log;
  EXPECT_NE(log.find("at world size 3, from the same sample"), std::string::npos) << log;
  EXPECT_NE(log.find("[rank 0]: test accuracy"), std::string::npos) << log;
}
