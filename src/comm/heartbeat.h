// Heartbeat: liveness and progress of a group's ranks, through the store.
//
// Backends without a shared segment (gloo, mpi) use it to say which ranks a
// timed-out op was waiting for and which ranks died. Every rank's thread
// writes "hb/<rank>" = "<beats>:<ops started>" every 250 ms. The thread owns
// its state through a shared_ptr, so a store call blocked on a dead server
// never holds up the backend's destruction.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "tdist/store.h"

namespace tdist::comm {

class Heartbeat {
 public:
  Heartbeat(std::shared_ptr<Store> store, int rank, int size, std::vector<int> global_ranks);
  ~Heartbeat();  // stops the thread, waiting at most a second for it
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // Publishes how many ops this rank has started (with the next beat).
  void set_ops_started(uint64_t n);
  // "rank(s) 1, 3 never arrived": the ranks that had not started op `seq`.
  std::string missing_ranks(uint64_t seq);
  // Group ranks (other than this one) whose heartbeat stops advancing over
  // about a second; group rank 0 if the store itself is unreachable.
  std::vector<int> dead_ranks();
  // World-rank list for messages: "rank 2" or "ranks 2, 3".
  std::string describe(const std::vector<int>& group_ranks) const;

 private:
  struct State;
  std::vector<std::pair<int64_t, int64_t>> read();
  std::string names(const std::vector<int>& group_ranks) const;  // "2, 3" as world ranks

  std::shared_ptr<State> state_;
  std::future<void> exited_;
  int rank_;
  int size_;
  std::vector<int> global_ranks_;
};

}  // namespace tdist::comm
