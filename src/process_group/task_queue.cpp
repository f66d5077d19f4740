// TaskQueue: the worker loop, the inline run and the continuation order.
// The contract is in task_queue.h.
#include "process_group/task_queue.h"

#include <sched.h>

#include "tdist/errors.h"

namespace tdist::detail {

namespace {

// The queue whose tasks this thread runs right now: its worker thread, or a
// thread that runs a task inline while waiting for it (null elsewhere).
thread_local const void* current_queue = nullptr;

// After finishing an op, the worker polls for the next one this long before
// sleeping: back-to-back collectives then need no wake-up. It yields the
// core at every turn (ranks may outnumber cores).
constexpr auto kWorkerSpin = std::chrono::microseconds(30);

}  // namespace

TaskQueue::TaskQueue(std::string group_name) : group_name_(std::move(group_name)) {
  gate_->queue = this;
  worker_ = std::thread([this] { run(); });
}

TaskQueue::~TaskQueue() { stop(); }

void TaskQueue::stop() {
  {
    std::lock_guard<std::mutex> g(gate_->mu);  // waits for an inline task
    gate_->queue = nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

std::shared_ptr<Work> TaskQueue::enqueue(const char* name, Milliseconds timeout, TaskBody body) {
  auto work = std::make_shared<Work>();
  work->set_runner([g = gate_, w = work.get()] { return run_inline(g, w); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw UsageError(std::string(name) + ": the process group '" + group_name_ + "' is shut down");
    work->set_info(next_seq_++, name);  // under the lock: chains enqueue from the worker too
    if (current_queue == this) {
      queue_.insert(queue_.begin() + static_cast<std::ptrdiff_t>(continuations_++),
                    Task{work, timeout, std::move(body)});
    } else {
      queue_.push_back(Task{work, timeout, std::move(body)});
    }
    queued_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_one();
  return work;
}

TaskQueue::Task TaskQueue::pop_front_locked() {
  Task task = std::move(queue_.front());
  queue_.pop_front();
  continuations_ = 0;
  queued_.fetch_sub(1, std::memory_order_relaxed);
  running_ = true;
  return task;
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
    if (self.running_ || self.queue_.empty() || self.queue_.front().work.get() != w) return false;
    task = self.pop_front_locked();
  }
  // Callbacks of the task run here too: what they queue goes first, as on
  // the worker.
  const void* outer = current_queue;
  current_queue = &self;
  execute(task);
  current_queue = outer;
  {
    std::lock_guard<std::mutex> lock(self.mu_);
    self.running_ = false;
  }
  self.cv_.notify_all();
  return true;
}

void TaskQueue::execute(Task& task) {
  try {
    auto result = task.body(comm::Clock::now() + task.timeout);
    task.work->mark_completed(std::move(result));
  } catch (...) {
    task.work->mark_failed(std::current_exception());
  }
}

void TaskQueue::run() {
  current_queue = this;
  for (;;) {
    Task task;
    {
      const auto spin_end = std::chrono::steady_clock::now() + kWorkerSpin;
      while (queued_.load(std::memory_order_acquire) == 0) {
        if (std::chrono::steady_clock::now() >= spin_end) break;
        sched_yield();
      }
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !running_ && (!queue_.empty() || stopping_); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      task = pop_front_locked();
    }
    execute(task);
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
  }
}

}  // namespace tdist::detail
