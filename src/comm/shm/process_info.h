// What the kernel says about another process on this host: whether it
// exists, and when it started (to tell a process from a later one that got
// its pid). Used to find stale segments and dead peers.
//
// Contract: plain functions, thread-safe, non-blocking (they read
// /proc/<pid>/stat and call kill(pid, 0)); they never throw for a missing
// process.
#pragma once

#include <cstdint>

namespace tdist::comm::shm {

// Process start time (clock ticks since boot), field 22 of /proc/<pid>/stat;
// 0 if the process does not exist or is a zombie.
uint64_t process_start_time(int pid);

// False only when kill(pid, 0) says there is no such process.
bool pid_alive(int pid);

}  // namespace tdist::comm::shm
