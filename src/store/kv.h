// KeyValueMap: the semantics every store shares (set, add, compare_set,
// lookups), written once. Not thread-safe: each store guards it its own way
// (a mutex, a file lock, the server's single event-loop thread).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "tdist/store.h"

namespace tdist::detail {

class KeyValueMap {
 public:
  void set(const std::string& key, Bytes value) { map_[key] = std::move(value); }

  // The new counter value; StoreError if the stored value is not an integer.
  int64_t add(const std::string& key, int64_t delta);

  // See Store::compare_set.
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired);

  bool erase(const std::string& key) { return map_.erase(key) > 0; }
  const Bytes* find(const std::string& key) const {
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : &it->second;
  }
  bool contains_all(const std::vector<std::string>& keys) const;
  std::vector<std::string> missing(const std::vector<std::string>& keys) const;
  // Values of keys, all of which must exist.
  std::vector<Bytes> values(const std::vector<std::string>& keys) const;
  size_t size() const { return map_.size(); }
  void clear() { map_.clear(); }

 private:
  std::unordered_map<std::string, Bytes> map_;
};

// The message of a TimeoutError raised by a blocking store call.
std::string store_timeout_message(const std::string& store, const char* op,
                                  const std::vector<std::string>& missing,
                                  int64_t waited_ms);

}  // namespace tdist::detail
