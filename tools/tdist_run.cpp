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
// its parent-death signal, and a guardian process (see run_guardian) that
// outlives a launcher killed with SIGKILL then kills what the ranks started
// (their process groups) and removes the shared memory they left.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "run/elastic_agent.h"
#include "run/health_watch.h"
#include "run/launch_options.h"
#include "store/auth.h"
#include "store/socket.h"
#include "util/cli.h"
#include "util/env.h"

namespace {

using tdist_run::Options;
using tdist_run::TokenPlan;
using tdist_run::usage;
using tdist_run::parse;
using tdist_run::plan_token;

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;      // merged stdout+stderr
  std::string partial;  // output not yet ended by a newline
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

// A rank's output, line by line, each led by "[rank N]: ". A line a rank
// redraws in place ("\r", a progress line) is shown in place too when this
// launcher writes to a terminal (the ranks are told so by TDIST_TTY=1);
// elsewhere only what a terminal would finally show of each line is kept.
bool g_tty = false;
// The ranks' heartbeats (TDIST_HEARTBEAT_DIR) and their watcher; none when
// the directory could not be made.
std::string g_heartbeat_dir;
tdist_run::HealthWatch* g_health = nullptr;
const Child* g_open_line = nullptr;  // whose in-place line is on the screen

// What a terminal would show of s[from, to): the text after the last '\r'
// that has text after it (trailing '\r's, as in "\r\n" or "50%\r", end a
// text rather than start one). Its start is returned in `start`.
std::string_view on_screen(const std::string& s, size_t from, size_t to, size_t* start = nullptr) {
  while (to > from && s[to - 1] == '\r') --to;
  size_t b = from;
  for (size_t i = to; i > from; --i) {
    if (s[i - 1] == '\r') {
      b = i;
      break;
    }
  }
  if (start) *start = b;
  return std::string_view(s).substr(b, to - b);
}

void emit(Child& c, const char* data, size_t n, bool final) {
  c.partial.append(data, n);
  size_t start = 0;
  auto line = [&](size_t from, size_t to) {
    const std::string_view text = on_screen(c.partial, from, to);
    if (g_open_line) std::printf(g_open_line == &c ? "\r\033[K" : "\n");
    g_open_line = nullptr;
    std::printf("[rank %d]: %.*s\n", c.rank, static_cast<int>(text.size()), text.data());
  };
  for (;;) {
    size_t nl = c.partial.find('\n', start);
    if (nl == std::string::npos) break;
    line(start, nl);
    start = nl + 1;
  }
  c.partial.erase(0, start);
  // A rank's line that never ends is shown in pieces of kMaxLine bytes: the
  // launcher holds no more than that per rank, whatever the rank prints.
  constexpr size_t kMaxLine = size_t(1) << 20;
  if (!final && c.partial.size() > kMaxLine) {
    line(0, c.partial.size());
    c.partial.clear();
  }
  if (final && !c.partial.empty()) {
    line(0, c.partial.size());
    c.partial.clear();
  } else if (g_tty && c.partial.find('\r') != std::string::npos) {
    size_t b = 0;
    const std::string_view text = on_screen(c.partial, 0, c.partial.size(), &b);
    if (g_open_line && g_open_line != &c) std::printf("\n");
    std::printf("\r[rank %d]: %.*s\033[K", c.rank, static_cast<int>(text.size()), text.data());
    g_open_line = &c;
    if (b > 0) c.partial.erase(0, b - 1);  // from the '\r' before the text: the line is still being redrawn
  }
  std::fflush(stdout);
}

// Whether a child is on its way out (PF_EXITING in /proc/PID/stat's flags,
// or already a zombie) but not yet reaped.
// /proc/PID/stat from just after the command name (which may hold
// anything) into buf: ") S ppid ...". nullptr when it cannot be read (the
// process is gone).
const char* proc_stat_fields(pid_t pid, char (&buf)[1024]) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  const ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return nullptr;
  buf[n] = '\0';
  return std::strrchr(buf, ')');
}

bool is_exiting(pid_t pid) {
  char buf[1024];
  const char* p = proc_stat_fields(pid, buf);
  if (!p) return false;
  char state = 0;
  unsigned long flags = 0;
  // state ppid pgrp session tty_nr tpgid flags
  if (std::sscanf(p + 1, " %c %*d %*d %*d %*d %*d %lu", &state, &flags) != 2) return false;
  constexpr unsigned long kPfExiting = 0x4;
  return state == 'Z' || state == 'X' || (flags & kPfExiting) != 0;
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "status " + std::to_string(status);
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// Which rank failed first. A rank that dies is on its way out (PF_EXITING)
// before its sockets close, so before any peer can notice and fail in turn;
// the loop stamps every rank seen on its way out with the pass that saw it,
// so the rank that failed first has the earliest pass. Within one pass
// (peers that noticed at once), a rank killed by a signal nobody here sent
// goes first (SIGKILL before other signals: a crash or kill -9 from outside
// is the cause, an abort the consequence), then a failing exit code; ranks
// that failed after the launcher signaled them come last. -1: none failed.
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

// The guardian: a process forked before the first rank that outlives a
// launcher killed with SIGKILL (which no handler sees). The launcher
// writes "+PID\n" for every rank it starts and "-PID\n" for every rank it
// reaps to a socket only it holds (close-on-exec, so not the ranks). End of
// file means the launcher is gone: the guardian sends SIGKILL to the process
// group of every rank not reaped (the ranks already got it as their
// parent-death signal; what they started did not), waits up to 5 s for them
// to be gone, removes the /dev/shm segments they created (named
// tdist-shm-<creator pid>-..., see src/comm/shm/segment.h) and exits. It
// ignores the terminal's signals so that a Ctrl-C cannot stop it first.
int g_guardian_fd = -1;

void tell_guardian(char what, pid_t pid) {
  if (g_guardian_fd < 0) return;
  char line[32];
  const int n = std::snprintf(line, sizeof line, "%c%d\n", what, static_cast<int>(pid));
  // Short and atomic; MSG_NOSIGNAL: a guardian killed by someone is no reason to die.
  while (send(g_guardian_fd, line, static_cast<size_t>(n), MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

bool gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char buf[1024];
  const char* p = proc_stat_fields(pid, buf);
  if (!p) return true;
  return p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');  // a zombie holds nothing
}

[[noreturn]] void run_guardian(int fd) {
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE}) signal(sig, SIG_IGN);
  prctl(PR_SET_NAME, "tdist-run-guard");
  std::set<pid_t> ranks;
  std::string pending;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buf, static_cast<size_t>(n));
    size_t nl;
    while ((nl = pending.find('\n')) != std::string::npos) {
      const auto pid = tdist::detail::parse_int(pending.substr(1, nl - 1));
      if (pid && *pid > 0 && pending[0] == '+') ranks.insert(static_cast<pid_t>(*pid));
      if (pid && *pid > 0 && pending[0] == '-') ranks.erase(static_cast<pid_t>(*pid));
      pending.erase(0, nl + 1);
    }
  }
  if (ranks.empty()) _exit(0);  // the launcher ended normally
  for (pid_t pid : ranks) {
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < until &&
         !std::all_of(ranks.begin(), ranks.end(), [](pid_t p) { return gone(p); })) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  int removed = 0;
  if (DIR* dir = opendir("/dev/shm")) {
    const std::string prefix = "tdist-shm-";
    while (dirent* e = readdir(dir)) {
      const std::string name = e->d_name;
      if (name.compare(0, prefix.size(), prefix) != 0) continue;
      const auto pid = tdist::detail::parse_int(name.substr(prefix.size(), name.find('-', prefix.size()) - prefix.size()));
      if (pid && ranks.count(static_cast<pid_t>(*pid)) && shm_unlink(("/" + name).c_str()) == 0) ++removed;
    }
    closedir(dir);
  }
  std::fprintf(stderr, "tdist-run: the launcher died; its %zu remaining rank(s) were killed%s\n", ranks.size(),
               removed ? (" and " + std::to_string(removed) + " shared-memory segment(s) they left removed").c_str()
                       : "");
  _exit(1);
}

// Starts the guardian; the launcher keeps the writing end.
void start_guardian() {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    std::perror("tdist-run: socketpair");
    std::exit(1);
  }
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    std::perror("tdist-run: fork");
    std::exit(1);
  }
  if (pid == 0) {
    close(sv[0]);
    const int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) {
      dup2(null, 0);
      dup2(null, 1);  // not the launcher's stdout: whoever reads it sees its end with the launcher's
    }
    run_guardian(sv[1]);
  }
  close(sv[1]);
  g_guardian_fd = sv[0];
}

Child spawn(const Options& o, int local_rank, const Placement& at, const TokenPlan& token) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    std::perror("tdist-run: pipe");
    std::exit(1);
  }
  Child c;
  c.rank = at.first_rank + local_rank;
  const pid_t launcher = getpid();
  pid_t pid = fork();
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
    auto set = [](const char* k, const std::string& v) { setenv(k, v.c_str(), 1); };
    set("RANK", std::to_string(c.rank));
    set("LOCAL_RANK", std::to_string(local_rank));
    set("WORLD_SIZE", std::to_string(at.world));
    set("LOCAL_WORLD_SIZE", std::to_string(o.nproc));
    set("GROUP_RANK", std::to_string(at.group_rank));
    set("GROUP_WORLD_SIZE", std::to_string(at.group_world));
    set("MASTER_ADDR", at.master_addr);
    set("MASTER_PORT", std::to_string(at.master_port));
    // torchrun's names: how many times the job was restarted so far, and may be.
    set("TORCHELASTIC_RESTART_COUNT", std::to_string(at.restart_count));
    set("TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts));
    if (token.kind == TokenPlan::kGiven || token.kind == TokenPlan::kGenerate) {
      set("TDIST_STORE_TOKEN", token.token);
      unsetenv("TDIST_STORE_TOKEN_FILE");
    } else if (token.kind == TokenPlan::kNone) {
      unsetenv("TDIST_STORE_TOKEN");
      unsetenv("TDIST_STORE_TOKEN_FILE");
    }
    if (g_tty) set("TDIST_TTY", "1");  // a rank's progress line may redraw in place
    if (!g_heartbeat_dir.empty()) set("TDIST_HEARTBEAT_DIR", g_heartbeat_dir);
    if (!std::getenv("OMP_NUM_THREADS")) {
      long cores = sysconf(_SC_NPROCESSORS_ONLN);
      set("OMP_NUM_THREADS", std::to_string(std::max<long>(1, cores / o.nproc)));
    }
    std::vector<char*> args;
    for (const auto& a : o.argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    std::fprintf(stderr, "tdist-run: cannot run '%s': %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);  // also here: no race with the child's own call
  tell_guardian('+', pid);
  close(fds[1]);
  c.pid = pid;
  c.out_fd = fds[0];
  return c;
}

// Signals a rank's whole process group (it may have started children).
// A rank already on its way out is not ended by it: it keeps its place in
// first_failed's order.
void signal_rank(Child& c, int sig) {
  if (c.dead_pass == 0) c.signaled_by_launcher = true;
  if (kill(-c.pid, sig) != 0) kill(c.pid, sig);
}

// How a start of the job ended on this node.
struct Outcome {
  int failed = -1;  // the first rank that failed on its own; -1: none
  // Elastic: why this node's ranks were stopped from outside (another
  // node's failure, a membership change, an abort), when they were.
  std::optional<tdist_run::StopRequest> stopped;
};

// Asked every ~200 ms while ranks run: a reason to stop them (elastic).
using StopCheck = std::function<std::optional<tdist_run::StopRequest>()>;

// Runs one generation of the job on this node.
Outcome run_once(const Options& o, const Placement& at, TokenPlan token, std::vector<Child>& kids,
                 const StopCheck& stop_check = {}) {
  kids.clear();
  g_open_line = nullptr;
  Outcome out;
  // A fresh token per start: ranks left over from an earlier start cannot
  // join this one.
  if (token.kind == TokenPlan::kGenerate) token.token = tdist::detail::generate_token();
  if (g_health) g_health->reset();  // before the ranks start writing heartbeats
  for (int r = 0; r < o.nproc; ++r) kids.push_back(spawn(o, r, at, token));
  auto next_check = std::chrono::steady_clock::now();
  bool any_failed = false;  // the ranks left get peer_wait_s, then SIGTERM
  uint64_t pass = 0;        // loop passes, for Child::dead_pass
  bool terminating = false;
  std::chrono::steady_clock::time_point kill_at{}, term_at{};
  size_t open_pipes = kids.size();
  size_t running = kids.size();
  // After the last rank exits, its output pipe may still be held open by a
  // child it left behind: drain briefly, then stop listening.
  std::chrono::steady_clock::time_point drain_until{};
  while (running > 0 || (open_pipes > 0 && std::chrono::steady_clock::now() < drain_until)) {
    if (g_signal && !terminating) {
      for (auto& k : kids) if (!k.exited) signal_rank(k, g_signal);
      terminating = true;
      kill_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.grace_s * 1000));
    }
    // Elastic: asked every 200 ms while ranks run or are being stopped (it
    // also tells the other nodes this one is alive); acted on once.
    if (stop_check && running > 0 && std::chrono::steady_clock::now() >= next_check) {
      next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
      auto stop = stop_check();
      if (stop && !terminating && !any_failed && !out.stopped) {
        out.stopped = std::move(stop);
        for (auto& k : kids) if (!k.exited) signal_rank(k, SIGTERM);
        terminating = true;
        kill_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.grace_s * 1000));
      }
    }
    std::vector<pollfd> pfds;
    std::vector<Child*> owners;
    for (auto& k : kids) {
      if (k.out_fd >= 0) {
        pfds.push_back({k.out_fd, POLLIN, 0});
        owners.push_back(&k);
      }
    }
    int rc = poll(pfds.data(), pfds.size(), 50);
    if (rc > 0) {
      for (size_t i = 0; i < pfds.size(); ++i) {
        if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        char buf[65536];
        ssize_t n = read(pfds[i].fd, buf, sizeof buf);
        if (n > 0) {
          emit(*owners[i], buf, static_cast<size_t>(n), false);
        } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
          emit(*owners[i], "", 0, true);
          close(owners[i]->out_fd);
          owners[i]->out_fd = -1;
          --open_pipes;
        }
      }
    }
    // Reap, and stamp each rank with the pass that first saw it on its way
    // out (see first_failed). Once a rank has failed, the others are looked
    // at in /proc too, twice when this pass saw a new one, so that a rank
    // whose death a peer noticed is stamped no later than that peer.
    ++pass;
    bool stamped = false;
    for (auto& k : kids) {
      if (k.exited) continue;
      int status = 0;
      if (waitpid(k.pid, &status, WNOHANG) == k.pid) {
        k.exited = true;
        k.status = status;
        --running;
        // Reaped, its pid is free for another process: end what it left in
        // its group now (while the group holds the number) and take it off
        // the guardian's list, which must never name a pid not ours.
        kill(-k.pid, SIGKILL);
        tell_guardian('-', k.pid);
        if (k.dead_pass == 0) {
          k.dead_pass = pass;
          stamped = true;
        }
        if (failed(status) && !any_failed) {
          any_failed = true;
          term_at = std::chrono::steady_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(o.peer_wait_s * 1000));
        }
      }
    }
    for (int sweep = 0; any_failed && sweep < (stamped ? 2 : 1); ++sweep) {
      for (auto& k : kids) {
        if (!k.exited && k.dead_pass == 0 && is_exiting(k.pid)) {
          k.dead_pass = pass;
          stamped = true;
        }
      }
    }
    if (g_health && !terminating && running > 0) {
      std::vector<tdist_run::HealthWatch::Rank> ranks;
      for (const auto& k : kids) ranks.push_back({k.rank, k.exited ? 0 : k.pid});
      g_health->tick(ranks);
    }
    if (any_failed && !terminating && running > 0 && std::chrono::steady_clock::now() >= term_at) {
      for (auto& other : kids) if (!other.exited) signal_rank(other, SIGTERM);
      terminating = true;
      kill_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.grace_s * 1000));
    }
    if (running == 0 && drain_until == std::chrono::steady_clock::time_point{}) {
      drain_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    }
    if (terminating && std::chrono::steady_clock::now() >= kill_at) {
      for (auto& k : kids) if (!k.exited) signal_rank(k, SIGKILL);
    }
  }
  for (auto& k : kids) {
    if (k.out_fd >= 0) {
      emit(k, "", 0, true);
      close(k.out_fd);
      k.out_fd = -1;
    }
    // Every rank was reaped above, its group killed and its pid taken off
    // the guardian's list then (its number may belong to another process
    // by now: no signal goes to it here).
  }
  out.failed = first_failed(kids);
  // Ranks that failed only once stopped from outside did not fail on their own.
  if (out.stopped && out.failed >= 0 && kids[out.failed].signaled_by_launcher) out.failed = -1;
  return out;
}

// Prints how a start ended on this node: the first rank that failed, then the others.
std::string report_failure(const std::vector<Child>& kids, int failure) {
  const Child& f = kids[failure];
  const std::string first = "rank " + std::to_string(f.rank) + " (pid " + std::to_string(f.pid) + ") failed first: " +
                            describe(f.status);
  std::fprintf(stderr, "tdist-run: %s\n", first.c_str());
  for (const auto& k : kids) {
    if (&k != &f) std::fprintf(stderr, "tdist-run:   rank %d: %s\n", k.rank, describe(k.status).c_str());
  }
  return first;
}

// --nnodes MIN:MAX: rounds of the rendezvous, each a start of the job with
// whoever is there (see run/elastic_agent.h). Failures count against
// --max-restarts; nodes coming or going do not.
int run_elastic(const Options& o, TokenPlan token) {
  tdist_run::ElasticOptions eo;
  eo.min_nodes = o.min_nodes;
  eo.max_nodes = o.nnodes;
  eo.nproc = o.nproc;
  eo.endpoint_host = o.master_addr;
  eo.endpoint_port = o.master_port;
  eo.local_addr = o.local_addr;
  eo.run_id = o.rdzv_id;
  eo.join_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.join_timeout_s * 1000));
  eo.last_call = std::chrono::milliseconds(static_cast<int64_t>(o.last_call_s * 1000));
  try {
    switch (token.kind) {
      case TokenPlan::kGiven: eo.token = token.token; break;
      case TokenPlan::kKeep: eo.token = tdist::detail::resolve_token(std::nullopt); break;
      case TokenPlan::kNone: break;
      case TokenPlan::kGenerate:  // one node at most: its own secret, kept for every round
        eo.token = tdist::detail::generate_token();
        token = {TokenPlan::kGiven, eo.token};
        break;
    }
  } catch (const tdist::Error& e) {
    usage(e.what());
  }
  const auto interrupted = [] { return g_signal != 0; };
  std::unique_ptr<tdist_run::ElasticAgent> agent;
  try {
    agent = std::make_unique<tdist_run::ElasticAgent>(eo);  // before any other process or thread
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  start_guardian();
  std::fprintf(stderr, "tdist-run: %s the rendezvous at %s:%d (%d to %d nodes)\n",
               agent->hosts_store() ? "hosting" : "joined", o.master_addr.c_str(), o.master_port, o.min_nodes, o.nnodes);
  int restarts = 0;
  int last_world = 0;
  std::vector<Child> kids;
  try {
    for (;;) {
      const auto m = agent->rendezvous(interrupted);
      if (!m) {
        std::fprintf(stderr, "tdist-run: the job finished before this node could join it\n");
        return 0;
      }
      std::fprintf(stderr, "tdist-run: round %lld: node %d of %d, ranks %d to %d of a world of %d%s\n",
                   static_cast<long long>(m->round), m->node, m->nodes, m->first_rank, m->first_rank + o.nproc - 1,
                   m->world_size,
                   last_world && last_world != m->world_size
                       ? (" (was " + std::to_string(last_world) + ")").c_str()
                       : "");
      last_world = m->world_size;
      Placement at;
      at.first_rank = m->first_rank;
      at.world = m->world_size;
      at.group_rank = m->node;
      at.group_world = m->nodes;
      at.master_addr = m->master_addr;
      at.master_port = m->master_port;
      at.restart_count = restarts;
      const StopCheck check = [&]() -> std::optional<tdist_run::StopRequest> {
        try {
          return agent->poll();
        } catch (const std::exception& e) {
          return tdist_run::StopRequest{tdist_run::StopRequest::kAbort,
                                        std::string("the rendezvous store is gone: ") + e.what()};
        }
      };
      const Outcome r = run_once(o, at, token, kids, check);
      if (g_signal) {
        agent->request_restart("node " + std::to_string(m->node) + "'s launcher was stopped by signal " +
                               std::to_string(static_cast<int>(g_signal)));
        std::fprintf(stderr, "tdist-run: stopped by signal %d (%s), forwarded to every rank\n",
                     static_cast<int>(g_signal), strsignal(g_signal));
        return 128 + g_signal;
      }
      bool counts = false;  // a failure; nodes coming or going are none
      if (r.failed >= 0) {
        const std::string what = report_failure(kids, r.failed);
        agent->request_restart("node " + std::to_string(m->node) + ": " + what);
        counts = true;
      } else if (r.stopped) {
        std::fprintf(stderr, "tdist-run: this node's ranks were stopped: %s\n", r.stopped->why.c_str());
        if (r.stopped->kind == tdist_run::StopRequest::kAbort) return 1;
        counts = r.stopped->kind == tdist_run::StopRequest::kRestart;
      } else if (const auto again = agent->finish(interrupted)) {
        std::fprintf(stderr, "tdist-run: this node's ranks finished, but the job restarts: %s\n", again->why.c_str());
        counts = again->kind == tdist_run::StopRequest::kRestart;
      } else {
        return 0;
      }
      if (counts && restarts >= o.max_restarts) {
        const std::string why = "node " + std::to_string(m->node) + " is out of restarts (--max-restarts " +
                                std::to_string(o.max_restarts) + ")";
        std::fprintf(stderr, "tdist-run: %s; giving the job up\n", why.c_str());
        agent->abort(why);
        return 1;
      }
      if (counts) ++restarts;
      std::fprintf(stderr, "tdist-run: to the rendezvous again (restart %d of %d)\n", restarts, o.max_restarts);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return g_signal ? 128 + g_signal : 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  g_tty = isatty(1) == 1;
  setenv("TORCHELASTIC_RUN_ID", o.rdzv_id.c_str(), 1);  // torchrun's; the ranks' dump directory is named by it
  tdist_run::JobFiles files(o.rdzv_id);
  g_heartbeat_dir = files.heartbeat_dir();
  tdist_run::HealthOptions ho;
  ho.heartbeat_dir = files.heartbeat_dir();
  ho.dump_dir = files.dump_dir();
  ho.stall_s = o.stall_s;
  ho.status_interval_s = o.status_interval_s;
  ho.analyze_program = tdist_run::trace_program();
  tdist_run::HealthWatch health(std::move(ho));
  g_health = &health;
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  if (o.elastic) return run_elastic(o, plan_token(o));
  Placement at;
  at.first_rank = o.node_rank * o.nproc;
  at.world = o.nnodes * o.nproc;
  at.group_rank = o.node_rank;
  at.group_world = o.nnodes;
  at.master_addr = o.master_addr;
  at.master_port = o.master_port ? o.master_port : tdist::detail::find_free_port();
  const TokenPlan token = plan_token(o);
  start_guardian();
  std::vector<Child> kids;
  for (int attempt = 0;; ++attempt) {
    at.restart_count = attempt;
    const int failure = run_once(o, at, token, kids).failed;
    if (g_signal) {  // forwarded to every rank; report it as our own end
      std::fprintf(stderr, "tdist-run: stopped by signal %d (%s), forwarded to every rank\n", static_cast<int>(g_signal),
                   strsignal(g_signal));
      return 128 + g_signal;
    }
    if (failure < 0) return 0;
    report_failure(kids, failure);
    if (attempt >= o.max_restarts) return 1;
    std::fprintf(stderr, "tdist-run: restarting all ranks (restart %d of %d)\n", attempt + 1, o.max_restarts);
  }
}
