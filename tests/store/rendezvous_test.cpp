// init_method parsing (every error case names what is wrong) and real
// rendezvous of several processes through tcp://, file:// and env://.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <thread>

#include "store/socket.h"
#include "tdist/rendezvous.h"
#include "tests/util/process.h"

using namespace std::chrono_literals;
namespace test = tdist::test;

namespace {

std::map<std::string, std::string> g_env;
const char* fake_getenv(const char* name) {
  auto it = g_env.find(name);
  return it == g_env.end() ? nullptr : it->second.c_str();
}

tdist::RendezvousOptions opts(const std::string& url, int rank = -1, int world = -1) {
  tdist::RendezvousOptions o;
  o.init_method = url;
  o.rank = rank;
  o.world_size = world;
  o.getenv = fake_getenv;
  return o;
}

// Expects parse_init_method to fail with a UsageError containing `needle`.
void expect_usage_error(const tdist::RendezvousOptions& o, const std::string& needle) {
  try {
    tdist::parse_init_method(o);
    ADD_FAILURE() << "'" << o.init_method << "' parsed without error";
  } catch (const tdist::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

class InitMethodParse : public ::testing::Test {
 protected:
  void SetUp() override {
    g_env = {{"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29500"}, {"RANK", "2"}, {"WORLD_SIZE", "4"}};
  }
};

TEST_F(InitMethodParse, EnvReadsTorchrunVariables) {
  auto m = tdist::parse_init_method(opts("env://"));
  EXPECT_EQ(m.scheme, "env");
  EXPECT_EQ(m.host, "10.1.2.3");
  EXPECT_EQ(m.port, 29500);
  EXPECT_EQ(m.rank, 2);
  EXPECT_EQ(m.world_size, 4);
  // The default init_method is env://.
  EXPECT_EQ(tdist::parse_init_method(opts("")).rank, 2);
}

// torchrun's agent hosts PyTorch's TCPStore on MASTER_PORT and says so;
// tdist's store takes the next port.
TEST_F(InitMethodParse, UnderTorchrunTheStoreTakesTheNextPort) {
  g_env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  auto m = tdist::parse_init_method(opts("env://"));
  EXPECT_EQ(m.host, "10.1.2.3");
  EXPECT_EQ(m.port, 29501);
  g_env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  EXPECT_EQ(tdist::parse_init_method(opts("env://")).port, 29500);
  g_env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  g_env["MASTER_PORT"] = "65535";
  expect_usage_error(opts("env://"), "65535");
}

TEST_F(InitMethodParse, ExplicitRankAndWorldSizeWinOverTheEnvironment) {
  auto m = tdist::parse_init_method(opts("env://", 0, 8));
  EXPECT_EQ(m.rank, 0);
  EXPECT_EQ(m.world_size, 8);
}

TEST_F(InitMethodParse, EnvFallsBackToOpenMPIVariables) {
  g_env.erase("RANK");
  g_env.erase("WORLD_SIZE");
  g_env["OMPI_COMM_WORLD_RANK"] = "1";
  g_env["OMPI_COMM_WORLD_SIZE"] = "3";
  auto m = tdist::parse_init_method(opts("env://"));
  EXPECT_EQ(m.rank, 1);
  EXPECT_EQ(m.world_size, 3);
}

// A task per rank under srun: what srun's OUTPUT ENVIRONMENT VARIABLES
// give (task 1 of 4, two per node), and no torchrun variable at all.
TEST_F(InitMethodParse, EnvFallsBackToSlurmVariables) {
  g_env = {{"SLURM_JOB_ID", "123457"},        {"SLURM_JOBID", "123457"},      {"SLURM_STEP_ID", "0"},
           {"SLURM_PROCID", "1"},             {"SLURM_LOCALID", "1"},         {"SLURM_NODEID", "0"},
           {"SLURM_NTASKS", "4"},             {"SLURM_NPROCS", "4"},          {"SLURM_NNODES", "2"},
           {"SLURM_STEP_NUM_TASKS", "4"},     {"SLURM_STEP_NUM_NODES", "2"},  {"SLURM_TASKS_PER_NODE", "2(x2)"},
           {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"SLURM_STEP_NODELIST", "gpu[07-08]"}};
  auto m = tdist::parse_init_method(opts("env://"));
  EXPECT_EQ(m.rank, 1);
  EXPECT_EQ(m.world_size, 4);
  EXPECT_EQ(m.host, "gpu07");
  EXPECT_EQ(m.port, 20000 + 123457 % 10000);
  // The step's own counts win over the job's (srun --preserve-env keeps the job's SLURM_NTASKS).
  g_env["SLURM_NTASKS"] = "16";
  g_env["SLURM_STEP_NODELIST"] = "rack2-n[3-4]";
  m = tdist::parse_init_method(opts("env://"));
  EXPECT_EQ(m.world_size, 4);
  EXPECT_EQ(m.host, "rack2-n3");
  // Without the step's: the job's.
  g_env.erase("SLURM_STEP_NUM_TASKS");
  g_env.erase("SLURM_STEP_NODELIST");
  m = tdist::parse_init_method(opts("env://"));
  EXPECT_EQ(m.world_size, 16);
  EXPECT_EQ(m.host, "gpu07");
  // torchrun's and mpirun's names win over srun's.
  g_env["MASTER_ADDR"] = "10.0.0.9";
  g_env["MASTER_PORT"] = "29400";
  g_env["OMPI_COMM_WORLD_RANK"] = "2";
  g_env["OMPI_COMM_WORLD_SIZE"] = "5";
  m = tdist::parse_init_method(opts("env://"));
  EXPECT_EQ(m.host, "10.0.0.9");
  EXPECT_EQ(m.port, 29400);
  EXPECT_EQ(m.rank, 2);
  EXPECT_EQ(m.world_size, 5);
  g_env["RANK"] = "3";
  g_env["WORLD_SIZE"] = "6";
  m = tdist::parse_init_method(opts("env://"));
  EXPECT_EQ(m.rank, 3);
  EXPECT_EQ(m.world_size, 6);
}

TEST_F(InitMethodParse, BadSlurmVariablesAreNamed) {
  g_env = {{"SLURM_JOB_ID", "77"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n[1-"}};
  expect_usage_error(opts("env://"), "MASTER_ADDR is not set, and SLURM_JOB_NODELIST is no host list");
  g_env["SLURM_JOB_NODELIST"] = "n[2-1]";
  expect_usage_error(opts("env://"), "runs backwards");
  g_env["SLURM_JOB_NODELIST"] = "n1";
  g_env["SLURM_JOB_ID"] = "abc";
  expect_usage_error(opts("env://"), "MASTER_PORT is not set, and SLURM_JOB_ID is 'abc', not a Slurm job id");
  g_env["SLURM_JOB_ID"] = "77";
  g_env["SLURM_PROCID"] = "2";
  expect_usage_error(opts("env://"), "rank 2 is out of range for world_size 2");
  g_env["SLURM_NTASKS"] = "x";
  expect_usage_error(opts("env://"), "SLURM_NTASKS must be an integer");
  g_env.erase("SLURM_NTASKS");
  expect_usage_error(opts("env://"), "WORLD_SIZE is not set (nor OMPI_COMM_WORLD_SIZE or SLURM_NTASKS)");
  g_env.erase("SLURM_PROCID");
  expect_usage_error(opts("env://"), "RANK is not set (nor OMPI_COMM_WORLD_RANK or SLURM_PROCID)");
}

TEST_F(InitMethodParse, EachMissingVariableIsNamed) {
  for (const char* var : {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"}) {
    SetUp();
    g_env.erase(var);
    expect_usage_error(opts("env://"), var);
  }
  SetUp();
  g_env["MASTER_ADDR"] = "";  // set but empty counts as missing
  expect_usage_error(opts("env://"), "MASTER_ADDR");
}

TEST_F(InitMethodParse, BadEnvironmentValuesAreNamed) {
  g_env["MASTER_PORT"] = "http";
  expect_usage_error(opts("env://"), "MASTER_PORT");
  SetUp();
  g_env["MASTER_PORT"] = "70000";
  expect_usage_error(opts("env://"), "MASTER_PORT");
  SetUp();
  g_env["RANK"] = "-1";
  expect_usage_error(opts("env://"), "RANK");
  SetUp();
  g_env["WORLD_SIZE"] = "0";
  expect_usage_error(opts("env://"), "WORLD_SIZE");
  SetUp();
  g_env["RANK"] = "4";
  expect_usage_error(opts("env://"), "rank 4 is out of range for world_size 4");
  SetUp();
  expect_usage_error(opts("env://somehost"), "env:// takes no host");
}

TEST_F(InitMethodParse, TcpUrls) {
  auto m = tdist::parse_init_method(opts("tcp://node7:1234?rank=1&world_size=2"));
  EXPECT_EQ(m.scheme, "tcp");
  EXPECT_EQ(m.host, "node7");
  EXPECT_EQ(m.port, 1234);
  EXPECT_EQ(m.rank, 1);
  EXPECT_EQ(m.world_size, 2);
  m = tdist::parse_init_method(opts("tcp://[::1]:99?world_size=3", 2));
  EXPECT_EQ(m.host, "::1");
  EXPECT_EQ(m.port, 99);
  EXPECT_EQ(m.rank, 2);
}

TEST_F(InitMethodParse, TcpErrors) {
  expect_usage_error(opts("tcp://node7?rank=0&world_size=1"), "missing port");
  expect_usage_error(opts("tcp://:1234?rank=0&world_size=1"), "missing host");
  expect_usage_error(opts("tcp://node7:0?rank=0&world_size=1"), "port");
  expect_usage_error(opts("tcp://node7:12x?rank=0&world_size=1"), "port");
  expect_usage_error(opts("tcp://[::1:99?rank=0&world_size=1"), "ipv6");
  expect_usage_error(opts("tcp://node7:1234?world_size=2"), "no rank given");
  expect_usage_error(opts("tcp://node7:1234?rank=0"), "no world_size given");
  expect_usage_error(opts("tcp://node7:1234?rank=one&world_size=2"), "rank");
  expect_usage_error(opts("tcp://node7:1234?rank=0&world_size=2&colour=blue"), "unknown parameter 'colour'");
  expect_usage_error(opts("tcp://node7:1234?rank&world_size=2"), "not key=value");
  expect_usage_error(opts("tcp://node7:1234?rank=1&world_size=2", 0), "rank is 1");
}

TEST_F(InitMethodParse, FileUrlsAndUnknownSchemes) {
  auto m = tdist::parse_init_method(opts("file:///shared/job/store?rank=0&world_size=2"));
  EXPECT_EQ(m.scheme, "file");
  EXPECT_EQ(m.path, "/shared/job/store");
  expect_usage_error(opts("file://relative/store?rank=0&world_size=2"), "absolute path");
  expect_usage_error(opts("http://x:1?rank=0&world_size=1"), "unknown scheme 'http'");
  expect_usage_error(opts("just-a-word"), "not a URL");
}

TEST(Rendezvous, StoreAndInitMethodAreExclusive) {
  tdist::RendezvousOptions o;
  o.init_method = "env://";
  o.store = std::make_shared<tdist::HashStore>();
  o.rank = 0;
  o.world_size = 1;
  EXPECT_THROW(tdist::rendezvous(o), tdist::UsageError);
  o.init_method.clear();
  o.rank = -1;
  EXPECT_THROW(tdist::rendezvous(o), tdist::UsageError);
  o.rank = 1;
  EXPECT_THROW(tdist::rendezvous(o), tdist::UsageError);  // rank >= world_size
  o.rank = 0;
  auto r = tdist::rendezvous(o);
  EXPECT_EQ(r.world_size, 1);
  EXPECT_TRUE(r.store->check({"tdist/rendezvous/complete"}));
}

TEST(Rendezvous, ThreadsOverAnExplicitStore) {
  auto store = std::make_shared<tdist::HashStore>();
  std::vector<std::thread> ts;
  std::atomic<int> done{0};
  for (int r = 0; r < 4; ++r) {
    ts.emplace_back([&, r] {
      tdist::RendezvousOptions o;
      o.store = store;
      o.rank = r;
      o.world_size = 4;
      o.timeout = 10s;
      auto res = tdist::rendezvous(o);
      if (res.rank == r) ++done;
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(done.load(), 4);
}

// Runs world_size processes that rendezvous through url_for(rank) and
// exchange their ranks through the store; all must succeed.
void rendezvous_processes(int world, const std::function<tdist::RendezvousOptions(int)>& options_for) {
  std::vector<pid_t> kids;
  for (int r = 0; r < world; ++r) {
    kids.push_back(test::fork_child([&, r] {
      auto res = tdist::rendezvous(options_for(r));
      if (res.rank != r || res.world_size != world) return 2;
      res.store->set("hello/" + std::to_string(r), std::to_string(r * 10));
      for (int p = 0; p < world; ++p) {
        if (res.store->get_string("hello/" + std::to_string(p)) != std::to_string(p * 10)) return 3;
      }
      // Rank 0 hosts the TCP server, so it leaves last: the others need the
      // server only until their last request is answered.
      if (res.store->add("bye", 1) == world) res.store->set("all-bye", "1");
      if (r == 0) res.store->wait({"all-bye"});
      return 0;
    }));
  }
  for (pid_t k : kids) {
    int st = test::wait_child(k, 60s);
    EXPECT_TRUE(test::exited_ok(st)) << test::describe_status(st);
  }
}

TEST(Rendezvous, FourProcessesOverTcp) {
  const int port = tdist::detail::find_free_port();
  rendezvous_processes(4, [&](int r) {
    tdist::RendezvousOptions o;
    o.init_method = "tcp://127.0.0.1:" + std::to_string(port) + "?rank=" + std::to_string(r) + "&world_size=4";
    o.timeout = 30s;
    return o;
  });
}

TEST(Rendezvous, ThreeProcessesOverAFile) {
  test::TempDir dir;
  rendezvous_processes(3, [&](int r) {
    tdist::RendezvousOptions o;
    o.init_method = "file://" + dir.path() + "/store?world_size=3";
    o.rank = r;
    o.timeout = 30s;
    return o;
  });
}

TEST(Rendezvous, FourProcessesOverEnv) {
  const int port = tdist::detail::find_free_port();
  rendezvous_processes(4, [&](int r) {
    g_env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)},
             {"RANK", std::to_string(r)}, {"WORLD_SIZE", "4"}};
    tdist::RendezvousOptions o;
    o.getenv = fake_getenv;
    o.timeout = 30s;
    return o;
  });
}

TEST(Rendezvous, AMissingRankIsNamedInTheTimeout) {
  auto store = std::make_shared<tdist::HashStore>();
  std::vector<std::thread> ts;
  std::vector<std::string> errors(3);
  for (int r : {0, 2}) {  // rank 1 never comes
    ts.emplace_back([&, r] {
      tdist::RendezvousOptions o;
      o.store = store;
      o.rank = r;
      o.world_size = 3;
      o.timeout = 300ms;
      try {
        tdist::rendezvous(o);
      } catch (const tdist::TimeoutError& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int r : {0, 2}) {
    EXPECT_NE(errors[r].find("rank(s) 1 of 3 never joined"), std::string::npos) << errors[r];
  }
}

TEST(Rendezvous, ADuplicateRankIsCaught) {
  auto store = std::make_shared<tdist::HashStore>();
  tdist::RendezvousOptions o;
  o.store = store;
  o.rank = 0;
  o.world_size = 2;
  o.timeout = 5s;
  std::thread first([&] {
    try {
      tdist::rendezvous(o);
    } catch (const tdist::Error&) {
    }
  });
  // Give the first claim time to land, then claim rank 0 again (another
  // "process" is faked by a different owner string in the store).
  while (!store->check({"tdist/rendezvous/rank/0"})) std::this_thread::sleep_for(1ms);
  store->set("tdist/rendezvous/rank/0", "otherhost:1");
  try {
    tdist::rendezvous(o);
    ADD_FAILURE() << "duplicate rank accepted";
  } catch (const tdist::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 is claimed twice"), std::string::npos) << e.what();
  }
  // Let the first one finish.
  store->set("tdist/rendezvous/complete", "1");
  first.join();
}

}  // namespace
