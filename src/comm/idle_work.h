// Work this process runs at idle priority (SCHED_IDLE) beside training: a
// Checkpointer's asynchronous writer. While any runs, waiting ranks must
// not poll with sched_yield(): a yield hands the core to the idle thread
// for a whole scheduler slice (measured on the 2-vCPU VM with one busy
// SCHED_IDLE thread on the core: 157 us a yield on average, up to 6 ms,
// against 6 us), so every collective wait would cost training that much.
// The shm backend's waits then spin briefly and sleep instead (waiter.h):
// the publisher's wake-up preempts an idle thread at once.
//
// Defined in libtdist (idle_work.cpp): one count for the process, the
// backend plugins included. Threading: any thread.
#pragma once

#include <atomic>

namespace tdist::comm {

// How many IdleWorkScopes live in this process.
std::atomic<int>& idle_work_count();

inline bool idle_work_running() { return idle_work_count().load(std::memory_order_relaxed) > 0; }

// Counts idle-priority work for its lifetime (on the idle thread itself, or
// on whoever starts and joins it).
class IdleWorkScope {
 public:
  IdleWorkScope() { idle_work_count().fetch_add(1, std::memory_order_relaxed); }
  ~IdleWorkScope() { idle_work_count().fetch_sub(1, std::memory_order_relaxed); }
  IdleWorkScope(const IdleWorkScope&) = delete;
  IdleWorkScope& operator=(const IdleWorkScope&) = delete;
};

}  // namespace tdist::comm
