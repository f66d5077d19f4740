// TaskQueue: a process group's ops, run one at a time in queue order, on
// the group's worker thread or inline on a thread that waits for the op at
// the front of an idle queue (Work::wait's shortcut).
//
// Who runs an op: the thread that queues an op and waits for it at once
// (the common synchronous call) runs it itself, with no other thread
// involved. Every hand-over between threads that ends in a sleep costs a
// wake-up (~15 us on a VM when the waker is on another core: an IPI through
// the hypervisor), and a second runnable thread per rank lets the scheduler
// put two ranks' busy threads on one core while the other core runs only
// pollers (the runs "stuck at 30-60 us per op" of issue 18). So:
// - A fresh op (queued while nothing ran or waited in the queue) is left
//   for a grace period (kGrace, task_queue.cpp) to a thread that may wait
//   for it. Past that it is handed to the worker. The grace runs from when
//   the watcher (or the worker) first sees the op unclaimed, so queuing
//   reads no clock. An op queued behind
//   another, by a callback on this queue's own thread, or inside an
//   AsyncOpsScope (async_ops.h: DDP's buckets, FSDP's prefetches) goes to
//   the worker at once (its caller could not, or will not, run it then).
// - The worker sleeps on the queue's condition variable until an op is
//   handed to it; it never polls. While the group has been busy lately it
//   also wakes on its own timer (every 2 ms while ops have had to be handed
//   over in the last second, else every 64 ms) and takes a fresh op whose
//   grace has run out:
//   the watcher below runs only on an idle core, and while the ranks
//   compute there may be none.
// - A watcher thread at SCHED_IDLE (it runs only on a core that has
//   nothing else to run, and counts as idle to the scheduler's balancing)
//   hands fresh ops over when their grace runs out. It polls with
//   sched_yield while the queue has been active in the last kWatch, so
//   that a fresh op needs no wake-up; after that it sleeps, and the next
//   fresh op wakes it. Where SCHED_IDLE is refused, it polls at normal
//   priority.
//
// Owns: the worker and watcher threads, the queue of tasks, and the gate through which
// a waiting Work reaches the queue (the Work holds it; stop() closes it).
// Order: tasks run in enqueue order, except that a task queued from a
// callback running on this queue's own thread (the next step of a hook's
// chain, say) goes ahead of everything queued by other threads meanwhile,
// in the order such tasks were queued: chained collectives are so issued in
// the same order on every rank, however threads interleave.
// Threading: enqueue from any thread, including from task callbacks.
// Lifetime: stop() (or the destructor) runs what is queued, then joins the
// worker; enqueue after it throws UsageError. A Work may outlive the queue.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/backend.h"
#include "comm/op_label.h"
#include "tdist/process_group.h"

namespace tdist::detail {

// What an op's body returns, Work's result: one tensor (held inline, so
// that a synchronous op allocates no vector for it) or several.
struct OpResult {
  OpResult() = default;
  OpResult(at::Tensor t) : one(std::move(t)) {}  // NOLINT(google-explicit-constructor): `return {tensor};`
  OpResult(std::vector<at::Tensor> v) : many(std::move(v)) {}  // NOLINT(google-explicit-constructor)
  std::vector<at::Tensor> to_vector() && {
    if (one.defined()) return {std::move(one)};
    return std::move(many);
  }
  at::Tensor one;  // defined: the result is this tensor alone
  std::vector<at::Tensor> many;
};

// A task's body: runs the op before the deadline, returns Work's result.
using TaskBody = std::function<OpResult(comm::Deadline)>;

// The group's two numberings (op_label.h): collectives, and send/recv apart
// (they are not symmetric across ranks). Each counts 1, 2, 3, ... in the
// order the ops start, which is the order they run in: the same on every
// rank that calls them in the same order, whatever the threads' timing
// (a continuation queued from a callback runs, and so is numbered, ahead
// of ops other threads queued meanwhile).
enum class OpCount : uint8_t { kCollective, kP2p };

class TaskQueue {
 public:
  // group_name: for error messages.
  explicit TaskQueue(std::string group_name);
  ~TaskQueue();
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  // Queues body as the op `name` with `timeout` (positive); the Work
  // completes with body's result or fails with its exception. The op is
  // numbered when it starts (`count`: which of the group's two numberings,
  // op_label.h): the Work's seq() from then on, and, while body runs, the
  // thread's current_op_label().
  std::shared_ptr<Work> enqueue(const char* name, Milliseconds timeout, TaskBody body,
                                OpCount count = OpCount::kCollective);

  // The synchronous path (async_op=false): when nothing is queued or
  // running, runs fn(deadline) on this thread at once as the next op (no
  // Work, no queue entry; numbered as for enqueue) and returns its number;
  // fn's exception propagates. nullopt when the queue is busy: the caller
  // queues the op and waits for it. UsageError on this queue's own thread
  // (a callback that waited would wait for itself) and once stopped.
  // `lazy`: the backend resolves comm::kLazyDeadline (backend.h), so that
  // an op that never waits reads no clock; its deadline then counts from
  // its first wait.
  template <typename Fn>
  std::optional<uint64_t> run_now(const char* name, Milliseconds timeout, Fn&& fn,
                                  OpCount count = OpCount::kCollective, bool lazy = false) {
    const uint64_t label = claim_idle(name, count);
    if (label == 0) return std::nullopt;
    struct Release {
      TaskQueue* queue;
      ~Release() { queue->release_idle(); }
    } release{this};
    comm::OpLabelScope labelled(label);
    if (lazy) {
      comm::LazyDeadlineScope deadline(timeout);
      fn(comm::kLazyDeadline);
    } else {
      fn(comm::Clock::now() + timeout);
    }
    return label;
  }

  // UsageError when called on this queue's own thread (its worker, or a
  // callback of a task run inline): a synchronous op there would wait for
  // itself. run_now checks it too.
  void refuse_own_thread(const char* name) const;

  // Runs what is queued, then stops the worker. Idempotent.
  void stop();

 private:
  struct Task {
    std::shared_ptr<Work> work;
    Milliseconds timeout;
    TaskBody body;
    uint64_t seq = 0;  // the queue's own count, from 0 (hand-overs are matched by it)
    OpCount count = OpCount::kCollective;
    uint64_t label = 0;  // its number (op_label.h), given when it starts
    // When the worker first found it fresh at the front (its grace runs
    // from there; zero: not yet). The caller reads no clock to queue it.
    std::chrono::steady_clock::time_point seen_at{};
    // Handed to the worker: queued where its caller could not run it at
    // once (behind another task, or from this queue's thread), or left
    // unclaimed past its grace period (the watcher hands it over).
    bool for_worker = false;
  };
  struct Gate {
    std::mutex mu;  // held while a task runs inline
    TaskQueue* queue = nullptr;
  };

  // run_now's two halves, lock-free: takes the run token of an idle queue
  // and numbers the op (0: not idle); then gives the token back.
  uint64_t claim_idle(const char* name, OpCount count);
  // The run token (running_): whoever sets it from false runs the one op
  // running, numbers it, and clears it when the op ends. Every start of an
  // op takes it so; whether this thread did.
  bool take_run_token() {
    bool idle = false;
    return running_.compare_exchange_strong(idle, true);
  }
  // The next number of `count`; REQUIRES the run token.
  uint64_t number(OpCount count) { return ++numbered_[static_cast<int>(count)]; }
  void release_idle();
  static bool run_inline(const std::shared_ptr<Gate>& gate, const Work* w);
  static void execute(Task& task);
  // Takes the front task and numbers it; REQUIRES mu_, a task queued and
  // the run token taken by this thread.
  Task pop_front_locked();
  // Whether the worker may take the front task now; REQUIRES mu_.
  bool worker_may_take_locked() const;
  // The worker's look at a fresh front task: notes when it first saw it,
  // and hands it over once that is a grace period ago; whether it did.
  // REQUIRES mu_.
  bool hand_over_expired_locked(std::chrono::steady_clock::time_point now);
  // Hands the front task over if it is still the fresh task `seq` (the
  // watcher saw it unclaimed for a grace period); whether it did.
  // REQUIRES mu_.
  bool hand_over_locked(uint64_t seq, std::chrono::steady_clock::time_point now);
  void run();
  // The watcher's loop (see above).
  void watch();

  const std::string group_name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  uint64_t next_seq_ = 0;
  uint64_t numbered_[2] = {0, 0};  // the last number given, per OpCount; under the run token
  // A task is running (on the worker, inline, or run_now's): one at a time,
  // the run token (take_run_token). Cleared under mu_ by the worker and
  // inline runs, without it by run_now (release_idle).
  std::atomic<bool> running_{false};
  // queue_.size(), or one more while a task is being queued: what run_now
  // reads instead of taking mu_. Written under mu_.
  std::atomic<size_t> queued_{0};
  // How many continuations (tasks queued from this queue's thread) lead
  // the queue; they run before anything queued by other threads.
  size_t continuations_ = 0;
  // What the watcher polls, on a cache line of its own, written once per
  // enqueue and once per start of a task: a poll costs the queue's users
  // no transfer of the line that holds mu_.
  struct alignas(64) Watched {
    // 1 + the sequence number of the front task while it is fresh (not
    // handed to the worker; nothing runs then); 0 otherwise. The watcher
    // times how long it sees one value.
    std::atomic<uint64_t> fresh{0};
    std::atomic<uint64_t> activity{0};  // bumped by every enqueue
  };
  Watched watched_;
  bool worker_asleep_ = false;   // on cv_; under mu_
  bool worker_ticking_ = false;  // asleep with a timeout (the group is busy); under mu_
  std::chrono::microseconds tick_{64000};  // the worker's timeout then; under mu_
  std::chrono::steady_clock::time_point last_hand_over_{};  // under mu_
  bool watcher_asleep_ = false;  // on watch_cv_; under mu_
  std::condition_variable watch_cv_;
  std::atomic<bool> stopping_{false};  // written under mu_; run_now reads it without
  std::shared_ptr<Gate> gate_ = std::make_shared<Gate>();
  std::thread worker_;
  std::thread watcher_;
};

}  // namespace tdist::detail
