#include "run/proc_status.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace tdist_run {

namespace {

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

}  // namespace

char proc_state(pid_t pid) {
  char buf[1024];
  const char* p = proc_stat_fields(pid, buf);
  if (!p) return 0;
  return p[1] == ' ' && p[2] != '\0' ? p[2] : '?';
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

}  // namespace tdist_run
