// The flight recorder's dumper thread: a dump on SIGUSR1, and under
// tdist-run this rank's heartbeat file.
//
// SIGUSR1: the handler writes one byte to a non-blocking pipe (async-
// signal-safe; nothing else); the thread, blocked in poll on the pipe,
// writes the dump. The handler is installed only when SIGUSR1 still has
// its default action (which would kill the process): a program's own
// handler is left alone.
//
// Heartbeat ($TDIST_HEARTBEAT_DIR, set by tdist-run): every second the
// thread replaces <dir>/rank-<R> (written aside, renamed) with one line
// that tdist-run's stall detector and --status-interval read:
//
//   tdist-heartbeat 1 rank=R pid=P now_ns=T steps=S completed=C
//     last_completed_ns=L dumps=D last_op=OP#SEQ@GROUP
//     pending_op=OP#SEQ@GROUP pending_state=scheduled|started
//     pending_since_ns=T0 pending_timeout_ms=MS
//
// (last_op/pending_* are "-" when there is none; pending is the oldest op
// not yet completed; group names have blanks replaced by '_'). The file is
// written only while SIGUSR1 runs this file's handler (checked before
// every write; removed once it does not), and tdist-run signals only ranks
// with a fresh heartbeat that its /proc status says catch SIGUSR1: a
// signal that would kill a rank, or run a handler of the program's, is
// not sent.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "trace/flight_recorder.h"
#include "util/write_aside.h"

namespace tdist::detail {

namespace {

int g_pipe[2] = {-1, -1};

void on_sigusr1(int) {
  const int saved = errno;
  const char byte = 1;
  const ssize_t n = ::write(g_pipe[1], &byte, 1);  // a full pipe already holds a request
  (void)n;
  errno = saved;
}

std::string op_tag(const FrRecord& r) {
  std::string name = r.group ? r.group->name : "?";
  for (auto& c : name) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '=') c = '_';
  }
  return std::string(r.op.name) + "#" + std::to_string(r.seq) + "@" + name;
}

std::string heartbeat_line(const FlightRecorder& fr) {
  const auto records = fr.snapshot();
  const FrRecord* last = nullptr;
  const FrRecord* pending = nullptr;
  for (const auto& r : records) {
    if (r.state == FrState::kCompleted) {
      if (!last || r.completed_ns >= last->completed_ns) last = &r;
    } else if (r.state != FrState::kFailed && !pending) {
      pending = &r;
    }
  }
  std::string s = "tdist-heartbeat 1 rank=" + std::to_string(fr.rank()) + " pid=" + std::to_string(getpid()) +
                  " now_ns=" + std::to_string(fr_now_ns()) + " steps=" + std::to_string(fr.steps()) +
                  " completed=" + std::to_string(fr.completed_ops()) +
                  " last_completed_ns=" + std::to_string(fr.last_completed_ns()) +
                  " dumps=" + std::to_string(fr.dumps()) + " last_op=" + (last ? op_tag(*last) : "-");
  if (pending) {
    s += " pending_op=" + op_tag(*pending) +
         " pending_state=" + (pending->state == FrState::kStarted ? "started" : "scheduled") +
         " pending_since_ns=" + std::to_string(pending->created_ns) +
         " pending_timeout_ms=" + std::to_string(pending->op.timeout_ms);
  } else {
    s += " pending_op=- pending_state=- pending_since_ns=0 pending_timeout_ms=0";
  }
  return s + "\n";
}

// Whether SIGUSR1 still runs this file's handler (the program, or a
// library, may have set its own or the default since).
bool handler_in_place() {
  struct sigaction cur {};
  return ::sigaction(SIGUSR1, nullptr, &cur) == 0 && !(cur.sa_flags & SA_SIGINFO) && cur.sa_handler == on_sigusr1;
}

void write_heartbeat(const std::string& dir, const FlightRecorder& fr) {
  const int rank = fr.rank();
  if (rank < 0) return;  // not known until init_process_group has made the world group
  const std::string path = dir + "/rank-" + std::to_string(rank);
  if (!handler_in_place()) {
    // SIGUSR1 is no longer ours: no heartbeat, so tdist-run never sends it.
    ::unlink(path.c_str());
    return;
  }
  std::string error;
  (void)write_aside(path, heartbeat_line(fr), error);  // tdist-run went away with its directory: nothing to tell
}

void run_dumper(FlightRecorder* fr, std::string heartbeat_dir) {
  for (;;) {
    struct pollfd p {};
    p.fd = g_pipe[0];
    p.events = POLLIN;
    const int n = ::poll(&p, 1, heartbeat_dir.empty() ? -1 : 1000);
    if (n > 0 && (p.revents & POLLIN)) {
      char buf[64];
      while (::read(g_pipe[0], buf, sizeof buf) > 0) {
      }
      fr->dump(DumpReason::kSignal);
    } else if (n < 0 && errno != EINTR) {
      return;
    }
    if (!heartbeat_dir.empty()) write_heartbeat(heartbeat_dir, *fr);
  }
}

}  // namespace

void start_dumper(FlightRecorder& fr) {
  static std::once_flag once;
  std::call_once(once, [&fr] {
    if (::pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      std::fprintf(stderr, "tdist: the flight recorder cannot dump on SIGUSR1 (pipe: %s)\n", std::strerror(errno));
      return;
    }
    struct sigaction old {};
    bool installed = false;
    if (::sigaction(SIGUSR1, nullptr, &old) == 0 && old.sa_handler == SIG_DFL && !(old.sa_flags & SA_SIGINFO)) {
      struct sigaction sa {};
      sa.sa_handler = on_sigusr1;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = SA_RESTART;
      installed = ::sigaction(SIGUSR1, &sa, nullptr) == 0;
    }
    const char* hb = std::getenv("TDIST_HEARTBEAT_DIR");
    // Without the handler tdist-run must not signal this rank: no heartbeat.
    std::string dir = installed && hb && *hb ? hb : "";
    if (!installed && dir.empty()) return;
    std::thread(run_dumper, &fr, std::move(dir)).detach();
  });
}

}  // namespace tdist::detail
