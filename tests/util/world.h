// Runs a function on N real processes that form one process group.
#pragma once

#include <sys/types.h>

#include <functional>
#include <vector>
#include <sstream>
#include <stdexcept>
#include <string>

#include "tdist/process_group.h"

namespace tdist::test {

struct WorldOptions {
  std::string backend = "shm";
  std::chrono::milliseconds limit{120'000};  // whole run; children are killed past it
  std::chrono::milliseconds timeout{60'000}; // the group's collective timeout
  bool final_barrier = true;                 // keep rank 0 (the store) alive until all are done
  std::vector<pid_t>* pids = nullptr;        // if set, receives the ranks' process ids
};

// Forks `world` processes; each joins a group through a fresh TCP store and
// runs fn(group). Returns one line per failed rank ("rank R: ..."), empty when
// every rank exited 0.
std::string run_world(int world, const std::function<void(ProcessGroup&)>& fn, const WorldOptions& options = {});

// Inside a child: throws with file:line when cond is false.
#define WORLD_CHECK(cond, msg)                                                                           \
  do {                                                                                                   \
    if (!(cond)) {                                                                                       \
      std::ostringstream os_;                                                                            \
      os_ << __FILE__ << ":" << __LINE__ << ": check failed: " #cond ": " << msg;                       \
      throw std::runtime_error(os_.str());                                                               \
    }                                                                                                    \
  } while (0)

}  // namespace tdist::test
