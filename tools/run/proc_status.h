// What /proc/PID/stat says of one of the launcher's processes: its state,
// whether it is on its way out. Each call reads afresh. (Whether a rank
// catches SIGUSR1, from /proc/PID/status, is run/health_watch's.)
//
// Owns nothing. Needs Linux's /proc.
// Threading: any.
#pragma once

#include <sys/types.h>

namespace tdist_run {

// The state letter of /proc/PID/stat ('R', 'S', 'Z', 'X', ...); 0 when it
// cannot be read (the process is gone), '?' when it is not where expected.
char proc_state(pid_t pid);

// Whether a process is on its way out (PF_EXITING in /proc/PID/stat's
// flags, or already a zombie) but not yet reaped.
bool is_exiting(pid_t pid);

}  // namespace tdist_run
