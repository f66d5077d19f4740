// TaskQueue: a process group's ops, run one at a time in queue order, on
// the group's worker thread or inline on a thread that waits for the op at
// the front of an idle queue (Work::wait's shortcut: it saves waking the
// worker and being woken by it).
//
// Owns: the worker thread, the queue of tasks, and the gate through which
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
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/backend.h"
#include "tdist/process_group.h"

namespace tdist::detail {

// A task's body: runs the op before the deadline, returns Work's result.
using TaskBody = std::function<std::vector<at::Tensor>(comm::Deadline)>;

class TaskQueue {
 public:
  // group_name: for error messages.
  explicit TaskQueue(std::string group_name);
  ~TaskQueue();
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  // Queues body as the op `name` with `timeout` (positive); the Work
  // completes with body's result or fails with its exception. Ops are
  // numbered in enqueue order (Work's sequence number).
  std::shared_ptr<Work> enqueue(const char* name, Milliseconds timeout, TaskBody body);

  // Runs what is queued, then stops the worker. Idempotent.
  void stop();

 private:
  struct Task {
    std::shared_ptr<Work> work;
    Milliseconds timeout;
    TaskBody body;
  };
  struct Gate {
    std::mutex mu;  // held while a task runs inline
    TaskQueue* queue = nullptr;
  };

  static bool run_inline(const std::shared_ptr<Gate>& gate, const Work* w);
  static void execute(Task& task);
  // Takes the front task; REQUIRES mu_, a task queued and none running.
  Task pop_front_locked();
  void run();

  const std::string group_name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  uint64_t next_seq_ = 0;
  // A task is running (on the worker, or inline): one at a time.
  bool running_ = false;
  // How many continuations (tasks queued from this queue's thread) lead
  // the queue; they run before anything queued by other threads.
  size_t continuations_ = 0;
  std::atomic<size_t> queued_{0};  // the worker polls it before sleeping
  bool stopping_ = false;
  std::shared_ptr<Gate> gate_ = std::make_shared<Gate>();
  std::thread worker_;
};

}  // namespace tdist::detail
