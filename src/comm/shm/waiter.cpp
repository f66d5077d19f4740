// Waiter: spin, yield, then futex; liveness checks between naps; the
// group's abort record. The contract is in waiter.h.
#include "comm/shm/waiter.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "comm/shm/process_info.h"

namespace tdist::comm::shm {

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

Waiter::Waiter(const GroupSegment& segment, int rank, std::vector<int> global_ranks, std::chrono::microseconds spin,
               std::chrono::microseconds yield)
    : seg_(segment), rank_(rank), global_ranks_(std::move(global_ranks)), spin_(spin), yield_(yield) {}

void Waiter::raise(AbortKind kind, int peer, const std::string& msg) const {
  switch (kind) {
    case AbortKind::kTimeout: throw TimeoutError(msg);
    case AbortKind::kPeerFailure: throw PeerFailureError(msg, global(peer));
    case AbortKind::kMismatch: throw CollectiveMismatchError(msg);
    default: throw Error(msg);
  }
}

void Waiter::raise_aborted(AbortKind kind) const {
  Header* h = seg_.header();
  raise(kind, h->abort_peer.load(),
        "shm backend, rank " + std::to_string(global(rank_)) + ": the group was aborted by rank " +
            std::to_string(global(h->abort_from.load())) + ": " + h->abort_reason);
}

void Waiter::set_abort(AbortKind kind, int peer, const std::string& reason) {
  Header* h = seg_.header();
  uint32_t expected = 0;
  if (h->abort_claimed.compare_exchange_strong(expected, 1)) {
    std::snprintf(h->abort_reason, sizeof h->abort_reason, "%s", reason.empty() ? "aborted" : reason.c_str());
    h->abort_from.store(rank_);
    h->abort_peer.store(peer);
    h->aborted.store(static_cast<uint32_t>(kind == AbortKind::kNone ? AbortKind::kOther : kind),
                     std::memory_order_release);
  } else {
    // Another rank claimed the record and is still writing it. Wait until
    // it is published before this rank raises: a rank that learns of this
    // one's error (its caller gave up) must not find the group un-aborted
    // and finish a round that the others have left. Bounded: the writer
    // may have died between its claim and its store.
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
    while (h->aborted.load(std::memory_order_acquire) == 0 && std::chrono::steady_clock::now() < until) {
      sched_yield();
    }
  }
  h->wake.fetch_add(1);
  futex(&h->wake, FUTEX_WAKE, INT32_MAX, nullptr);
}

void Waiter::fail(AbortKind kind, int peer, const std::string& msg) {
  set_abort(kind, peer, msg);
  raise(kind, peer, "shm backend, rank " + std::to_string(global(rank_)) + ": " + msg);
}

int Waiter::find_dead(const std::vector<int>& waiting_for, int* dead_pid) const {
  for (int r : waiting_for) {
    const Slot* s = seg_.slot(r);
    const int pid = s->pid.load();
    if (pid <= 0) continue;
    const uint64_t start = process_start_time(pid);
    if (start == 0 || start != s->start_time.load() || !pid_alive(pid)) {
      *dead_pid = pid;
      return r;
    }
  }
  return -1;
}

void Waiter::fail_dead(int r, int pid, const std::string& what) {
  fail(AbortKind::kPeerFailure, r,
       "rank " + std::to_string(global(r)) + " (pid " + std::to_string(pid) + ") died during " + what);
}

}  // namespace tdist::comm::shm
