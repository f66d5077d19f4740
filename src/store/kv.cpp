#include "store/kv.h"

#include <limits>

#include "util/env.h"

namespace tdist::detail {

int64_t KeyValueMap::add(const std::string& key, int64_t delta) {
  int64_t current = 0;
  auto it = map_.find(key);
  if (it != map_.end()) {
    const std::string text(it->second.begin(), it->second.end());
    auto parsed = parse_int(text);
    if (!parsed) {
      throw StoreError("Store::add: key '" + key + "' holds a value that is not an integer (" +
                       std::to_string(text.size()) + " bytes); add only works on counters");
    }
    current = *parsed;
  }
  int64_t next = 0;
  if (__builtin_add_overflow(current, delta, &next)) {
    throw StoreError("Store::add: key '" + key + "' would overflow int64 (" +
                     std::to_string(current) + " + " + std::to_string(delta) + ")");
  }
  std::string text = std::to_string(next);
  map_[key] = Bytes(text.begin(), text.end());
  return next;
}

Bytes KeyValueMap::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  auto it = map_.find(key);
  if (it == map_.end()) {
    if (!expected.empty()) return {};
    map_[key] = desired;
    return desired;
  }
  if (it->second == expected) it->second = desired;
  return it->second;
}

bool KeyValueMap::contains_all(const std::vector<std::string>& keys) const {
  for (const auto& k : keys) {
    if (map_.find(k) == map_.end()) return false;
  }
  return true;
}

std::vector<std::string> KeyValueMap::missing(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  for (const auto& k : keys) {
    if (map_.find(k) == map_.end()) out.push_back(k);
  }
  return out;
}

std::vector<Bytes> KeyValueMap::values(const std::vector<std::string>& keys) const {
  std::vector<Bytes> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(map_.at(k));
  return out;
}

std::string store_timeout_message(const std::string& store, const char* op,
                                  const std::vector<std::string>& missing, int64_t waited_ms) {
  std::string msg = store + "::" + op + " timed out after " + format_duration_ms(waited_ms) +
                    " waiting for key";
  if (missing.size() != 1) msg += "s";
  msg += " ";
  const size_t shown = std::min<size_t>(missing.size(), 8);
  for (size_t i = 0; i < shown; ++i) {
    if (i) msg += ", ";
    msg += "'" + missing[i] + "'";
  }
  if (missing.size() > shown) msg += " and " + std::to_string(missing.size() - shown) + " more";
  msg += ". Is every rank running and using the same store? Raise the timeout if they are slow to start.";
  return msg;
}

}  // namespace tdist::detail
