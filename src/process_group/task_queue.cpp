// TaskQueue: the worker and watcher loops, the inline run and the
// continuation order. The contract, and who runs an op, are in
// task_queue.h.
#include "process_group/task_queue.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>

#include "process_group/async_ops.h"
#include "tdist/errors.h"
#include "trace/timeline.h"

namespace tdist::detail {

namespace {

using SteadyClock = std::chrono::steady_clock;

// The queue whose tasks this thread runs right now: its worker thread, or a
// thread that runs a task inline while waiting for it (null elsewhere).
thread_local const void* current_queue = nullptr;

// How long a fresh op is left to a thread that may wait for it (and run it
// inline) before the worker gets it: far longer than the step from queuing
// an op to waiting for it, short against anything an asynchronous op
// overlaps with.
constexpr auto kGrace = std::chrono::microseconds(20);

// How long after the last sign of activity (an op queued, or one running)
// the watcher keeps polling before it sleeps. It polls at SCHED_IDLE, so
// polling takes only time no other thread wants.
constexpr auto kWatch = std::chrono::milliseconds(1);

// While the group has been busy in the last kActive, the sleeping worker
// wakes on its own timer to hand itself fresh ops past their grace: the
// watcher's idle priority may get no time at all while the ranks compute.
// The period is kTickMin after an op had to be handed over (asynchronous
// use, where the tick decides how soon such an op starts), and doubles up
// to kTickMax at each wake that finds nothing to take once no op was handed
// over for kKeepTick (synchronous use, where every wake is a small
// disturbance, ~26 us of CPU on the 2-core VM, felt in the tail of small
// ops). It starts at kTickMax.
constexpr auto kTickMin = std::chrono::milliseconds(2);
constexpr auto kTickMax = std::chrono::milliseconds(64);
constexpr auto kKeepTick = std::chrono::seconds(1);
constexpr auto kActive = std::chrono::seconds(1);

// Set while an AsyncOpsScope lives on this thread.
thread_local bool async_ops = false;

}  // namespace

AsyncOpsScope::AsyncOpsScope() : outer_(async_ops) { async_ops = true; }
AsyncOpsScope::~AsyncOpsScope() { async_ops = outer_; }

TaskQueue::TaskQueue(std::string group_name) : group_name_(std::move(group_name)) {
  gate_->queue = this;
  worker_ = std::thread([this] { run(); });
  watcher_ = std::thread([this] { watch(); });
}

TaskQueue::~TaskQueue() { stop(); }

void TaskQueue::stop() {
  {
    std::lock_guard<std::mutex> g(gate_->mu);  // waits for an inline task
    gate_->queue = nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_.store(true);
  }
  cv_.notify_all();
  watch_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  if (watcher_.joinable()) watcher_.join();
}

std::shared_ptr<Work> TaskQueue::enqueue(const char* name, Milliseconds timeout, TaskBody body, OpCount count) {
  auto work = std::make_shared<Work>();
  work->set_runner([g = gate_](const Work& w) { return run_inline(g, &w); });
  bool wake_worker = false, wake_watcher = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw UsageError(std::string(name) + ": the process group '" + group_name_ + "' is shut down");
    const uint64_t seq = next_seq_++;
    work->set_info(0, name);  // numbered when it starts (pop_front_locked)
    // Marked before the look at running_ below (sequentially consistent, as
    // release_idle's mirror image): a synchronous op either sees it and
    // queues behind it, or wakes the worker for it when it ends.
    queued_.store(queue_.size() + 1);
    Task task{work, timeout, std::move(body), seq, count};
    if (current_queue == this) {
      task.for_worker = true;
      queue_.insert(queue_.begin() + static_cast<std::ptrdiff_t>(continuations_++), std::move(task));
    } else {
      task.for_worker = async_ops || running_ || !queue_.empty();
      queue_.push_back(std::move(task));
    }
    if (!queue_.front().for_worker && queue_.size() == 1) {
      watched_.fresh.store(queue_.front().seq + 1, std::memory_order_relaxed);
    }
    watched_.activity.fetch_add(1, std::memory_order_release);
    // The worker when it can take the task at once; else the watcher, which
    // hands the task over after its grace period (only a sleeping one
    // needs waking: a polling one sees the count).
    // A worker asleep without its tick (the group was quiet) is woken too,
    // so that it ticks while the group is busy.
    wake_worker = worker_asleep_ && (worker_may_take_locked() || !worker_ticking_);
    wake_watcher = watcher_asleep_ && !queue_.front().for_worker;
  }
  if (wake_worker) cv_.notify_one();
  if (wake_watcher) watch_cv_.notify_one();
  return work;
}

void TaskQueue::refuse_own_thread(const char* name) const {
  if (current_queue == this) {
    throw UsageError(std::string(name) + " with async_op=false from a then()/chain() function of group '" +
                     group_name_ + "': it runs on the group's own worker and would wait for itself; " +
                     "queue it asynchronously and return its Work from chain()");
  }
}

uint64_t TaskQueue::claim_idle(const char* name, OpCount count) {
  refuse_own_thread(name);
  if (stopping_.load(std::memory_order_acquire)) {
    throw UsageError(std::string(name) + ": the process group '" + group_name_ + "' is shut down");
  }
  // No lock: the run token alone orders this op against the worker and
  // inline runs.
  if (queued_.load() != 0 || !take_run_token()) return 0;
  // A task queued between the look above and the exchange may have found
  // the queue idle and been left to its own waiter, who cannot run it
  // while this op holds the token (and may fall asleep meanwhile): it goes
  // first. It marked queued_ before it looked at running_, and this looks
  // at queued_ after the exchange, all sequentially consistent: if it saw
  // the token free, this sees its mark. Likewise a stop() that began
  // meanwhile.
  if (queued_.load() != 0 || stopping_.load()) {
    release_idle();
    if (stopping_.load()) {
      throw UsageError(std::string(name) + ": the process group '" + group_name_ + "' is shut down");
    }
    return 0;
  }
  return number(count);
}

void TaskQueue::release_idle() {
  // What was queued meanwhile went to the worker (or is fresh, for its
  // waiter); a stopping worker waits for this op to end before it exits.
  // Both see running_ false, or this sees their mark (queued_, stopping_:
  // sequentially consistent on both sides) and wakes the worker under the
  // lock. The group, and so the queue, outlives its caller's op.
  running_.store(false);
  if (queued_.load() == 0 && !stopping_.load()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (worker_asleep_ && (worker_may_take_locked() || stopping_)) cv_.notify_one();
}

TaskQueue::Task TaskQueue::pop_front_locked() {
  Task task = std::move(queue_.front());
  queue_.pop_front();
  queued_.store(queue_.size());
  task.label = number(task.count);  // in the order ops start: the same on every rank
  task.work->set_seq(task.label);
  continuations_ = 0;
  // What is left behind the popped task was queued while it waited: handed
  // to the worker already, none fresh.
  if (watched_.fresh.load(std::memory_order_relaxed) != 0) watched_.fresh.store(0, std::memory_order_relaxed);
  return task;
}

bool TaskQueue::worker_may_take_locked() const {
  return !running_ && !queue_.empty() && (queue_.front().for_worker || stopping_);
}

// Work::wait's way in: runs w's task on this thread if it is next, nothing
// runs, and no other thread is running one inline; false otherwise.
bool TaskQueue::run_inline(const std::shared_ptr<Gate>& gate, const Work* w) {
  std::unique_lock<std::mutex> g(gate->mu, std::try_to_lock);
  if (!g.owns_lock() || !gate->queue) return false;
  TaskQueue& self = *gate->queue;
  Task task;
  {
    std::lock_guard<std::mutex> lock(self.mu_);
    if (self.queue_.empty() || self.queue_.front().work.get() != w || !self.take_run_token()) return false;
    task = self.pop_front_locked();
  }
  // Callbacks of the task run here too: what they queue goes first, as on
  // the worker.
  const void* outer = current_queue;
  current_queue = &self;
  execute(task);
  current_queue = outer;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(self.mu_);
    self.running_.store(false);
    // What was queued meanwhile went to the worker.
    wake = self.worker_asleep_ && self.worker_may_take_locked();
  }
  if (wake) self.cv_.notify_one();
  return true;
}

void TaskQueue::execute(Task& task) {
  comm::OpLabelScope labelled(task.label);
  try {
    auto result = task.body(comm::Clock::now() + task.timeout);
    task.work->mark_completed(std::move(result).to_vector());
  } catch (...) {
    task.work->mark_failed(std::current_exception());
  }
}

bool TaskQueue::hand_over_expired_locked(SteadyClock::time_point now) {
  if (running_ || queue_.empty() || queue_.front().for_worker) return false;
  Task& front = queue_.front();
  if (front.seen_at == SteadyClock::time_point{}) {
    front.seen_at = now;
    return false;
  }
  return now - front.seen_at >= kGrace && hand_over_locked(front.seq, now);
}

bool TaskQueue::hand_over_locked(uint64_t seq, SteadyClock::time_point now) {
  if (running_ || queue_.empty() || queue_.front().for_worker || queue_.front().seq != seq) return false;
  queue_.front().for_worker = true;
  watched_.fresh.store(0, std::memory_order_relaxed);
  tick_ = kTickMin;
  last_hand_over_ = now;
  return true;
}

void TaskQueue::run() {
  current_queue = this;
  pthread_setname_np(pthread_self(), "tdist-worker");  // for top -H, perf, gdb
  detail::set_timeline_track("tdist-worker " + group_name_, /*worker=*/true);
  uint64_t seen = watched_.activity.load(std::memory_order_acquire);
  auto active_until = SteadyClock::now() + kActive;
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto done = [&] {
        return worker_may_take_locked() || hand_over_expired_locked(SteadyClock::now()) ||
               (stopping_ && queue_.empty() && !running_);
      };
      while (!done()) {
        // While the group is busy, wake up on this thread's own timer: a
        // fresh op is taken within tick_ even when the cores are too busy
        // for the idle-priority watcher to run.
        const auto now = SteadyClock::now();
        const uint64_t a = watched_.activity.load(std::memory_order_acquire);
        if (a != seen) {
          seen = a;
          active_until = now + kActive;
        }
        worker_asleep_ = true;
        worker_ticking_ = now < active_until;
        // A fresh task seen on this look is due at the end of its grace.
        const bool due_soon = !queue_.empty() && !queue_.front().for_worker &&
                              queue_.front().seen_at != SteadyClock::time_point{};
        if (due_soon) {
          cv_.wait_until(lock, queue_.front().seen_at + kGrace);
        } else if (!worker_ticking_) {
          cv_.wait(lock);
        } else if (cv_.wait_until(lock, now + tick_) == std::cv_status::timeout && !done() &&
                   SteadyClock::now() - last_hand_over_ > kKeepTick) {
          tick_ = std::min<std::chrono::microseconds>(tick_ * 2, kTickMax);
        }
        worker_asleep_ = worker_ticking_ = false;
      }
      if (queue_.empty()) return;  // stopping, and everything queued has run
      // A synchronous op claimed the idle queue meanwhile (it takes no
      // lock): look again once it has released it (release_idle wakes
      // this thread).
      if (!take_run_token()) continue;
      task = pop_front_locked();
    }
    execute(task);
    std::lock_guard<std::mutex> lock(mu_);
    running_.store(false);
  }
}

void TaskQueue::watch() {
  sched_param idle{};
  (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);  // refused: polls at normal priority
  pthread_setname_np(pthread_self(), "tdist-watcher");
  uint64_t seen = watched_.activity.load(std::memory_order_acquire);
  auto active_until = SteadyClock::now() + kWatch;
  uint64_t fresh_seen = 0;
  SteadyClock::time_point fresh_at{};
  for (;;) {
    const auto now = SteadyClock::now();
    // A fresh task's grace runs from when this loop first saw it; only
    // one past its grace takes the lock.
    const uint64_t fresh = watched_.fresh.load(std::memory_order_relaxed);
    if (fresh != fresh_seen) {
      fresh_seen = fresh;
      fresh_at = SteadyClock::now();  // read after the sighting: the grace is never cut short
    } else if (fresh != 0 && now - fresh_at >= kGrace) {
      bool wake = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        wake = hand_over_locked(fresh - 1, now) && worker_asleep_;
      }
      if (wake) cv_.notify_one();
    }
    const uint64_t a = watched_.activity.load(std::memory_order_acquire);
    if (a != seen || fresh != 0) {
      seen = a;
      active_until = now + kWatch;
    }
    // An op running (inline, say) keeps it polling too, so that the next
    // synchronous op finds it awake; read only when about to sleep, to
    // stay off the line of the queue's lock.
    if (now >= active_until && running_.load(std::memory_order_acquire)) active_until = now + kWatch;
    if (now < active_until) {
      sched_yield();
      continue;
    }
    // Quiet: sleep until a fresh op arrives (or until stopped).
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) return;
    if (!queue_.empty() && !queue_.front().for_worker) {
      active_until = SteadyClock::now() + kWatch;
      continue;
    }
    watcher_asleep_ = true;
    watch_cv_.wait(lock, [&] { return stopping_ || (!queue_.empty() && !queue_.front().for_worker); });
    watcher_asleep_ = false;
    if (stopping_) return;
    seen = watched_.activity.load(std::memory_order_acquire);
    active_until = SteadyClock::now() + kWatch;
  }
}

}  // namespace tdist::detail
