// The number a process group gave the op this thread is running: the one
// sequence number of an op everywhere a user sees one (Work::seq, the
// errors a backend raises, the flight recorder's collective_seq_id /
// p2p_seq_id, tdist-trace and tdist-run's stall report). A group numbers
// its collectives 1, 2, 3, ... and its send/recv apart (they are not
// symmetric across ranks), at enqueue; the thread that runs the op holds
// the number in an OpLabelScope while it runs, so that a backend naming
// the op in an error ("all_reduce #13 timed out") names it as the group
// does, whatever it counts internally (the shm backend splits a large op
// into pieces, each an op of its own protocol).
//
// Defined in libtdist (op_label.cpp), so the backend plugins read the same
// thread-local variable as the group that set it.
#pragma once

#include <cstdint>

namespace tdist::comm {

// The running op's number on this thread; 0 when no group op runs here
// (a backend used directly, as its own tests do).
uint64_t current_op_label();

// `fallback` when no group op runs on this thread: a backend's own count
// (from 1) stands in.
inline uint64_t op_label_or(uint64_t fallback) {
  const uint64_t l = current_op_label();
  return l != 0 ? l : fallback;
}

// Sets this thread's op number for its lifetime (restoring the one before:
// scopes nest).
class OpLabelScope {
 public:
  explicit OpLabelScope(uint64_t label);
  ~OpLabelScope();
  OpLabelScope(const OpLabelScope&) = delete;
  OpLabelScope& operator=(const OpLabelScope&) = delete;

 private:
  uint64_t saved_;
};

}  // namespace tdist::comm
