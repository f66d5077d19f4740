// Test helpers for real processes: fork a child running a function, wait for
// it with a timeout (killing it past that), run a shell command and capture
// its output. Nothing here may hang: every wait has a deadline.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace tdist::test {

// Forks; the child runs fn and exits with its return value (an exception
// escaping fn prints it and exits 99). Returns the child's pid.
pid_t fork_child(const std::function<int()>& fn);

// Waits for pid; returns its raw wait status, or -1 if it was still running
// after timeout (it is then killed with SIGKILL and reaped).
int wait_child(pid_t pid, std::chrono::milliseconds timeout);

// True when a wait status means "exited with code 0".
bool exited_ok(int status);
std::string describe_status(int status);

struct CommandResult {
  int status = -1;     // raw wait status; -1: timed out and killed
  std::string output;  // stdout and stderr together
};

// Runs `sh -c command`, capturing its output, killing it (and its process
// group) past timeout.
CommandResult run_command(const std::string& command, std::chrono::milliseconds timeout);

// The whole file at path ("" when it cannot be read).
std::string read_all(const std::string& path);

// The processes whose parent is `parent` and whose name (/proc's comm) is `comm`.
std::vector<pid_t> children_named(pid_t parent, const std::string& comm);

// A fresh directory under /tmp, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace tdist::test
