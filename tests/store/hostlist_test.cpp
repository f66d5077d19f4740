// Slurm's host lists (util/hostlist.h): the forms Slurm writes, hostile
// ones (bounded work, no overflow), and every malformed one named; and
// what util/launch_env.h reads from launchers' variables (local rank and
// size, Slurm's per-node task counts, the job-id port).
#include <gtest/gtest.h>

#include <chrono>
#include <map>

#include "tdist/errors.h"
#include "util/hostlist.h"
#include "util/launch_env.h"

namespace {

using tdist::detail::count_hosts;
using tdist::detail::expand_hosts;
using tdist::detail::first_host;
using Hosts = std::vector<std::string>;

void expect_error(const std::string& list, const std::string& needle) {
  for (int f = 0; f < 3; ++f) {  // every entry point checks the whole list
    try {
      if (f == 0) first_host(list);
      if (f == 1) count_hosts(list);
      if (f == 2) expand_hosts(list, 1000);
      ADD_FAILURE() << "'" << list << "' parsed without error (function " << f << ")";
    } catch (const tdist::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "list '" << list << "': " << e.what();
    }
  }
}

TEST(HostList, PlainNamesAndRanges) {
  EXPECT_EQ(expand_hosts("node1", 10), Hosts{"node1"});
  EXPECT_EQ(expand_hosts("node[01-04,07]", 10), (Hosts{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expand_hosts("a1,b[2-3]", 10), (Hosts{"a1", "b2", "b3"}));
  EXPECT_EQ(expand_hosts("gpu[7],cpu[10-11],login", 10), (Hosts{"gpu7", "cpu10", "cpu11", "login"}));
  EXPECT_EQ(first_host("node[01-04,07]"), "node01");
  EXPECT_EQ(first_host("a1,b[2-3]"), "a1");
  EXPECT_EQ(first_host("127.0.0.[1-2]"), "127.0.0.1");
  EXPECT_EQ(count_hosts("node[01-04,07],x,y[1-3]"), 9u);
}

TEST(HostList, ZeroPaddingFollowsTheLowEnd) {
  EXPECT_EQ(expand_hosts("n[001-003]", 10), (Hosts{"n001", "n002", "n003"}));
  EXPECT_EQ(expand_hosts("n[08-10]", 10), (Hosts{"n08", "n09", "n10"}));
  EXPECT_EQ(expand_hosts("n[8-10]", 10), (Hosts{"n8", "n9", "n10"}));
  EXPECT_EQ(expand_hosts("n[98-100]", 10), (Hosts{"n98", "n99", "n100"}));
  EXPECT_EQ(expand_hosts("n[0,01,002]", 10), (Hosts{"n0", "n01", "n002"}));  // each range its own width
  EXPECT_EQ(first_host("n[0007-9]"), "n0007");
}

TEST(HostList, SuffixesAndSeveralGroups) {
  EXPECT_EQ(expand_hosts("n[1-2]-ib", 10), (Hosts{"n1-ib", "n2-ib"}));
  EXPECT_EQ(expand_hosts("rack[1-2]-n[01-02]", 10), (Hosts{"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"}));
  EXPECT_EQ(expand_hosts("r[1,3]n[5-6].x[0-1]", 10),
            (Hosts{"r1n5.x0", "r1n5.x1", "r1n6.x0", "r1n6.x1", "r3n5.x0", "r3n5.x1", "r3n6.x0", "r3n6.x1"}));
  EXPECT_EQ(expand_hosts("[1-2]", 10), (Hosts{"1", "2"}));
  EXPECT_EQ(first_host("rack[2-3]-n[07-08]-ib,z"), "rack2-n07-ib");
  EXPECT_EQ(count_hosts("rack[1-2]-n[01-02],rack[5,7-9]-n[1-3]"), 4u + 12u);
  // Commas inside brackets separate ranges, outside them hosts.
  EXPECT_EQ(expand_hosts("a[1,3],b[2,4]-c", 10), (Hosts{"a1", "a3", "b2-c", "b4-c"}));
}

// Hostile lists: huge ranges are counted, never expanded; numbers past 18
// digits, names past 255 characters, lists past 1 MiB are refused.
TEST(HostList, HostileListsAreBounded) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(first_host("n[0-999999999999]"), "n0");
  EXPECT_EQ(count_hosts("n[0-999999999999]"), 1000000000000u);
  EXPECT_EQ(count_hosts("a[0-999999999999999999]b[0-999999999999999999]"), UINT64_MAX);  // saturates
  EXPECT_EQ(count_hosts("a[0-999999999999999999],b[0-999999999999999999]"), 2000000000000000000u);
  try {
    expand_hosts("n[0-999999999999]", 100000);
    ADD_FAILURE() << "expanded a trillion hosts";
  } catch (const tdist::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("names 1000000000000 hosts, over the limit of 100000"), std::string::npos)
        << e.what();
  }
  try {
    expand_hosts("a[0-999999999999999999]b[0-999999999999999999]", 10);
    ADD_FAILURE();
  } catch (const tdist::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("more than 2^64"), std::string::npos) << e.what();
  }
  EXPECT_EQ(expand_hosts("n[1-3]", 3).size(), 3u);  // the limit itself is allowed
  expect_error("n[1-9999999999999999999]", "more than 18 digits");
  expect_error("n[00000000000000000001]", "more than 18 digits");
  expect_error(std::string(256, 'h'), "a host name of 256 characters");
  expect_error("h" + std::string(250, 'x') + "[1-10000]", "a host name of 256 characters");
  EXPECT_EQ(first_host(std::string(255, 'h')), std::string(255, 'h'));
  // A long list of short names, and one past the size limit.
  std::string many;
  for (int i = 0; i < 100000; ++i) many += "n[1-2],";
  many += "last";
  EXPECT_EQ(count_hosts(many), 200001u);
  expect_error(std::string(tdist::detail::kMaxHostListBytes + 1, 'a'), "over the limit");
  // Many ranges in one group.
  std::string group = "n[";
  for (int i = 0; i < 100000; ++i) group += std::to_string(i * 2) + ",";
  group += "1]";
  EXPECT_EQ(count_hosts(group), 100001u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

TEST(HostList, MalformedListsAreNamed) {
  expect_error("", "it is empty");
  expect_error(",", "an empty host name");
  expect_error("a,,b", "an empty host name (at character 3)");
  expect_error("a,", "an empty host name");
  expect_error("n[1-3", "the '[' has no ']' (at character 2)");
  expect_error("n[1-3,", "the '[' has no ']'");
  expect_error("n[", "the '[' has no ']'");
  expect_error("n1-3]", "a ']' without its '['");
  expect_error("n[1-[2]]", "a '[' inside a bracket group");
  expect_error("n[]", "']' where a number belongs");
  expect_error("n[5-3]", "the range 5-3 runs backwards");
  expect_error("n[1-]", "']' where a number belongs");
  expect_error("n[-1]", "'-' where a number belongs");
  expect_error("n[1--2]", "'-' where a number belongs");
  expect_error("n[a-b]", "'a' where a number belongs");
  expect_error("n[1 2]", "' ' in a bracket group");
  expect_error("n[1-2]x[3]y]", "a ']' without its '['");
  expect_error("a b", "' ' is no host name character");
  expect_error(std::string("a\x1b[2Jb"), "'\\x1b' is no host name character");  // shown, not sent to the terminal
  expect_error("n\xc3\xa9", "is no host name character");
}

TEST(SlurmEnv, TasksOnANode) {
  using tdist::detail::slurm_tasks_on_node;
  EXPECT_EQ(slurm_tasks_on_node("8", 0), 8);
  EXPECT_EQ(slurm_tasks_on_node("8", 1), std::nullopt);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 0), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 2), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 3), 1);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 4), std::nullopt);
  EXPECT_EQ(slurm_tasks_on_node("4,2(x2),8(x999999999)", 1000000001), 8);
  EXPECT_EQ(slurm_tasks_on_node("4,2(x2),8(x999999999)", 1000000002), std::nullopt);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", -1), std::nullopt);
  for (const char* bad : {"", "x", "2(x0)", "2(x3", "2(3)", "2,", ",2", "2(x3)1", "1234567890", "2(x1234567890)",
                          "2,,3", "2(x3),y"}) {
    EXPECT_EQ(slurm_tasks_on_node(bad, 0), std::nullopt) << "'" << bad << "'";
  }
}

std::map<std::string, std::string> g_env;
const char* fake_getenv(const char* name) {
  auto it = g_env.find(name);
  return it == g_env.end() ? nullptr : it->second.c_str();
}

// LOCAL_RANK and LOCAL_WORLD_SIZE (the nccl backend's GPU, FSDP's hybrid
// groups) fall back as env:// does: mpirun's names, then srun's.
TEST(SlurmEnv, LocalRankAndSizeFallBackLikeEnvInit) {
  using tdist::detail::local_rank_from_env;
  using tdist::detail::local_world_size_from_env;
  g_env = {{"SLURM_LOCALID", "3"}, {"SLURM_NODEID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "8,4(x2)"}};
  ASSERT_TRUE(local_rank_from_env(fake_getenv));
  EXPECT_EQ(local_rank_from_env(fake_getenv)->value, 3);
  EXPECT_STREQ(local_rank_from_env(fake_getenv)->name, "SLURM_LOCALID");
  ASSERT_TRUE(local_world_size_from_env(fake_getenv));
  EXPECT_EQ(local_world_size_from_env(fake_getenv)->value, 4);
  g_env["SLURM_NODEID"] = "0";
  EXPECT_EQ(local_world_size_from_env(fake_getenv)->value, 8);
  g_env["OMPI_COMM_WORLD_LOCAL_RANK"] = "1";
  g_env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2";
  EXPECT_EQ(local_rank_from_env(fake_getenv)->value, 1);
  EXPECT_EQ(local_world_size_from_env(fake_getenv)->value, 2);
  g_env["LOCAL_RANK"] = "0";
  g_env["LOCAL_WORLD_SIZE"] = "6";
  EXPECT_EQ(local_rank_from_env(fake_getenv)->value, 0);
  EXPECT_EQ(local_world_size_from_env(fake_getenv)->value, 6);
  g_env = {{"LOCAL_RANK", "-1"}, {"LOCAL_WORLD_SIZE", "0"}};
  EXPECT_FALSE(local_rank_from_env(fake_getenv));
  EXPECT_FALSE(local_world_size_from_env(fake_getenv));
  g_env = {{"SLURM_NODEID", "5"}, {"SLURM_STEP_TASKS_PER_NODE", "8(x2)"}};  // no such node
  EXPECT_FALSE(local_world_size_from_env(fake_getenv));
  g_env.clear();
  EXPECT_FALSE(local_rank_from_env(fake_getenv));
  EXPECT_FALSE(local_world_size_from_env(fake_getenv));
}

TEST(SlurmEnv, ThePortOfAJob) {
  using tdist::detail::slurm_default_port;
  EXPECT_EQ(slurm_default_port({"SLURM_JOB_ID", "12345"}), 22345);
  EXPECT_EQ(slurm_default_port({"SLURM_JOB_ID", "7"}), 20007);
  EXPECT_EQ(slurm_default_port({"SLURM_JOB_ID", "4294967295"}), 27295);
  try {
    slurm_default_port({"SLURM_JOBID", "12x"});
    ADD_FAILURE();
  } catch (const tdist::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("SLURM_JOBID is '12x', not a Slurm job id"), std::string::npos) << e.what();
  }
  g_env = {{"SLURM_JOBID", "5"}, {"SLURM_JOB_NODELIST", "a[1-2]"}, {"SLURM_STEP_NODELIST", "b[3-4]"}};
  EXPECT_STREQ(tdist::detail::slurm_job_id(fake_getenv)->name, "SLURM_JOBID");
  EXPECT_EQ(tdist::detail::slurm_node_list(fake_getenv)->value, "b[3-4]");  // the step's nodes first
  g_env.erase("SLURM_STEP_NODELIST");
  EXPECT_EQ(tdist::detail::slurm_node_list(fake_getenv)->value, "a[1-2]");
}

}  // namespace
