// The weight fences' registry; the contract is in weight_fence.h.
#include "autograd/weight_fence.h"

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>

namespace tdist::detail {

namespace {

struct Registry {
  std::mutex mu;
  std::condition_variable idle;  // no fence is running
  std::map<uint64_t, std::function<void()>> fences;  // under mu
  uint64_t next = 1;     // under mu
  int running = 0;       // fences being run; under mu
  std::atomic<size_t> count{0};
};

Registry& registry() {
  static auto* r = new Registry;  // never destroyed: backwards may end during exit
  return *r;
}

}  // namespace

uint64_t add_weight_fence(std::function<void()> wait) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const uint64_t id = r.next++;
  r.fences.emplace(id, std::move(wait));
  r.count.store(r.fences.size(), std::memory_order_release);
  return id;
}

void remove_weight_fence(uint64_t id) {
  Registry& r = registry();
  std::unique_lock<std::mutex> lock(r.mu);
  r.fences.erase(id);
  r.count.store(r.fences.size(), std::memory_order_release);
  r.idle.wait(lock, [&] { return r.running == 0; });
}

void wait_weight_fences() {
  Registry& r = registry();
  if (r.count.load(std::memory_order_acquire) == 0) return;
  std::unique_lock<std::mutex> lock(r.mu);
  std::map<uint64_t, std::function<void()>> fences = r.fences;  // copies: run outside the lock
  ++r.running;
  lock.unlock();
  struct Done {
    Registry& r;
    ~Done() {
      std::lock_guard<std::mutex> l(r.mu);
      if (--r.running == 0) r.idle.notify_all();
    }
  } done{r};
  for (auto& [id, wait] : fences) wait();
}

}  // namespace tdist::detail
