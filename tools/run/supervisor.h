// One node's ranks through a start of the job: starts them (one process
// each, in a process group of its own, with torchrun's environment), shows
// their output, reaps them, names the rank that failed first, stops the
// others (SIGTERM, then SIGKILL after the grace period) and, for a job of
// fixed membership, restarts them up to --max-restarts times.
//
// Owns: the ranks of the current start (Child), the screen (run/output.h)
// and the guardian (run/guardian.h). Needs: the options (run/launch_options.h),
// the ranks' health watch (run/health_watch.h), ticked from the loop, and
// the stop signal (below), which main installs.
// Threading: the launcher's one thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "run/elastic_agent.h"
#include "run/guardian.h"
#include "run/launch_options.h"
#include "run/output.h"

namespace tdist_run {

class HealthWatch;

// SIGINT and SIGTERM stop the launcher: the handler only notes the signal
// (in the one global a handler can reach), the loop forwards it to every
// rank. stop_signal(): the signal that came, 0 while none did.
void catch_stop_signals();
int stop_signal();
// Says that the launcher was stopped by `sig`; the launcher's exit code.
int report_stop_signal(int sig);

// A rank of the current start.
struct Child {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;  // merged stdout+stderr
  bool exited = false;
  int status = 0;
  // The launcher's loop pass in which this rank was first seen on its way
  // out (exiting, a zombie, or reaped); 0: not yet. See first_failed.
  uint64_t dead_pass = 0;
  bool signaled_by_launcher = false;  // before it ended
};

// Where this node's ranks stand in the job: set from the flags, or by each
// elastic round.
struct Placement {
  int first_rank = 0;  // RANK of local rank 0
  int world = 1;
  int group_rank = 0;
  int group_world = 1;
  std::string master_addr;
  int master_port = 0;
  int restart_count = 0;
};

// How a start of the job ended on this node.
struct Outcome {
  int failed = -1;  // the first rank that failed on its own; -1: none
  // Elastic: why this node's ranks were stopped from outside (another
  // node's failure, a membership change, an abort), when they were.
  std::optional<StopRequest> stopped;
};

// Asked every ~200 ms while ranks run: a reason to stop them (elastic).
using StopCheck = std::function<std::optional<StopRequest>()>;

// Which rank failed first (an index into kids). A rank that dies is on its
// way out (PF_EXITING) before its sockets close, so before any peer can
// notice and fail in turn; the loop stamps every rank seen on its way out
// with the pass that saw it, so the rank that failed first has the earliest
// pass. Within one pass (peers that noticed at once), a rank killed by a
// signal nobody here sent goes first (SIGKILL before other signals: a crash
// or kill -9 from outside is the cause, an abort the consequence), then a
// failing exit code; ranks that failed after the launcher signaled them
// come last. -1: none failed.
int first_failed(const std::vector<Child>& kids);

class Supervisor {
 public:
  // `heartbeat_dir`: handed to the ranks as TDIST_HEARTBEAT_DIR ("": none);
  // `health` watches them. `tty`: the launcher's stdout is a terminal.
  Supervisor(const Options& o, bool tty, std::string heartbeat_dir, HealthWatch& health);

  // Forks the guardian (see Guardian::start for when).
  void start_guardian() { guardian_.start(); }

  // Runs one start of the job on this node, until every rank has ended.
  // A token of kind kGenerate gets a fresh value: ranks left over from an
  // earlier start cannot join this one.
  Outcome run_once(const Placement& at, TokenPlan token, const StopCheck& stop_check = {});

  // A job of fixed membership: starts at `at`, restarting every rank after
  // a failure up to --max-restarts times; the launcher's exit code.
  int run_with_restarts(Placement at, const TokenPlan& token);

  // Prints how the last start ended: the rank that failed first (an index
  // from Outcome::failed), then the others. Returns the first's line.
  std::string report_failure(int failure) const;

 private:
  class Generation;

  Child spawn(int local_rank, const Placement& at, const TokenPlan& token);
  // The rank's environment, set in the forked child before exec.
  void set_rank_env(int rank, int local_rank, const Placement& at, const TokenPlan& token) const;

  const Options& o_;
  RankOutput output_;
  Guardian guardian_;
  std::string heartbeat_dir_;
  HealthWatch& health_;
  std::vector<Child> kids_;  // the current (or last) start's ranks
};

}  // namespace tdist_run
