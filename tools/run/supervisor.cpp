#include "run/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "run/health_watch.h"
#include "run/proc_status.h"
#include "store/auth.h"

namespace tdist_run {

namespace {

using Clock = std::chrono::steady_clock;

// The stop signal: the one file-scope variable, as the handler must reach it.
volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

Clock::time_point seconds_from_now(double s) {
  return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "status " + std::to_string(status);
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// Signals a rank's whole process group (it may have started children).
// A rank already on its way out is not ended by it: it keeps its place in
// first_failed's order.
void signal_rank(Child& c, int sig) {
  if (c.dead_pass == 0) c.signaled_by_launcher = true;
  if (kill(-c.pid, sig) != 0) kill(c.pid, sig);
}

}  // namespace

void catch_stop_signals() {
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int stop_signal() { return g_signal; }

int report_stop_signal(int sig) {
  std::fprintf(stderr, "tdist-run: stopped by signal %d (%s), forwarded to every rank\n", sig, strsignal(sig));
  return 128 + sig;
}

int first_failed(const std::vector<Child>& kids) {
  auto order = [](const Child& k) {
    const int cls = k.signaled_by_launcher ? 3
                    : WIFSIGNALED(k.status) ? (WTERMSIG(k.status) == SIGKILL ? 0 : 1)
                                            : 2;
    return std::make_pair(k.dead_pass, cls);
  };
  int best = -1;
  for (size_t i = 0; i < kids.size(); ++i) {
    if (!kids[i].exited || !failed(kids[i].status)) continue;
    if (best < 0 || order(kids[i]) < order(kids[best])) best = static_cast<int>(i);
  }
  return best;
}

// The loop of one start: the ranks' output, their ends, and stopping them.
class Supervisor::Generation {
 public:
  explicit Generation(Supervisor& s) : s_(s), open_pipes_(s.kids_.size()), running_(s.kids_.size()) {}

  // Until every rank has ended and its output is read (or, when something
  // the rank left behind holds its pipe, 500 ms after the last rank ended).
  Outcome run(const StopCheck& stop_check);

 private:
  // Sends `sig` to every rank still running; SIGKILL follows after the grace period.
  void stop_all(int sig);
  // Elastic: asked every 200 ms while ranks run or are being stopped (it
  // also tells the other nodes this one is alive); acted on once.
  void ask(const StopCheck& stop_check);
  void read_output();
  // Reaps, and stamps each rank with the pass that first saw it on its way
  // out (see first_failed); whether it stamped one.
  bool reap();
  // Once a rank has failed, the others are looked at in /proc too, twice
  // when this pass saw a new one, so that a rank whose death a peer noticed
  // is stamped no later than that peer.
  void stamp_exiting(bool stamped);
  void tick_health();

  Supervisor& s_;
  Outcome out_;
  size_t open_pipes_;
  size_t running_;
  uint64_t pass_ = 0;        // loop passes, for Child::dead_pass
  bool any_failed_ = false;  // the ranks left get peer_wait_s, then SIGTERM
  bool terminating_ = false;
  Clock::time_point next_check_ = Clock::now(), kill_at_{}, term_at_{};
  // After the last rank exits, its output pipe may still be held open by a
  // child it left behind: drain briefly, then stop listening.
  Clock::time_point drain_until_{};
};

Outcome Supervisor::Generation::run(const StopCheck& stop_check) {
  while (running_ > 0 || (open_pipes_ > 0 && Clock::now() < drain_until_)) {
    if (const int sig = stop_signal(); sig && !terminating_) stop_all(sig);
    if (stop_check && running_ > 0 && Clock::now() >= next_check_) ask(stop_check);
    read_output();
    ++pass_;
    stamp_exiting(reap());
    tick_health();
    if (any_failed_ && !terminating_ && running_ > 0 && Clock::now() >= term_at_) stop_all(SIGTERM);
    if (running_ == 0 && drain_until_ == Clock::time_point{}) drain_until_ = Clock::now() + std::chrono::milliseconds(500);
    if (terminating_ && Clock::now() >= kill_at_) {
      for (auto& k : s_.kids_) if (!k.exited) signal_rank(k, SIGKILL);
    }
  }
  for (auto& k : s_.kids_) {
    if (k.out_fd >= 0) {
      s_.output_.close(k.rank);
      close(k.out_fd);
      k.out_fd = -1;
    }
    // Every rank was reaped above, its group killed and its pid taken off
    // the guardian's list then (its number may belong to another process
    // by now: no signal goes to it here).
  }
  out_.failed = first_failed(s_.kids_);
  // Ranks that failed only once stopped from outside did not fail on their own.
  if (out_.stopped && out_.failed >= 0 && s_.kids_[out_.failed].signaled_by_launcher) out_.failed = -1;
  return std::move(out_);
}

void Supervisor::Generation::stop_all(int sig) {
  for (auto& k : s_.kids_) if (!k.exited) signal_rank(k, sig);
  terminating_ = true;
  kill_at_ = seconds_from_now(s_.o_.grace_s);
}

void Supervisor::Generation::ask(const StopCheck& stop_check) {
  next_check_ = Clock::now() + std::chrono::milliseconds(200);
  auto stop = stop_check();
  if (stop && !terminating_ && !any_failed_ && !out_.stopped) {
    out_.stopped = std::move(stop);
    stop_all(SIGTERM);
  }
}

void Supervisor::Generation::read_output() {
  std::vector<pollfd> pfds;
  std::vector<Child*> owners;
  for (auto& k : s_.kids_) {
    if (k.out_fd >= 0) {
      pfds.push_back({k.out_fd, POLLIN, 0});
      owners.push_back(&k);
    }
  }
  if (poll(pfds.data(), pfds.size(), 50) <= 0) return;
  for (size_t i = 0; i < pfds.size(); ++i) {
    if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    char buf[65536];
    const ssize_t n = read(pfds[i].fd, buf, sizeof buf);
    if (n > 0) {
      s_.output_.write(owners[i]->rank, buf, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
      s_.output_.close(owners[i]->rank);
      close(owners[i]->out_fd);
      owners[i]->out_fd = -1;
      --open_pipes_;
    }
  }
}

bool Supervisor::Generation::reap() {
  bool stamped = false;
  for (auto& k : s_.kids_) {
    if (k.exited) continue;
    int status = 0;
    if (waitpid(k.pid, &status, WNOHANG) != k.pid) continue;
    k.exited = true;
    k.status = status;
    --running_;
    // Reaped, its pid is free for another process: end what it left in
    // its group now (while the group holds the number) and take it off
    // the guardian's list, which must never name a pid not ours.
    kill(-k.pid, SIGKILL);
    s_.guardian_.reaped(k.pid);
    if (k.dead_pass == 0) {
      k.dead_pass = pass_;
      stamped = true;
    }
    if (failed(status) && !any_failed_) {
      any_failed_ = true;
      term_at_ = seconds_from_now(s_.o_.peer_wait_s);
    }
  }
  return stamped;
}

void Supervisor::Generation::stamp_exiting(bool stamped) {
  for (int sweep = 0; any_failed_ && sweep < (stamped ? 2 : 1); ++sweep) {
    for (auto& k : s_.kids_) {
      if (!k.exited && k.dead_pass == 0 && is_exiting(k.pid)) {
        k.dead_pass = pass_;
        stamped = true;
      }
    }
  }
}

void Supervisor::Generation::tick_health() {
  if (terminating_ || running_ == 0) return;
  std::vector<HealthWatch::Rank> ranks;
  for (const auto& k : s_.kids_) ranks.push_back({k.rank, k.exited ? 0 : k.pid});
  s_.health_.tick(ranks);
}

Supervisor::Supervisor(const Options& o, bool tty, std::string heartbeat_dir, HealthWatch& health)
    : o_(o), output_(tty), heartbeat_dir_(std::move(heartbeat_dir)), health_(health) {}

Outcome Supervisor::run_once(const Placement& at, TokenPlan token, const StopCheck& stop_check) {
  kids_.clear();
  output_.reset();
  if (token.kind == TokenPlan::kGenerate) token.token = tdist::detail::generate_token();
  health_.reset();  // before the ranks start writing heartbeats
  for (int r = 0; r < o_.nproc; ++r) kids_.push_back(spawn(r, at, token));
  return Generation(*this).run(stop_check);
}

int Supervisor::run_with_restarts(Placement at, const TokenPlan& token) {
  for (int attempt = 0;; ++attempt) {
    at.restart_count = attempt;
    const int failure = run_once(at, token).failed;
    // Forwarded to every rank; reported as the launcher's own end.
    if (const int sig = stop_signal()) return report_stop_signal(sig);
    if (failure < 0) return 0;
    report_failure(failure);
    if (attempt >= o_.max_restarts) return 1;
    std::fprintf(stderr, "tdist-run: restarting all ranks (restart %d of %d)\n", attempt + 1, o_.max_restarts);
  }
}

std::string Supervisor::report_failure(int failure) const {
  const Child& f = kids_[failure];
  const std::string first = "rank " + std::to_string(f.rank) + " (pid " + std::to_string(f.pid) + ") failed first: " +
                            describe(f.status);
  std::fprintf(stderr, "tdist-run: %s\n", first.c_str());
  for (const auto& k : kids_) {
    if (&k != &f) std::fprintf(stderr, "tdist-run:   rank %d: %s\n", k.rank, describe(k.status).c_str());
  }
  return first;
}

void Supervisor::set_rank_env(int rank, int local_rank, const Placement& at, const TokenPlan& token) const {
  auto set = [](const char* k, const std::string& v) { setenv(k, v.c_str(), 1); };
  set("RANK", std::to_string(rank));
  set("LOCAL_RANK", std::to_string(local_rank));
  set("WORLD_SIZE", std::to_string(at.world));
  set("LOCAL_WORLD_SIZE", std::to_string(o_.nproc));
  set("GROUP_RANK", std::to_string(at.group_rank));
  set("GROUP_WORLD_SIZE", std::to_string(at.group_world));
  set("MASTER_ADDR", at.master_addr);
  set("MASTER_PORT", std::to_string(at.master_port));
  // torchrun's names: how many times the job was restarted so far, and may be.
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(at.restart_count));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(o_.max_restarts));
  if (token.kind == TokenPlan::kGiven || token.kind == TokenPlan::kGenerate) {
    set("TDIST_STORE_TOKEN", token.token);
    unsetenv("TDIST_STORE_TOKEN_FILE");
  } else if (token.kind == TokenPlan::kNone) {
    unsetenv("TDIST_STORE_TOKEN");
    unsetenv("TDIST_STORE_TOKEN_FILE");
  }
  if (output_.tty()) set("TDIST_TTY", "1");  // a rank's progress line may redraw in place
  if (!heartbeat_dir_.empty()) set("TDIST_HEARTBEAT_DIR", heartbeat_dir_);
  if (!std::getenv("OMP_NUM_THREADS")) {
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    set("OMP_NUM_THREADS", std::to_string(std::max<long>(1, cores / o_.nproc)));
  }
}

Child Supervisor::spawn(int local_rank, const Placement& at, const TokenPlan& token) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    std::perror("tdist-run: pipe");
    std::exit(1);
  }
  Child c;
  c.rank = at.first_rank + local_rank;
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    std::perror("tdist-run: fork");
    std::exit(1);
  }
  if (pid == 0) {
    // Die with the launcher. If it died before prctl took effect, this
    // process was already handed to another parent: leave at once.
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != launcher) _exit(1);
    setpgid(0, 0);  // the rank and everything it starts form one group
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    set_rank_env(c.rank, local_rank, at, token);
    std::vector<char*> args;
    for (const auto& a : o_.argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    std::fprintf(stderr, "tdist-run: cannot run '%s': %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);  // also here: no race with the child's own call
  guardian_.started(pid);
  close(fds[1]);
  c.pid = pid;
  c.out_fd = fds[0];
  return c;
}

}  // namespace tdist_run
