// Waiting for the other ranks of a group segment, and failing together.
//
// Contract:
// - One Waiter per rank and segment. wait_until, check_alive_state and fail
//   are called by one thread at a time (the backend's collective thread);
//   set_abort may be called from any thread, and notify from the thread
//   that just published something.
// - wait_until(ready, waiting_for, what, deadline) returns once ready()
//   holds. what() names the wait for an error (e.g. "all_reduce #7"); it
//   is called only when the wait fails, so a wait builds no string. It
//   polls: a pause loop for `spin` (at least 64 pauses), then
//   sched_yield() for `yield` (never past the deadline): ranks on their own
//   cores answer within microseconds, and a rank that shares its core hands
//   it over. (While idle-priority work runs in the process, a Checkpointer's
//   writer, it never yields, which would hand the core to that work for a
//   slice: it spins for at least kSpinBesideIdleWork, then sleeps; see
//   idle_work.h.) Then it sleeps on the header's futex word, which notify() (any
//   rank's) bumps when someone sleeps. A sleeper counts itself in
//   `sleepers` before it reads the word and looks at ready() a last time; a
//   publisher stores, then reads `sleepers`, all seq_cst: one of the two
//   sees the other, so no wake-up is lost, and while nobody sleeps a
//   notify() writes nothing shared. A sleeper wakes at least every 100 ms to
//   check that the ranks waiting_for() names are alive (/proc/<pid>/stat,
//   with the process start time against pid reuse) and to honour its
//   deadline.
// - ready() runs between polls and must read what others publish with
//   seq_cst loads; publishers store with seq_cst, then call notify().
// - Failures abort the whole group through the header's abort record, then
//   raise on this rank: TimeoutError past the deadline (naming the ranks
//   that never arrived), PeerFailureError for a dead peer, or the error of
//   whoever aborted first (check_alive_state: every rank raises the first
//   abort's kind and reason). The first set_abort wins the record; later
//   ones only wake the sleepers.
#pragma once

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <string>
#include <vector>

#include "comm/idle_work.h"
#include "comm/shm/segment.h"

namespace tdist::comm::shm {

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts);

// How long a wait spins before it sleeps while idle-priority work runs in
// the process (it then never yields; idle_work.h).
constexpr std::chrono::microseconds kSpinBesideIdleWork{20};

class Waiter {
 public:
  Waiter(const GroupSegment& segment, int rank, std::vector<int> global_ranks, std::chrono::microseconds spin,
         std::chrono::microseconds yield);

  int rank() const { return rank_; }
  int size() const { return seg_.size(); }
  // Rank r of the group as a world rank, for messages.
  int global(int r) const {
    return r >= 0 && r < static_cast<int>(global_ranks_.size()) ? global_ranks_[r] : r;
  }

  // Blocks until ready() or deadline. ready() is re-evaluated after every
  // wake-up; waiting_for() names the ranks that hold us up (for liveness
  // checks and the timeout message).
  template <typename Ready, typename Missing, typename What>
  void wait_until(Ready&& ready, Missing&& waiting_for, What&& what, Deadline lazy) {
    if (ready()) return;  // the others are there already: no clock read
    Header* h = seg_.header();
    const Deadline deadline = resolve_deadline(lazy);  // a synchronous op's first wait starts its timeout
    const auto start = Clock::now();
    // While idle-priority work runs in this process (idle_work.h), a yield
    // would hand the core to it for a whole slice: spin a little instead,
    // then sleep (a publisher's wake-up preempts the idle thread at once).
    const bool no_yield = idle_work_running();
    const auto spin_end = start + (no_yield ? std::max<std::chrono::microseconds>(spin_, kSpinBesideIdleWork) : spin_);
    const auto yield_end = no_yield ? spin_end : std::min<Clock::time_point>(spin_end + yield_, deadline);
    int polls = 0;
    while (true) {
      if (ready()) return;
      check_alive_state();
      if ((++polls & 63) == 0 && Clock::now() >= spin_end) break;
      _mm_pause();
    }
    while (Clock::now() < yield_end) {
      if (ready()) return;
      check_alive_state();
      sched_yield();
    }
    auto next_liveness = Clock::now();
    for (;;) {
      // Counted as a sleeper before the last look at ready(): see notify().
      // Every way out of this iteration (return, throw) uncounts it.
      Sleeping counted(h);
      const uint32_t w = h->wake.load();
      if (ready()) return;
      check_alive_state();
      const auto now = Clock::now();
      if (now >= next_liveness) {
        // A rank that passed this wait and exited before our snapshot of
        // the missing ranks was taken looks dead but is not missing: only
        // a dead rank that is still missing after the death is seen
        // fails the wait.
        int pid = 0;
        const int dead = find_dead(waiting_for(), &pid);
        if (dead >= 0) {
          if (ready()) return;
          const auto missing = waiting_for();
          if (std::find(missing.begin(), missing.end(), dead) != missing.end()) fail_dead(dead, pid, what());
        }
        next_liveness = now + std::chrono::milliseconds(100);
      }
      if (now >= deadline) {
        std::string ranks;
        for (int r : waiting_for()) ranks += (ranks.empty() ? "" : ", ") + std::to_string(global(r));
        fail(AbortKind::kTimeout, -1, what() + " timed out; rank(s) " + (ranks.empty() ? "?" : ranks) + " never arrived");
      }
      const auto slice = std::min<Clock::duration>(std::min(deadline, next_liveness) - now, std::chrono::milliseconds(100));
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
      timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(std::max<int64_t>(ns % 1'000'000'000, 1000))};
      futex(&h->wake, FUTEX_WAIT, w, &ts);
    }
  }

  // Wakes every rank sleeping in wait_until, after a seq_cst store of what
  // it waits for. Every operation of the handshake is seq_cst, so they
  // fall in one total order: if this load of sleepers comes before a
  // sleeper's increment, the sleeper's later look at ready() (seq_cst
  // loads) sees the store; otherwise this call sees the sleeper and wakes
  // it. (Plain atomics rather than fences, which TSan cannot follow.)
  void notify() {
    Header* h = seg_.header();
    if (h->sleepers.load() == 0) return;
    h->wake.fetch_add(1);
    futex(&h->wake, FUTEX_WAKE, INT32_MAX, nullptr);
  }

  // Raises if the group was aborted, by this rank or another.
  void check_alive_state() const {
    const auto kind = static_cast<AbortKind>(seg_.header()->aborted.load(std::memory_order_acquire));
    if (kind == AbortKind::kNone) return;
    raise_aborted(kind);
  }

  // Records the group's abort (if nobody did first) and wakes everyone.
  void set_abort(AbortKind kind, int peer, const std::string& reason);

  // Aborts the group for everyone, then raises on this rank.
  [[noreturn]] void fail(AbortKind kind, int peer, const std::string& msg);

 private:
  // Counts this rank among the header's sleepers while it lives.
  struct Sleeping {
    explicit Sleeping(Header* h) : h_(h) { h_->sleepers.fetch_add(1); }  // seq_cst: see notify()
    ~Sleeping() { h_->sleepers.fetch_sub(1); }
    Sleeping(const Sleeping&) = delete;
    Sleeping& operator=(const Sleeping&) = delete;
    Header* h_;
  };

  [[noreturn]] void raise(AbortKind kind, int peer, const std::string& msg) const;
  // check_alive_state's raise, once the group is known aborted.
  [[noreturn]] void raise_aborted(AbortKind kind) const;
  // Checks that the ranks in `waiting_for` are alive; aborts if one is not.
  // The first of waiting_for whose process is gone (its pid in *dead_pid),
  // or -1.
  int find_dead(const std::vector<int>& waiting_for, int* dead_pid) const;
  [[noreturn]] void fail_dead(int r, int pid, const std::string& what);

  const GroupSegment& seg_;
  int rank_;
  std::vector<int> global_ranks_;
  std::chrono::microseconds spin_;
  std::chrono::microseconds yield_;
};

}  // namespace tdist::comm::shm
