// tdist-run where clusters launch it, with each system's variables as its
// documentation gives them and the "nodes" played by launchers on this
// machine: Slurm's srun with a launcher per node, srun with a task per
// rank (env:// alone, no tdist-run), and the pods of a Kubeflow
// PyTorchJob (torchrun's PET_* variables, as the training-operator sets
// them, beside its RANK and WORLD_SIZE, which are not the ranks').
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>

#include "store/socket.h"
#include "tests/util/process.h"
#include "tests/util/paths.h"

extern char** environ;

using namespace std::chrono_literals;
namespace test = tdist::test;

namespace {

const std::string kRun = tdist::test::bin_dir() + "/tdist-run";
const std::string kProbe = tdist::test::bin_dir() + "/job_probe";
using Vars = std::map<std::string, std::string>;

// "env -u ... NAME=VALUE ...": none of this process's launcher variables
// (a test run inside a Slurm job or a pod must not see its own), then vars.
std::string env_with(const Vars& vars) {
  std::string cmd = "env";
  for (char** e = environ; *e; ++e) {
    const std::string name = std::string(*e).substr(0, std::string(*e).find('='));
    if (name.rfind("SLURM_", 0) == 0 || name.rfind("PET_", 0) == 0 || name.rfind("OMPI_", 0) == 0) {
      cmd += " -u " + name;
    }
  }
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                           "MASTER_PORT", "TDIST_STORE_TOKEN", "TDIST_STORE_TOKEN_FILE", "TORCHELASTIC_USE_AGENT_STORE"}) {
    cmd += std::string(" -u ") + name;
  }
  for (const auto& [k, v] : vars) cmd += " " + k + "='" + v + "'";
  return cmd;
}

// A rank program that prints what tdist-run gave it, then joins the group.
const std::string kShowAndJoin =
    " sh -c 'echo \"R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK A=$MASTER_ADDR "
    "P=$MASTER_PORT\"; exec " + kProbe + " --backend gloo'";
const std::string kShow =
    " sh -c 'echo \"R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK A=$MASTER_ADDR "
    "P=$MASTER_PORT X=$TORCHELASTIC_MAX_RESTARTS\"'";

bool port_free(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  close(fd);
  return ok;
}

// A Slurm job id whose port (20000 + id mod 10000) is free here.
int job_id_with_a_free_port() {
  int id = 4100000 + (getpid() * 7919) % 10000;
  while (!port_free(20000 + id % 10000)) ++id;
  return id;
}

// What srun sets in the environment of task `task` of a step of `nodes`
// nodes with one task per node (srun's OUTPUT ENVIRONMENT VARIABLES).
Vars srun_task(int job_id, int nodes, int task, const std::string& nodelist) {
  const std::string n = std::to_string(nodes), t = std::to_string(task), id = std::to_string(job_id);
  return {{"SLURM_JOB_ID", id},        {"SLURM_JOBID", id},           {"SLURM_STEP_ID", "0"},
          {"SLURM_STEPID", "0"},       {"SLURM_PROCID", t},           {"SLURM_LOCALID", "0"},
          {"SLURM_NODEID", t},         {"SLURM_NNODES", n},           {"SLURM_JOB_NUM_NODES", n},
          {"SLURM_NTASKS", n},         {"SLURM_NPROCS", n},           {"SLURM_STEP_NUM_NODES", n},
          {"SLURM_STEP_NUM_TASKS", n}, {"SLURM_TASKS_PER_NODE", "1(x" + n + ")"},
          {"SLURM_STEP_TASKS_PER_NODE", "1(x" + n + ")"},           {"SLURM_JOB_NODELIST", nodelist},
          {"SLURM_STEP_NODELIST", nodelist}, {"SLURM_CPUS_ON_NODE", "2"}, {"SLURM_JOB_NAME", "train"},
          {"SLURMD_NODENAME", "node" + t}};
}

// Runs the commands at once, each in the background; their outputs.
std::vector<test::CommandResult> run_together(const std::vector<std::string>& commands) {
  test::TempDir dir;
  std::vector<pid_t> pids;
  for (size_t i = 0; i < commands.size(); ++i) {
    const std::string log = dir.path() + "/" + std::to_string(i);
    const std::string cmd = commands[i];
    pids.push_back(test::fork_child([cmd, log] {
      auto r = test::run_command(cmd, 90s);
      std::ofstream(log) << r.output;
      return test::exited_ok(r.status) ? 0 : 1;
    }));
  }
  std::vector<test::CommandResult> out;
  for (size_t i = 0; i < pids.size(); ++i) {
    test::CommandResult r;
    r.status = test::wait_child(pids[i], 120s);
    r.output = test::read_all(dir.path() + "/" + std::to_string(i));
    out.push_back(r);
  }
  return out;
}

// "[rank r]: R=r L=l W=w LW=lw G=g A=a P=p" and the group's "rank r of w" and "sum ok".
void expect_rank(const std::string& out, int rank, int local, int world, int local_world, int group,
                 const std::string& addr, const std::string& port) {
  const std::string r = std::to_string(rank);
  const std::string want = "[rank " + r + "]: R=" + r + " L=" + std::to_string(local) + " W=" + std::to_string(world) +
                           " LW=" + std::to_string(local_world) + " G=" + std::to_string(group) + " A=" + addr +
                           " P=" + port;
  EXPECT_NE(out.find(want + "\n"), std::string::npos) << "missing: " << want << "\n" << out;
  EXPECT_NE(out.find("[rank " + r + "]: rank " + r + " of " + std::to_string(world) + "\n"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank " + r + "]: sum ok"), std::string::npos) << out;
}

// srun --nodes 2 --ntasks-per-node=1 tdist-run --nproc-per-node 2 ...: the
// nodes, this node's rank, the master (the node list's first host) and
// its port (from the job id) all come from Slurm.
TEST(TdistRunSlurm, ALauncherPerNodeTakesTheJobFromSrun) {
  const int job = job_id_with_a_free_port();
  const std::string port = std::to_string(20000 + job % 10000);
  std::vector<std::string> cmds;
  for (int node = 0; node < 2; ++node) {
    Vars v = srun_task(job, 2, node, "127.0.0.[1-2]");
    v["TDIST_STORE_TOKEN"] = "slurm-test-token";
    v["RANK"] = "7";  // a stale RANK/WORLD_SIZE in the launcher's environment is not the ranks'
    v["WORLD_SIZE"] = "9";
    cmds.push_back(env_with(v) + " " + kRun + " --nproc-per-node 2" + kShowAndJoin);
  }
  const auto r = run_together(cmds);
  ASSERT_TRUE(test::exited_ok(r[0].status)) << r[0].output << r[1].output;
  ASSERT_TRUE(test::exited_ok(r[1].status)) << r[1].output << r[0].output;
  for (int rank = 0; rank < 4; ++rank) expect_rank(r[rank / 2].output, rank, rank % 2, 4, 2, rank / 2, "127.0.0.1", port);
}

// Explicit flags, PET_* and MASTER_PORT win over what Slurm gives; a step
// that is not one task per node, and a batch script, are refused by name.
TEST(TdistRunSlurm, FlagsWinAndWrongStepsAreNamed) {
  const int job = job_id_with_a_free_port();
  Vars v = srun_task(job, 2, 1, "node[07-08]");
  v["TDIST_STORE_TOKEN"] = "t";
  auto r = test::run_command(env_with(v) + " MASTER_PORT=23999 MASTER_ADDR=127.0.0.1 " + kRun + " --nproc-per-node 1" + kShow, 30s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("[rank 1]: R=1 L=0 W=2 LW=1 G=1 A=127.0.0.1 P=23999"), std::string::npos) << r.output;
  // Without MASTER_ADDR: the first host of the step's nodes (no rank starts a store here: sh only).
  r = test::run_command(env_with(v) + " " + kRun + " --nproc-per-node 1" + kShow, 30s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("[rank 1]: R=1 L=0 W=2 LW=1 G=1 A=node07 P=" + std::to_string(20000 + job % 10000)),
            std::string::npos) << r.output;
  r = test::run_command(env_with(v) + " " + kRun +
                            " --nproc-per-node 1 --node-rank 0 --master-addr localhost --master-port 24001" + kShow,
                        30s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: R=0 L=0 W=2 LW=1 G=0 A=localhost P=24001"), std::string::npos) << r.output;
  Vars pet = v;
  pet["PET_NODE_RANK"] = "0";
  pet["PET_NNODES"] = "3";
  r = test::run_command(env_with(pet) + " " + kRun + " --nproc-per-node 1" + kShow, 30s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: R=0 L=0 W=3 LW=1 G=0 A=node07"), std::string::npos) << r.output;

  // srun --ntasks-per-node=2 tdist-run: two launchers per node.
  Vars many = srun_task(job, 2, 1, "node[07-08]");
  many["SLURM_STEP_NUM_TASKS"] = many["SLURM_NTASKS"] = "4";
  r = test::run_command(env_with(many) + " " + kRun + " --nproc-per-node 1 true", 30s);
  EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.output;
  EXPECT_NE(r.output.find("Slurm started 4 tasks (SLURM_STEP_NUM_TASKS) on 2 nodes"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("srun --ntasks-per-node=1 tdist-run"), std::string::npos) << r.output;
  // Slurm's batch script of a 2-node job (sbatch sets no SLURM_STEP_*): not run on one node silently.
  Vars batch = srun_task(job, 2, 0, "node[07-08]");
  for (auto it = batch.begin(); it != batch.end();) it = it->first.rfind("SLURM_STEP", 0) == 0 ? batch.erase(it) : ++it;
  r = test::run_command(env_with(batch) + " " + kRun + " --nproc-per-node 1 true", 30s);
  EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.output;
  EXPECT_NE(r.output.find("no srun step"), std::string::npos) << r.output;
  // A step on one node: a single-node job as ever (loopback, a fresh port and token).
  r = test::run_command(env_with(srun_task(job, 1, 0, "node07")) + " " + kRun + " --nproc-per-node 2" + kShow, 30s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("[rank 1]: R=1 L=1 W=2 LW=2 G=0 A=127.0.0.1 P="), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("P=" + std::to_string(20000 + job % 10000)), std::string::npos) << r.output;
}

// srun --ntasks=2 ./program, no tdist-run: env:// finds rank, world, master
// and port in Slurm's variables alone, and the two tasks form a group.
TEST(TdistRunSlurm, ATaskPerRankJoinsThroughEnvAlone) {
  const int job = job_id_with_a_free_port();
  std::vector<std::string> cmds;
  for (int task = 0; task < 2; ++task) {
    Vars v = srun_task(job, 1, 0, "localhost");
    v["SLURM_PROCID"] = v["SLURM_LOCALID"] = std::to_string(task);
    v["SLURM_NTASKS"] = v["SLURM_NPROCS"] = v["SLURM_STEP_NUM_TASKS"] = "2";
    v["SLURM_TASKS_PER_NODE"] = v["SLURM_STEP_TASKS_PER_NODE"] = "2";
    v["TDIST_STORE_TOKEN"] = "srun-test-token";
    cmds.push_back(env_with(v) + " " + kProbe + " --backend gloo --timeout-ms 30000");
  }
  const auto r = run_together(cmds);
  for (int task = 0; task < 2; ++task) {
    ASSERT_TRUE(test::exited_ok(r[task].status)) << r[task].output;
    EXPECT_NE(r[task].output.find("rank " + std::to_string(task) + " of 2\n"), std::string::npos) << r[task].output;
    EXPECT_NE(r[task].output.find("sum ok"), std::string::npos) << r[task].output;
  }
  // Rank 0 hosts the store on the port the job id gives (at localhost's first address).
  const std::string port = std::to_string(20000 + job % 10000);
  std::istringstream lines(r[0].output);
  bool listens = false;
  for (std::string line; std::getline(lines, line);) {
    listens = listens || (line.rfind("listen ", 0) == 0 && line.size() > port.size() &&
                          line.compare(line.size() - port.size() - 1, std::string::npos, ":" + port) == 0);
  }
  EXPECT_TRUE(listens) << r[0].output;
}

// The environment training-operator (pkg/controller.v1/pytorch) gives each
// pod of a PyTorchJob with a Master and a Worker, nprocPerNode "2", and
// the container command "tdist-run <program>": Kubeflow's WORLD_SIZE (the
// pods' count, as before v1.7) and RANK (the pod's index) are not the
// ranks' and must not be taken as such.
Vars pytorchjob_pod(int pod, int port) {
  const std::string p = std::to_string(port), i = std::to_string(pod);
  return {{"PYTHONUNBUFFERED", "1"},   {"MASTER_ADDR", "127.0.0.1"}, {"PET_MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", p},          {"PET_MASTER_PORT", p},       {"WORLD_SIZE", "2"},
          {"RANK", i},                 {"PET_NODE_RANK", i},         {"PET_NPROC_PER_NODE", "2"},
          {"PET_NNODES", "2"},         {"TDIST_STORE_TOKEN", "kubeflow-test-token"}};
}

TEST(TdistRunKubeflow, APyTorchJobsPodsFormOneWorld) {
  const int port = tdist::detail::find_free_port();
  const auto r = run_together({env_with(pytorchjob_pod(0, port)) + " " + kRun + kShowAndJoin,
                               env_with(pytorchjob_pod(1, port)) + " " + kRun + kShowAndJoin});
  ASSERT_TRUE(test::exited_ok(r[0].status)) << r[0].output << r[1].output;
  ASSERT_TRUE(test::exited_ok(r[1].status)) << r[1].output << r[0].output;
  for (int rank = 0; rank < 4; ++rank) {
    expect_rank(r[rank / 2].output, rank, rank % 2, 4, 2, rank / 2, "127.0.0.1", std::to_string(port));
  }
}

TEST(TdistRunKubeflow, TheCommandLineWinsOverPetVariables) {
  Vars v = pytorchjob_pod(1, 29999);
  v["PET_NPROC_PER_NODE"] = "3";
  v["PET_MASTER_PORT"] = "not-a-port";
  v["PET_MAX_RESTARTS"] = "2";
  auto r = test::run_command(env_with(v) + " " + kRun +
                                 " --nproc_per_node=1 --nnodes 1 --node-rank=0 --master-port 24002" + kShow,
                             30s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: R=0 L=0 W=1 LW=1 G=0 A=127.0.0.1 P=24002 X=2\n"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[rank 1]"), std::string::npos) << r.output;

  // A bad value names the variable it came from.
  v = pytorchjob_pod(1, 29999);
  v["PET_NPROC_PER_NODE"] = "auto";  // Kubeflow's default when the job sets no nprocPerNode
  r = test::run_command(env_with(v) + " " + kRun + " true", 30s);
  EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.output;
  EXPECT_NE(r.output.find("--nproc-per-node (from PET_NPROC_PER_NODE) is 'auto'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("spec.nprocPerNode"), std::string::npos) << r.output;
  v = pytorchjob_pod(1, 29999);
  v["PET_NNODES"] = "two";
  r = test::run_command(env_with(v) + " " + kRun + " true", 30s);
  EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.output;
  EXPECT_NE(r.output.find("--nnodes (from PET_NNODES) needs an integer"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("got 'two'"), std::string::npos) << r.output;
}

// torchrun reads no RANK: without PET_NODE_RANK a launcher is node 0, and
// tdist-run says why when RANK (a pod's index) is set.
TEST(TdistRunKubeflow, RankIsNeverTheNodeRank) {
  Vars v = pytorchjob_pod(1, 29998);
  v.erase("PET_NODE_RANK");
  const auto r = test::run_command(env_with(v) + " " + kRun + " --nproc-per-node 1" + kShow, 30s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: R=0 L=0 W=2 LW=1 G=0 A=127.0.0.1 P=29998"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("RANK=1 in its environment is not read as the node rank"), std::string::npos) << r.output;
}

// An elastic PyTorchJob (elasticPolicy with min and max replicas) with a
// Master: the operator sets PET_NODE_RANK there too, which an elastic
// launcher ignores (torchrun does), and the rendezvous comes from PET_RDZV_*.
TEST(TdistRunKubeflow, AnElasticPodIgnoresItsNodeRank) {
  const std::string port = std::to_string(tdist::detail::find_free_port());
  Vars v = pytorchjob_pod(1, 29997);
  v["PET_NNODES"] = "1:1";
  v["PET_RDZV_BACKEND"] = "c10d";
  v["PET_RDZV_ENDPOINT"] = "127.0.0.1:" + port;
  v["PET_RDZV_ID"] = "kubeflow-elastic";
  v["PET_MAX_RESTARTS"] = "1";
  const auto r = test::run_command(env_with(v) + " " + kRun + kShow, 60s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: R=0 L=0 W=2 LW=2 G=0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1]: R=1 L=1 W=2 LW=2 G=0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" X=1\n"), std::string::npos) << r.output;
}

}  // namespace
