#include <condition_variable>
#include <mutex>

#include "store/kv.h"
#include "tdist/store.h"

namespace tdist {

struct HashStore::State {
  std::mutex mu;
  std::condition_variable changed;
  detail::KeyValueMap map;

  // Waits (mu held through lock) until every key exists.
  void wait_for(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                Milliseconds timeout, const char* op) {
    if (!changed.wait_for(lock, timeout, [&] { return map.contains_all(keys); })) {
      throw TimeoutError(detail::store_timeout_message("HashStore", op, map.missing(keys),
                                                       timeout.count()));
    }
  }
};

HashStore::HashStore(Milliseconds timeout) : Store(timeout), state_(std::make_unique<State>()) {}
HashStore::~HashStore() = default;

void HashStore::do_set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->map.set(key, value);
  }
  state_->changed.notify_all();
}

std::vector<Bytes> HashStore::do_get(const std::vector<std::string>& keys, Milliseconds timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->wait_for(lock, keys, timeout, keys.size() == 1 ? "get" : "multi_get");
  return state_->map.values(keys);
}

int64_t HashStore::do_add(const std::string& key, int64_t delta) {
  int64_t result;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    result = state_->map.add(key, delta);
  }
  state_->changed.notify_all();
  return result;
}

Bytes HashStore::do_compare_set(const std::string& key, const Bytes& expected,
                                const Bytes& desired) {
  Bytes result;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    result = state_->map.compare_set(key, expected, desired);
  }
  state_->changed.notify_all();
  return result;
}

void HashStore::do_wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->wait_for(lock, keys, timeout, "wait");
}

bool HashStore::do_check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->map.contains_all(keys);
}

bool HashStore::do_delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->map.erase(key);
}

int64_t HashStore::do_num_keys() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return static_cast<int64_t>(state_->map.size());
}

void HashStore::do_multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (size_t i = 0; i < keys.size(); ++i) state_->map.set(keys[i], values[i]);
  }
  state_->changed.notify_all();
}

}  // namespace tdist
