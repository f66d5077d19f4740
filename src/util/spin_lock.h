// SpinLock: a lock of one atomic word for critical sections of a few
// stores that are almost never contended (a flight recorder slot: its
// op's threads and, rarely, a dump). Locking is one exchange, unlocking one
// release store: no call into the C library, no futex. A contended lock
// spins a few rounds, then yields the core.
// Satisfies BasicLockable (std::lock_guard).
// Threading: any threads. Not for sections that block or run long.
#pragma once

#include <sched.h>

#include <atomic>

namespace tdist::detail {

class SpinLock {
 public:
  void lock() noexcept {
    for (int spins = 0; locked_.exchange(true, std::memory_order_acquire); ++spins) {
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins > 64) sched_yield();
      }
    }
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace tdist::detail
