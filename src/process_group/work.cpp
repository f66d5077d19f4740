// Work: completion, waiting (inline run, timeouts), then() and chain().
// The contract is in include/tdist/process_group.h.
#include <immintrin.h>
#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>

#include "comm/idle_work.h"
#include "tdist/process_group.h"
#include "trace/flight_recorder.h"
#include "trace/timeline.h"
#include "util/env.h"

namespace tdist {

struct Work::State {
  mutable std::mutex mu;
  std::condition_variable done_cv;
  std::atomic<bool> done{false};
  std::exception_ptr error;
  std::vector<at::Tensor> result;
  std::vector<std::function<void()>> callbacks;  // run once, on completion
  std::atomic<uint64_t> seq{0};
  std::string op_name = "work";
  std::function<bool(const Work&)> run_here;  // set before the work is shared
  std::function<void()> device_wait;  // likewise
};

Work::Work() : state_(std::make_unique<State>()) {}
Work::Work(CompletedTag, uint64_t seq, const std::string* name, at::Tensor one, std::vector<at::Tensor> many)
    : seq_(seq), name_(name), one_(std::move(one)), many_(std::move(many)) {}
Work::~Work() = default;

// A Work made completed (no state_) is never changed: the setters and
// mark_* leave it as it is.
void Work::set_info(uint64_t seq, std::string op_name) {
  if (!state_) return;
  state_->seq.store(seq, std::memory_order_relaxed);
  state_->op_name = std::move(op_name);
}
void Work::set_seq(uint64_t seq) {
  if (state_) state_->seq.store(seq, std::memory_order_relaxed);
}
void Work::set_runner(std::function<bool(const Work&)> run_here) {
  if (state_) state_->run_here = std::move(run_here);
}
void Work::set_device_wait(std::function<void()> device_wait) {
  if (state_) state_->device_wait = std::move(device_wait);
}

uint64_t Work::seq() const { return state_ ? state_->seq.load(std::memory_order_relaxed) : seq_; }
const std::string& Work::op_name() const {
  static const std::string kWork = "work";
  if (state_) return state_->op_name;
  return name_ ? *name_ : kWork;
}

bool Work::is_completed() const { return !state_ || state_->done.load(std::memory_order_acquire); }

bool Work::is_success() const {
  if (!state_) return true;
  if (!is_completed()) return false;
  std::lock_guard<std::mutex> lock(state_->mu);
  return !state_->error;
}

std::exception_ptr Work::exception() const {
  if (!state_) return nullptr;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->error;
}

std::vector<at::Tensor> Work::result() const {
  if (!state_) return one_.defined() ? std::vector<at::Tensor>{one_} : many_;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->result;
}

namespace {

// An op running on another thread (the group's worker) may finish within
// microseconds: poll that long before paying for a sleep and a wake-up
// (~15 us on a VM when the waker is on another core). The poll yields the
// core at every turn, so that the thread running the op (maybe on this very
// core when ranks outnumber cores) gets it.
constexpr auto kSpin = std::chrono::microseconds(30);

}  // namespace

void Work::wait() {
  if (!state_) return;
  // With the timeline on, a wait for an op not yet done is a span on this
  // thread: communication the caller did not overlap.
  std::optional<detail::TimelineSpan> waited;
  if (detail::Timeline::active() && !is_completed()) waited.emplace("wait", "wait", state_->op_name);
  // While the op has not started, this thread may run it itself (its queue
  // says whether it is next); it retries while an op ahead of it runs. The
  // clock is read only once the first try failed: a synchronous op run
  // here costs no clock read.
  std::chrono::steady_clock::time_point spin_end{};
  while (!is_completed()) {
    if (state_->run_here && state_->run_here(*this)) continue;
    const auto now = std::chrono::steady_clock::now();
    if (spin_end == std::chrono::steady_clock::time_point{}) {
      spin_end = now + kSpin;
    } else if (now >= spin_end) {
      break;
    }
    // Beside idle-priority work a yield hands it the core for a slice
    // (comm/idle_work.h): pause instead.
    if (comm::idle_work_running()) {
      _mm_pause();
    } else {
      sched_yield();
    }
  }
  if (!is_completed()) {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->done_cv.wait(lock, [&] { return state_->done.load(); });
  }
  // done was stored (release) after error, which is never written again.
  if (state_->error) std::rethrow_exception(state_->error);
  if (state_->device_wait) state_->device_wait();
}

void Work::wait(Milliseconds timeout) {
  if (!state_) return;
  std::optional<detail::TimelineSpan> waited;
  if (detail::Timeline::active() && !is_completed()) waited.emplace("wait", "wait", state_->op_name);
  std::unique_lock<std::mutex> lock(state_->mu);
  if (!state_->done_cv.wait_for(lock, timeout, [&] { return state_->done.load(); })) {
    const uint64_t seq = state_->seq.load(std::memory_order_relaxed);
    throw TimeoutError("Work::wait: " + state_->op_name +
                       (seq != 0 ? " #" + std::to_string(seq) : std::string(" (queued, not started)")) +
                       " did not complete within " + detail::format_duration_ms(timeout.count()));
  }
  if (state_->error) std::rethrow_exception(state_->error);
  lock.unlock();
  if (state_->device_wait) state_->device_wait();
}

namespace {

// Completes a work once (later calls are ignored), then runs its callbacks
// outside the lock.
void finish(Work::State& s, std::vector<at::Tensor> result, std::exception_ptr error);

}  // namespace

void Work::mark_completed(std::vector<at::Tensor> result) {
  if (state_) finish(*state_, std::move(result), nullptr);
}

void Work::mark_failed(std::exception_ptr error) {
  if (state_) finish(*state_, {}, std::move(error));
}

namespace {

void finish(Work::State& s, std::vector<at::Tensor> result, std::exception_ptr error) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.done) return;
    s.result = std::move(result);
    s.error = std::move(error);
    s.done.store(true, std::memory_order_release);
    callbacks.swap(s.callbacks);
  }
  s.done_cv.notify_all();
  for (auto& cb : callbacks) cb();
}

}  // namespace

std::shared_ptr<Work> Work::completed(std::vector<at::Tensor> result) {
  return std::make_shared<Work>(CompletedTag{}, 0, nullptr, at::Tensor(), std::move(result));
}

std::shared_ptr<Work> Work::chain(std::function<std::shared_ptr<Work>(Work&)> fn) {
  auto next = std::make_shared<Work>();
  next->set_info(seq(), op_name() + ".chain");
  auto self = shared_from_this();
  auto run = [self, next, fn = std::move(fn)] {
    if (auto err = self->exception()) {
      next->mark_failed(err);
      return;
    }
    std::shared_ptr<Work> inner;
    try {
      if (self->state_ && self->state_->device_wait) self->state_->device_wait();
      inner = fn(*self);
      if (!inner) throw UsageError("Work::chain: the function returned no Work");
    } catch (...) {
      next->mark_failed(std::current_exception());
      return;
    }
    // Forward the inner work's outcome, success or failure.
    inner->when_done([inner, next] {
      if (auto err = inner->exception()) next->mark_failed(err); else next->mark_completed(inner->result());
    });
  };
  when_done(std::move(run));
  return next;
}

void Work::when_done(std::function<void()> cb) {
  if (state_) {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->done) {
      state_->callbacks.push_back(std::move(cb));
      return;
    }
  }
  cb();
}

std::shared_ptr<Work> Work::then(std::function<std::vector<at::Tensor>(Work&)> fn) {
  auto next = std::make_shared<Work>();
  next->set_info(seq(), op_name() + ".then");
  auto self = shared_from_this();
  auto run = [self, next, fn = std::move(fn)] {
    if (auto err = self->exception()) {
      next->mark_failed(err);
      return;
    }
    try {
      if (self->state_ && self->state_->device_wait) self->state_->device_wait();
      next->mark_completed(fn(*self));
    } catch (...) {
      next->mark_failed(std::current_exception());
    }
  };
  when_done(std::move(run));
  return next;
}

}  // namespace tdist
