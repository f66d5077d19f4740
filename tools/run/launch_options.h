// tdist-run's command line: the options, checked (a bad one exits 2,
// naming it), and where the ranks' store token comes from. What the
// command line leaves out may come from torchrun's PET_* variables or
// Slurm's (run/cluster_env.h).
#pragma once

#include <string>
#include <vector>

namespace tdist_run {

struct Options {
  int nproc = 1;
  int nnodes = 1;
  int node_rank = 0;
  // --nnodes MIN:MAX: elastic (nnodes is then MAX, for the token's rule).
  bool elastic = false;
  int min_nodes = 1;
  std::string rdzv_backend = "c10d";  // c10d (the built-in store) or etcd
  std::string rdzv_endpoint;  // HOST:PORT, or etcd's members: HOST:PORT,HOST:PORT,...
  std::string rdzv_id = "none";
  std::string local_addr;
  double join_timeout_s = 900;
  double last_call_s = 30;
  double job_ttl_s = 600;  // etcd: how long the job's keys outlive its last launcher
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port, chosen once
  int max_restarts = 0;
  double grace_s = 5.0;
  // After the first failure, how long the other ranks get to notice it and
  // exit on their own (reporting the error in their own words) before
  // they are sent SIGTERM.
  double peer_wait_s = 3.0;
  std::string token_file;
  bool no_token = false;
  // The ranks' health (run/health_watch.h): seconds without progress
  // before a stall dump (< 0: half the waiting op's timeout, at most 300;
  // 0: off), and between status lines (0: none).
  double stall_s = -1;
  double status_interval_s = 0;
  std::vector<std::string> argv;
};

// What the ranks get for TDIST_STORE_TOKEN: kKeep leaves the environment's
// TDIST_STORE_TOKEN / TDIST_STORE_TOKEN_FILE as they are.
struct TokenPlan {
  enum Kind { kGenerate, kGiven, kKeep, kNone } kind = kGenerate;
  std::string token;  // kGiven
};

[[noreturn]] void usage(const std::string& why);

// Parses and checks the command line (exits 2 on a bad one).
Options parse(int argc, char** argv);

// Where the ranks' store token comes from (exits 2 on a bad token file, or
// a multi-node job without one).
TokenPlan plan_token(const Options& o);

}  // namespace tdist_run
