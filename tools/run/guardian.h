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
//
// Owns: the guardian process and the launcher's end of the socket to it.
// Needs: fork, before any thread; every rank in a process group of its
// own (run/supervisor.cpp starts them so). Threading: the launcher's loop
// only.
#pragma once

#include <sys/types.h>

namespace tdist_run {

class Guardian {
 public:
  Guardian() = default;  // not started: tells nobody
  ~Guardian();
  Guardian(const Guardian&) = delete;
  Guardian& operator=(const Guardian&) = delete;

  // Forks the guardian (the launcher exits when it cannot). Call before the
  // first rank starts, and after any other process the launcher forks to
  // keep (the elastic store's host): a process forked later would hold the
  // socket open, and the guardian would never see the launcher's end.
  void start();

  // A rank started (its pid leads its process group), or was reaped (its
  // pid may be another process's soon: the guardian must forget it).
  void started(pid_t rank) { tell('+', rank); }
  void reaped(pid_t rank) { tell('-', rank); }

 private:
  void tell(char what, pid_t pid);

  int fd_ = -1;  // the launcher's end; -1: not started
};

}  // namespace tdist_run
