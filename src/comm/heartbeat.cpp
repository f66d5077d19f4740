#include "comm/heartbeat.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "util/env.h"

namespace tdist::comm {

namespace {
constexpr std::chrono::milliseconds kBeat{250};
}

struct Heartbeat::State {
  std::shared_ptr<Store> store;
  std::string key;
  std::atomic<uint64_t> started{0};
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::promise<void> exited;
};

Heartbeat::Heartbeat(std::shared_ptr<Store> store, int rank, int size, std::vector<int> global_ranks)
    : state_(std::make_shared<State>()), rank_(rank), size_(size), global_ranks_(std::move(global_ranks)) {
  state_->store = std::move(store);
  state_->key = "hb/" + std::to_string(rank);
  exited_ = state_->exited.get_future();
  std::thread([s = state_] {
    int64_t n = 0;
    std::unique_lock<std::mutex> lock(s->mu);
    while (!s->stopping) {
      lock.unlock();
      try {
        s->store->set(s->key, std::to_string(++n) + ":" + std::to_string(s->started.load()));
      } catch (const std::exception&) {
        // The store may be gone with its host; dead_ranks() deals with it.
      }
      lock.lock();
      s->cv.wait_for(lock, kBeat, [&] { return s->stopping; });
    }
    s->exited.set_value();
  }).detach();
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
  }
  state_->cv.notify_all();
  exited_.wait_for(std::chrono::seconds(1));
}

void Heartbeat::set_ops_started(uint64_t n) { state_->started.store(n, std::memory_order_relaxed); }

std::vector<std::pair<int64_t, int64_t>> Heartbeat::read() {
  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) keys.push_back("hb/" + std::to_string(r));
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& v : state_->store->multi_get(keys, std::chrono::milliseconds(2000))) {
    const std::string s = to_string(v);
    const size_t colon = s.find(':');
    out.emplace_back(detail::parse_int(s.substr(0, colon)).value_or(-1),
                     colon == std::string::npos ? -1 : detail::parse_int(s.substr(colon + 1)).value_or(-1));
  }
  return out;
}

std::string Heartbeat::names(const std::vector<int>& group_ranks) const {
  std::string out;
  for (int r : group_ranks) {
    const int g = r < static_cast<int>(global_ranks_.size()) ? global_ranks_[r] : r;
    out += (out.empty() ? "" : ", ") + std::to_string(g);
  }
  return out;
}

std::string Heartbeat::describe(const std::vector<int>& group_ranks) const {
  return (group_ranks.size() == 1 ? "rank " : "ranks ") + names(group_ranks);
}

std::string Heartbeat::missing_ranks(uint64_t seq) {
  try {
    const auto beats = read();
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (beats[r].second <= static_cast<int64_t>(seq)) missing.push_back(r);
    }
    if (missing.empty()) return "every rank had started it";
    return "rank(s) " + names(missing) + " never arrived";
  } catch (const std::exception&) {
    return "the store is unreachable, so the missing ranks are unknown";
  }
}

std::vector<int> Heartbeat::dead_ranks() {
  std::vector<int> dead;
  try {
    const auto before = read();
    std::this_thread::sleep_for(kBeat * 4);
    const auto after = read();
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && after[r].first == before[r].first) dead.push_back(r);
    }
  } catch (const std::exception&) {
    // The store is unreachable: its host, group rank 0, is the likely loss.
    if (rank_ != 0) dead.push_back(0);
  }
  return dead;
}

}  // namespace tdist::comm
