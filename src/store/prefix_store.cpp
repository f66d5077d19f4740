#include "tdist/store.h"

namespace tdist {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : Store(store ? store->timeout() : kDefaultStoreTimeout),
      prefix_(std::move(prefix)),
      store_(std::move(store)) {
  if (!store_) throw UsageError("PrefixStore: the underlying store must not be null");
  if (prefix_.empty()) throw UsageError("PrefixStore: the prefix must not be empty");
}

std::vector<std::string> PrefixStore::full(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(full(k));
  return out;
}

void PrefixStore::do_set(const std::string& key, const Bytes& value) { store_->set(full(key), value); }

std::vector<Bytes> PrefixStore::do_get(const std::vector<std::string>& keys, Milliseconds timeout) {
  return store_->multi_get(full(keys), timeout);
}

int64_t PrefixStore::do_add(const std::string& key, int64_t delta) {
  return store_->add(full(key), delta);
}

Bytes PrefixStore::do_compare_set(const std::string& key, const Bytes& expected,
                                  const Bytes& desired) {
  return store_->compare_set(full(key), expected, desired);
}

void PrefixStore::do_wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  store_->wait(full(keys), timeout);
}

bool PrefixStore::do_check(const std::vector<std::string>& keys) { return store_->check(full(keys)); }

bool PrefixStore::do_delete_key(const std::string& key) { return store_->delete_key(full(key)); }

int64_t PrefixStore::do_num_keys() { return store_->num_keys(); }

void PrefixStore::do_multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  store_->multi_set(full(keys), values);
}

}  // namespace tdist
