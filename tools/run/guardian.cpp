#include "run/guardian.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>

#include "run/proc_status.h"
#include "util/env.h"

namespace tdist_run {

namespace {

// Whether `pid` holds nothing any more: gone, or a zombie.
bool gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  const char state = proc_state(pid);
  return state == 0 || state == 'Z' || state == 'X';
}

// The ranks the launcher started and did not reap, read from `fd` until
// its end of file (the launcher is gone).
std::set<pid_t> read_ranks(int fd) {
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
  return ranks;
}

// Removes the /dev/shm segments that `ranks` created; how many.
int remove_segments(const std::set<pid_t>& ranks) {
  int removed = 0;
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  const std::string prefix = "tdist-shm-";
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const auto pid = tdist::detail::parse_int(name.substr(prefix.size(), name.find('-', prefix.size()) - prefix.size()));
    if (pid && ranks.count(static_cast<pid_t>(*pid)) && shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

[[noreturn]] void run_guardian(int fd) {
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE}) signal(sig, SIG_IGN);
  prctl(PR_SET_NAME, "tdist-run-guard");
  const std::set<pid_t> ranks = read_ranks(fd);
  if (ranks.empty()) _exit(0);  // the launcher ended normally
  for (pid_t pid : ranks) {
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < until && !std::all_of(ranks.begin(), ranks.end(), gone)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int removed = remove_segments(ranks);
  std::fprintf(stderr, "tdist-run: the launcher died; its %zu remaining rank(s) were killed%s\n", ranks.size(),
               removed ? (" and " + std::to_string(removed) + " shared-memory segment(s) they left removed").c_str()
                       : "");
  _exit(1);
}

}  // namespace

Guardian::~Guardian() {
  if (fd_ >= 0) close(fd_);  // end of file, no rank left: the guardian exits quietly
}

void Guardian::start() {
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
  fd_ = sv[0];
}

void Guardian::tell(char what, pid_t pid) {
  if (fd_ < 0) return;
  char line[32];
  const int n = std::snprintf(line, sizeof line, "%c%d\n", what, static_cast<int>(pid));
  // Short and atomic; MSG_NOSIGNAL: a guardian killed by someone is no reason to die.
  while (send(fd_, line, static_cast<size_t>(n), MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

}  // namespace tdist_run
