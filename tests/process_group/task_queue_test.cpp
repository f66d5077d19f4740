// TaskQueue, the queue every process group runs its ops on: who runs an op
// (the waiting thread for a synchronous call, the worker for one nobody
// waits for), order, stop, and that a quiet queue has no runnable thread.
#include "process_group/task_queue.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using tdist::detail::TaskQueue;
using namespace std::chrono_literals;

std::string thread_name() {
  char name[32] = {};
  pthread_getname_np(pthread_self(), name, sizeof name);
  return name;
}

// Each of this process's threads named `comm`: tid, and state letter from
// /proc/self/task/<tid>/stat.
std::vector<std::pair<int, char>> threads_named(const std::string& comm) {
  std::vector<std::pair<int, char>> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream c(e.path() / "comm");
    std::string name;
    std::getline(c, name);
    if (name != comm) continue;
    std::ifstream s(e.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(s)), std::istreambuf_iterator<char>());
    const size_t close = stat.rfind(')');
    out.emplace_back(std::stoi(e.path().filename().string()), stat.at(close + 2));
  }
  return out;
}

bool wait_for(const std::function<bool()>& cond, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(100us);
  }
  return true;
}

TEST(TaskQueue, AnOpNobodyWaitsForRunsOnTheWorker) {
  TaskQueue q("test");
  std::promise<std::string> ran_on;
  auto w = q.enqueue("op", 10s, [&](tdist::comm::Deadline) {
    ran_on.set_value(thread_name());
    return std::vector<at::Tensor>{};
  });
  ASSERT_TRUE(wait_for([&] { return w->is_completed(); }, 5000ms));
  EXPECT_EQ(ran_on.get_future().get(), "tdist-worker");
}

TEST(TaskQueue, AnOpNobodyWaitsForRunsWhileEveryCoreIsBusy) {
  // The idle-priority watcher gets no time while every core computes; the
  // worker's own tick must still start the op within milliseconds.
  TaskQueue q("test");
  q.enqueue("warm", 10s, [](tdist::comm::Deadline) { return std::vector<at::Tensor>{}; })->wait();  // busy lately
  std::atomic<bool> stop{false};
  std::vector<std::thread> busy;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned i = 0; i < cores; ++i) {
    busy.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto w = q.enqueue("op", 10s, [](tdist::comm::Deadline) { return std::vector<at::Tensor>{}; });
  const bool done = wait_for([&] { return w->is_completed(); }, 2000ms);
  const auto took = std::chrono::steady_clock::now() - t0;
  stop = true;
  for (auto& t : busy) t.join();
  ASSERT_TRUE(done);
  EXPECT_LT(took, 200ms);
}

TEST(TaskQueue, WaitingAtOnceRunsTheOpOnTheWaitingThread) {
  // The synchronous call: no hand-over to another thread. (The worker takes
  // an op left unclaimed for 20 us, so a test thread preempted between
  // enqueue and wait may lose one now and then; most must run here.)
  TaskQueue q("test");
  int here = 0;
  const auto me = std::this_thread::get_id();
  for (int i = 0; i < 200; ++i) {
    std::thread::id ran;
    q.enqueue("op", 10s, [&](tdist::comm::Deadline) {
       ran = std::this_thread::get_id();
       return std::vector<at::Tensor>{};
     })->wait();
    here += ran == me;
  }
  EXPECT_GE(here, 150);
}

TEST(TaskQueue, AnOpQueuedBehindARunningOneGoesToTheWorker) {
  TaskQueue q("test");
  std::promise<void> release;
  auto released = release.get_future().share();
  std::atomic<bool> first_started{false};
  auto first = q.enqueue("first", 10s, [&](tdist::comm::Deadline) {
    first_started = true;
    released.wait();
    return std::vector<at::Tensor>{};
  });
  ASSERT_TRUE(wait_for([&] { return first_started.load(); }, 5000ms));
  std::string second_on;
  auto second = q.enqueue("second", 10s, [&](tdist::comm::Deadline) {
    second_on = thread_name();
    return std::vector<at::Tensor>{};
  });
  release.set_value();
  ASSERT_TRUE(wait_for([&] { return second->is_completed(); }, 5000ms));
  EXPECT_TRUE(first->is_completed());
  EXPECT_EQ(second_on, "tdist-worker");
}

TEST(TaskQueue, OpsRunInQueueOrderWhoeverRunsThem) {
  TaskQueue q("test");
  std::vector<int> order;
  std::vector<std::shared_ptr<tdist::Work>> works;
  for (int i = 0; i < 300; ++i) {
    works.push_back(q.enqueue("op", 10s, [&order, i](tdist::comm::Deadline) {
      order.push_back(i);  // one task at a time: no race
      return std::vector<at::Tensor>{};
    }));
    if (i % 3 == 0) works.back()->wait();
    if (i % 7 == 0) std::this_thread::sleep_for(50us);
  }
  for (auto& w : works) w->wait();
  ASSERT_EQ(order.size(), 300u);
  for (int i = 0; i < 300; ++i) EXPECT_EQ(order[i], i);
}

TEST(TaskQueue, StopRunsWhatIsQueued) {
  std::vector<std::shared_ptr<tdist::Work>> works;
  std::atomic<int> ran{0};
  {
    TaskQueue q("test");
    for (int i = 0; i < 20; ++i) {
      works.push_back(q.enqueue("op", 10s, [&](tdist::comm::Deadline) {
        ++ran;
        return std::vector<at::Tensor>{};
      }));
    }
    q.stop();
    EXPECT_THROW(q.enqueue("late", 10s, [](tdist::comm::Deadline) { return std::vector<at::Tensor>{}; }),
                 tdist::UsageError);
  }
  EXPECT_EQ(ran.load(), 20);
  for (auto& w : works) EXPECT_TRUE(w->is_success());
}

TEST(TaskQueue, TheWatcherPollsAtIdlePriorityAndAQuietQueueSleeps) {
  TaskQueue q("test");
  for (int i = 0; i < 10; ++i) q.enqueue("op", 10s, [](tdist::comm::Deadline) { return std::vector<at::Tensor>{}; })->wait();
  // (The watcher names itself once its priority is set.)
  ASSERT_TRUE(wait_for([] { return threads_named("tdist-watcher").size() == 1; }, 5000ms));
  const auto watchers = threads_named("tdist-watcher");
  // Any user may lower a thread to SCHED_IDLE (only a seccomp filter could
  // refuse). SCHED_IDLE threads count as idle to the scheduler, so a
  // polling watcher never keeps two ranks' busy threads on one core.
  EXPECT_EQ(sched_getscheduler(watchers[0].first), SCHED_IDLE);
  // Quiet for far longer than the watcher's 1 ms: nothing of the queue is
  // runnable (no core is burnt while the ranks compute).
  auto all_asleep = [] {
    for (const char* name : {"tdist-watcher", "tdist-worker"}) {
      for (auto [tid, state] : threads_named(name)) {
        if (state != 'S') return false;
      }
    }
    return true;
  };
  EXPECT_TRUE(wait_for(all_asleep, 2000ms));
}

// run_now, the synchronous call's path: on the calling thread when the
// queue is idle, numbered as it starts in line with queued ops (collectives
// and send/recv apart), the number set on the thread while it runs;
// refused while an op waits or runs (the caller then queues it); the error
// of its function reaches the caller and leaves the queue usable.
TEST(TaskQueue, RunNowRunsOnTheCallingThreadWhenIdleNumberedInLineWithQueuedOps) {
  using tdist::detail::OpCount;
  TaskQueue q("test");
  auto empty = [](tdist::comm::Deadline) { return std::vector<at::Tensor>{}; };
  uint64_t queued_label = 0;
  auto w0 = q.enqueue("op", 10s, [&](tdist::comm::Deadline) {
    queued_label = tdist::comm::current_op_label();
    return std::vector<at::Tensor>{};
  });
  w0->wait();
  EXPECT_EQ(w0->seq(), 1u);
  EXPECT_EQ(queued_label, 1u);
  std::thread::id ran;
  uint64_t label = 0;
  const auto seq = q.run_now("op", 10s, [&](tdist::comm::Deadline d) {
    ran = std::this_thread::get_id();
    label = tdist::comm::current_op_label();
    EXPECT_GT(d, tdist::comm::Clock::now() + 9s);
  });
  ASSERT_TRUE(seq.has_value());
  EXPECT_EQ(*seq, 2u);
  EXPECT_EQ(label, 2u);
  EXPECT_EQ(tdist::comm::current_op_label(), 0u) << "the number outlived its op";
  EXPECT_EQ(ran, std::this_thread::get_id());
  auto p2p = q.enqueue("send", 10s, empty, OpCount::kP2p);
  p2p->wait();
  EXPECT_EQ(p2p->seq(), 1u) << "send/recv are numbered apart";
  auto w3 = q.enqueue("op", 10s, empty);
  w3->wait();
  EXPECT_EQ(w3->seq(), 3u);
  // Busy: an op runs (on the worker), and one is queued behind it.
  std::promise<void> release;
  auto released = release.get_future().share();
  std::atomic<bool> started{false};
  auto blocker = q.enqueue("blocker", 10s, [&](tdist::comm::Deadline) {
    started = true;
    released.wait();
    return std::vector<at::Tensor>{};
  });
  ASSERT_TRUE(wait_for([&] { return started.load(); }, 5000ms));
  bool called = false;
  EXPECT_FALSE(q.run_now("op", 10s, [&](tdist::comm::Deadline) { called = true; }).has_value());
  auto behind = q.enqueue("behind", 10s, empty);
  release.set_value();
  // Once it may run here, what was queued before it has run.
  bool behind_done = true;
  if (q.run_now("op", 10s, [&](tdist::comm::Deadline) { behind_done = behind->is_completed(); })) {
    EXPECT_TRUE(behind_done);
  }
  behind->wait();
  EXPECT_TRUE(blocker->is_success());

  // An error propagates; the queue is idle again afterwards.
  EXPECT_THROW(q.run_now("op", 10s, [](tdist::comm::Deadline) { throw std::runtime_error("broke"); }),
               std::runtime_error);
  EXPECT_TRUE(q.run_now("op", 10s, [&](tdist::comm::Deadline) { called = true; }).has_value());
  EXPECT_TRUE(called);
}

// An op queued by another thread while run_now's function runs goes to the
// worker after it, not beside it.
TEST(TaskQueue, AnOpQueuedDuringRunNowRunsAfterIt) {
  TaskQueue q("test");
  std::atomic<int> running{0}, overlaps{0};
  std::vector<int> order;
  std::mutex order_mu;
  auto note = [&](int who) {
    if (running.fetch_add(1) != 0) ++overlaps;
    std::this_thread::sleep_for(200us);
    {
      std::lock_guard<std::mutex> lock(order_mu);
      order.push_back(who);
    }
    running.fetch_sub(1);
  };
  std::vector<std::shared_ptr<tdist::Work>> works;
  std::thread other([&] {
    for (int i = 0; i < 50; ++i) {
      works.push_back(q.enqueue("async", 10s, [&](tdist::comm::Deadline) {
        note(1);
        return std::vector<at::Tensor>{};
      }));
      std::this_thread::sleep_for(100us);
    }
  });
  // Tries spread over the other thread's whole run (and past it, until one
  // ran): under load the queue may stay busy through a burst of tries.
  int ran_now = 0;
  std::atomic<bool> other_done{false};
  std::thread flag([&] {
    other.join();
    other_done = true;
  });
  for (int i = 0; i < 200 || !other_done || (ran_now == 0 && i < 100000); ++i) {
    if (q.run_now("sync", 10s, [&](tdist::comm::Deadline) { note(0); })) ++ran_now;
    std::this_thread::sleep_for(20us);
  }
  flag.join();
  for (auto& w : works) w->wait();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_GT(ran_now, 0);
  EXPECT_EQ(order.size(), 50u + static_cast<size_t>(ran_now));
}

// Threads racing synchronous calls (run_now, lock-free: the run token)
// against queued ops, inline runs and the worker: one op at a time, every
// op numbered once, 1..N with no gap, and none left behind (a lost
// wake-up would leave a queued op unrun: its wait times out).
TEST(TaskQueue, RacingSynchronousAndQueuedOpsRunOneAtATimeNumberedOnce) {
  TaskQueue q("test");
  constexpr int kThreads = 4, kOps = 400;
  std::atomic<int> running{0}, overlaps{0};
  std::mutex labels_mu;
  std::vector<uint64_t> labels;
  auto body = [&] {
    if (running.fetch_add(1) != 0) ++overlaps;
    const uint64_t label = tdist::comm::current_op_label();
    {
      std::lock_guard<std::mutex> lock(labels_mu);
      labels.push_back(label);
    }
    running.fetch_sub(1);
  };
  std::atomic<int> ran_now{0}, timed_out{0};
  // Twenty rounds, and more until a synchronous call found the queue idle at
  // least once (under load every try may find it busy).
  int rounds = 0;
  for (; rounds < 200 && (rounds < 20 || ran_now.load() == 0); ++rounds) {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::vector<std::shared_ptr<tdist::Work>> later;
        for (int i = 0; i < kOps; ++i) {
          switch ((i + t) % 3) {
            case 0:  // synchronous: at once, or queued and waited for
              if (q.run_now("sync", 10s, [&](tdist::comm::Deadline) { body(); })) {
                ++ran_now;
              } else {
                auto w = q.enqueue("sync", 10s, [&](tdist::comm::Deadline) {
                  body();
                  return std::vector<at::Tensor>{};
                });
                try {
                  w->wait(10s);
                } catch (const tdist::TimeoutError&) {
                  ++timed_out;
                }
              }
              break;
            case 1:  // queued and waited for at once (maybe run inline)
              q.enqueue("queued", 10s, [&](tdist::comm::Deadline) {
                 body();
                 return std::vector<at::Tensor>{};
               })->wait();
              break;
            default:  // queued, waited for later (the worker's)
              later.push_back(q.enqueue("async", 10s, [&](tdist::comm::Deadline) {
                body();
                return std::vector<at::Tensor>{};
              }));
          }
        }
        for (auto& w : later) {
          try {
            w->wait(10s);
          } catch (const tdist::TimeoutError&) {
            ++timed_out;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
  }
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(timed_out.load(), 0);
  EXPECT_GT(ran_now.load(), 0);
  std::sort(labels.begin(), labels.end());
  ASSERT_EQ(labels.size(), static_cast<size_t>(rounds) * kThreads * kOps);
  for (size_t i = 0; i < labels.size(); ++i) ASSERT_EQ(labels[i], i + 1) << "numbered twice, or a gap";
}

// From a callback on the queue's own thread, run_now would wait for itself
// when busy: refused, always (the callback's own op still runs).
TEST(TaskQueue, RunNowFromTheQueuesOwnThreadIsRefused) {
  TaskQueue q("test");
  std::promise<void> release;
  auto released = release.get_future().share();
  auto first = q.enqueue("first", 10s, [&](tdist::comm::Deadline) {
    released.wait();
    return std::vector<at::Tensor>{};
  });
  std::string refused;
  auto next = first->then([&](tdist::Work&) {
    try {
      q.run_now("all_reduce", 10s, [](tdist::comm::Deadline) {});
    } catch (const tdist::UsageError& e) {
      refused = e.what();
    }
    return std::vector<at::Tensor>{};
  });
  release.set_value();
  next->wait();
  EXPECT_NE(refused.find("async_op=false"), std::string::npos) << refused;
  EXPECT_NE(refused.find("'test'"), std::string::npos) << refused;
}

// stop() while a synchronous op runs: it waits for it, and does not hang.
TEST(TaskQueue, StopWaitsForARunNowInProgress) {
  TaskQueue q("test");
  std::atomic<bool> started{false}, finished{false};
  std::thread caller([&] {
    q.run_now("op", 10s, [&](tdist::comm::Deadline) {
      started = true;
      std::this_thread::sleep_for(100ms);
      finished = true;
    });
  });
  ASSERT_TRUE(wait_for([&] { return started.load(); }, 5000ms));
  const auto t0 = std::chrono::steady_clock::now();
  q.stop();
  EXPECT_TRUE(finished.load());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  caller.join();
  EXPECT_THROW(q.run_now("late", 10s, [](tdist::comm::Deadline) {}), tdist::UsageError);
}

}  // namespace
