// tdist-run's view of its ranks' health, from the heartbeat files their
// flight recorders write (src/trace/dumper.cpp has the format: one line
// per rank in $TDIST_HEARTBEAT_DIR/rank-<R>, replaced every second).
//
// - Stall detection: when some rank has waited in an op for the stall time
//   and no rank of this node completed an op meanwhile, it sends SIGUSR1 to
//   every rank that writes a heartbeat (each has the recorder's handler in
//   place; a rank without one is never signalled: SIGUSR1 would kill it),
//   waits up to 10 s for their dumps, then prints the analysis of the dump
//   directory (tdist-trace analyze's report). Once per stall: it re-arms
//   when an op completes again. The stall time: --stall-seconds, or by
//   default half the waiting op's own timeout, at most 300 s.
// - --status-interval S: every S seconds one line: steps/s of each rank,
//   the slowest rank and its last completed op, and the ranks that fall
//   behind (two or more steps behind the most advanced, or nothing
//   completed for an interval while the others did).
//
// The job's ranks on other nodes are watched by their own tdist-run.
// Threading: the launcher's loop only. Nothing here blocks: tick() reads a
// few small files and returns.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tdist_run {

// One heartbeat line, parsed.
struct Heartbeat {
  int rank = -1;
  pid_t pid = 0;
  int64_t now_ns = 0;
  int64_t steps = 0;
  int64_t completed = 0;
  int64_t last_completed_ns = 0;
  int64_t dumps = 0;
  std::string last_op;  // "all_reduce#12@world" or "-"
  std::string pending_op;
  std::string pending_state;
  int64_t pending_since_ns = 0;
  int64_t pending_timeout_ms = 0;
};

// tdist-trace beside this tdist-run, else "tdist-trace" (found on PATH).
std::string trace_program();

// Whether /proc says process `pid` catches SIGUSR1 (SigCgt).
bool catches_sigusr1(pid_t pid);

// Parses a heartbeat line; false when it is not one (a partial or foreign file).
bool parse_heartbeat(const std::string& line, Heartbeat& out);

// "all_reduce#12@world" -> "all_reduce #12 of group 'world'".
std::string describe_op(const std::string& tag);

struct HealthOptions {
  std::string heartbeat_dir;
  std::string dump_dir;
  double stall_s = -1;          // < 0: automatic (see above); 0: off
  double status_interval_s = 0;  // 0: no status lines
  // The program that analyses a dump directory ("PROGRAM analyze DIR"),
  // run in the background (60 s at most) while the launcher goes on;
  // empty: none.
  std::string analyze_program;
};

// The job's flight-recorder files on this node: the dump directory the
// ranks inherit as TDIST_DUMP_DIR (the user's, else
// $PWD/tdist-dumps/<rdzv id, or start time and launcher pid>), and a
// private heartbeat directory (made here, removed with what is in it on
// destruction; empty when it could not be made: no health watch then).
class JobFiles {
 public:
  explicit JobFiles(const std::string& rdzv_id);
  ~JobFiles();
  JobFiles(const JobFiles&) = delete;
  JobFiles& operator=(const JobFiles&) = delete;
  const std::string& dump_dir() const { return dump_dir_; }
  const std::string& heartbeat_dir() const { return heartbeat_dir_; }

 private:
  std::string dump_dir_;
  std::string heartbeat_dir_;
};

class HealthWatch {
 public:
  explicit HealthWatch(HealthOptions o) : o_(std::move(o)) {}
  ~HealthWatch();
  HealthWatch(const HealthWatch&) = delete;
  HealthWatch& operator=(const HealthWatch&) = delete;

  // A rank of this node: its global rank and pid (0 once it has exited).
  struct Rank {
    int rank;
    pid_t pid;
  };
  // Called from the launcher's loop (every ~50 ms): reads the heartbeats
  // at most twice a second and acts as above.
  void tick(const std::vector<Rank>& ranks);
  // A new start of the job (its ranks about to be spawned): forget the
  // last one's readings and remove its heartbeat files.
  void reset();

 private:
  void read_heartbeats(const std::vector<Rank>& ranks);
  void check_stall(const std::vector<Rank>& ranks, int64_t now_ns);
  void finish_dumps(bool timed_out);
  void start_analysis();
  void poll_analysis(bool finish);
  void print_status(int64_t now_ns);

  HealthOptions o_;
  std::chrono::steady_clock::time_point next_read_{};
  std::map<int, Heartbeat> beats_;  // by rank
  // Stall: signalled (waiting for dumps) and the dumps counts before it.
  bool stalled_ = false;
  bool waiting_for_dumps_ = false;
  int64_t signalled_ns_ = 0;
  std::map<int, int64_t> dumps_before_;
  // The analysis running in the background: its pid, the read end of its
  // output, what it printed so far, when it is given up on.
  pid_t analyzer_ = 0;
  int analyzer_fd_ = -1;
  std::string analyzer_out_;
  std::chrono::steady_clock::time_point analyzer_until_{};
  int64_t started_ns_ = 0;  // this start's spawn time: older heartbeats are the last start's
  // Status: the last line's time and each rank's steps then.
  int64_t last_status_ns_ = 0;
  std::map<int, int64_t> steps_at_status_;
  std::map<int, int64_t> completed_at_status_;
};

}  // namespace tdist_run
