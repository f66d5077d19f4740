// The non-virtual front of Store: argument checks and default timeouts, in
// one place, so that implementations only see valid requests.
#include "tdist/store.h"

#include <string>

namespace tdist {

namespace {

void check_key(const char* op, const std::string& key) {
  if (key.empty()) throw UsageError(std::string("Store::") + op + ": the key must not be empty");
}

void check_keys(const char* op, const std::vector<std::string>& keys) {
  for (const auto& k : keys) check_key(op, k);
}

void check_timeout(const char* op, Milliseconds timeout) {
  if (timeout.count() <= 0) {
    throw UsageError(std::string("Store::") + op + ": the timeout must be positive, got " +
                     std::to_string(timeout.count()) + " ms");
  }
}

}  // namespace

Bytes to_bytes(std::string_view s) { return Bytes(s.begin(), s.end()); }
std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

Store::Store(Milliseconds timeout) : timeout_ms_(timeout.count()) { check_timeout("Store", timeout); }
Store::~Store() = default;

void Store::set_timeout(Milliseconds timeout) {
  check_timeout("set_timeout", timeout);
  timeout_ms_.store(timeout.count(), std::memory_order_relaxed);
}

void Store::set(const std::string& key, const Bytes& value) {
  check_key("set", key);
  do_set(key, value);
}

void Store::set(const std::string& key, std::string_view value) { set(key, to_bytes(value)); }

Bytes Store::get(const std::string& key) { return get(key, timeout()); }

Bytes Store::get(const std::string& key, Milliseconds timeout) {
  check_key("get", key);
  check_timeout("get", timeout);
  auto values = do_get({key}, timeout);
  return std::move(values.at(0));
}

std::string Store::get_string(const std::string& key) { return to_string(get(key)); }

int64_t Store::add(const std::string& key, int64_t delta) {
  check_key("add", key);
  return do_add(key, delta);
}

Bytes Store::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  check_key("compare_set", key);
  return do_compare_set(key, expected, desired);
}

void Store::wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

void Store::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  check_keys("wait", keys);
  check_timeout("wait", timeout);
  if (keys.empty()) return;
  do_wait(keys, timeout);
}

bool Store::check(const std::vector<std::string>& keys) {
  check_keys("check", keys);
  if (keys.empty()) return true;
  return do_check(keys);
}

bool Store::delete_key(const std::string& key) {
  check_key("delete_key", key);
  return do_delete_key(key);
}

int64_t Store::num_keys() { return do_num_keys(); }

std::vector<Bytes> Store::multi_get(const std::vector<std::string>& keys) {
  return multi_get(keys, timeout());
}

std::vector<Bytes> Store::multi_get(const std::vector<std::string>& keys, Milliseconds timeout) {
  check_keys("multi_get", keys);
  check_timeout("multi_get", timeout);
  if (keys.empty()) return {};
  return do_get(keys, timeout);
}

void Store::multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  check_keys("multi_set", keys);
  if (keys.size() != values.size()) {
    throw UsageError("Store::multi_set: got " + std::to_string(keys.size()) + " keys but " +
                     std::to_string(values.size()) + " values");
  }
  if (keys.empty()) return;
  do_multi_set(keys, values);
}

}  // namespace tdist
