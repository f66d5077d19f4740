// tdist-run: starts one process per local rank, torchrun-style.
//
//   tdist-run --nproc-per-node N [--nnodes M --node-rank R] [--master-addr A]
//             [--master-port P] [--max-restarts K] [--token-file F | --no-token]
//             [--] program [args...]
//   tdist-run --nproc-per-node N --nnodes MIN:MAX --rdzv-endpoint HOST:PORT
//             [--rdzv-conf join_timeout=S,last_call_timeout=S] [--local-addr A] ...
//
// --nnodes MIN:MAX is elastic (torchrun's meaning; see run/elastic_agent.h):
// the nodes' launchers meet at the endpoint, start as one world with
// whoever came (MIN to MAX nodes), and after a failure, a node lost or a
// node arriving, meet again and restart with whoever is there.
//
// Sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR, MASTER_PORT and (unless set) OMP_NUM_THREADS. Every output
// line of a rank is prefixed with "[rank N]: ". When a rank fails, the others
// get SIGTERM, then SIGKILL after a grace period, and tdist-run exits
// non-zero after a summary naming the rank and how it ended.
//
// The job's store token (see store/auth.h): a single-node job gets a fresh
// random one per start, handed to the ranks in TDIST_STORE_TOKEN (the
// environment, which only the user can read; never a command line, which
// `ps` shows everyone). --token-file, or TDIST_STORE_TOKEN /
// TDIST_STORE_TOKEN_FILE already set, give one instead; a multi-node job
// needs one of those (every node must hold the same) or --no-token.
//
// Ranks die with the launcher, however it ends: each rank gets SIGKILL as
// its parent-death signal, and a guardian process (see run/guardian.h) that
// outlives a launcher killed with SIGKILL then kills what the ranks started
// (their process groups) and removes the shared memory they left.
//
// The parts, in tools/run/: launch_options (the command line; cluster_env:
// what Kubeflow's PET_* and Slurm's variables give it), supervisor
// (the ranks: start, output through output, ends, restarts; /proc through
// proc_status; the guardian), health_watch (heartbeats, stall dumps,
// status lines), elastic_run and elastic_agent (--nnodes MIN:MAX). This
// file: main, which puts them together.
#include <unistd.h>

#include <cstdlib>

#include "run/elastic_run.h"
#include "run/health_watch.h"
#include "run/launch_options.h"
#include "run/supervisor.h"
#include "store/socket.h"

int main(int argc, char** argv) {
  using namespace tdist_run;
  const Options o = parse(argc, argv);
  setenv("TORCHELASTIC_RUN_ID", o.rdzv_id.c_str(), 1);  // torchrun's; the ranks' dump directory is named by it
  JobFiles files(o.rdzv_id);
  HealthOptions ho;
  ho.heartbeat_dir = files.heartbeat_dir();
  ho.dump_dir = files.dump_dir();
  ho.stall_s = o.stall_s;
  ho.status_interval_s = o.status_interval_s;
  ho.analyze_program = trace_program();
  HealthWatch health(std::move(ho));
  Supervisor supervisor(o, isatty(1) == 1, files.heartbeat_dir(), health);
  catch_stop_signals();
  if (o.elastic) return run_elastic(o, plan_token(o), supervisor);
  Placement at;
  at.first_rank = o.node_rank * o.nproc;
  at.world = o.nnodes * o.nproc;
  at.group_rank = o.node_rank;
  at.group_world = o.nnodes;
  at.master_addr = o.master_addr;
  at.master_port = o.master_port ? o.master_port : tdist::detail::find_free_port();
  const TokenPlan token = plan_token(o);
  supervisor.start_guardian();
  return supervisor.run_with_restarts(at, token);
}
