// The C ABI's stores (include/tdist/c/tdist.h): TCPStore and FileStore
// handles, and their set, get, add and wait.
#include <cstring>
#include <string>
#include <vector>

#include "c/c_core.h"

using namespace tdist;
using namespace tdist::c;

namespace {

Store& store_of(tdist_store* s) { return *live(s, "store")->store; }

std::string key_of(const char* key) {
  if (!key) usage("the key is NULL");
  return key;
}

Milliseconds store_timeout(int64_t ms) {
  const auto t = timeout_of(ms);
  return t ? *t : kDefaultStoreTimeout;
}

}  // namespace

extern "C" {

tdist_status tdist_tcp_store_new(const char* host, int port, int is_server, int num_workers, int64_t timeout_ms,
                                 tdist_store** out) {
  return guarded("tdist_tcp_store_new", [&] {
    out_check(out);
    if (!host || !*host) usage("the host is NULL or empty");
    if (port < 0 || port > 65535 || (port == 0 && !is_server)) {
      usage("port " + std::to_string(port) + " is not a port (0 only on the server: a free one)");
    }
    if (num_workers < 0) usage("num_workers is negative");
    TCPStoreOptions o;
    o.port = static_cast<uint16_t>(port);
    o.is_server = is_server != 0;
    if (num_workers > 0) o.num_workers = num_workers;
    o.wait_for_workers = num_workers > 0;
    o.timeout = store_timeout(timeout_ms);
    *out = handle(new tdist_store{std::make_shared<TCPStore>(host, o)});
  });
}

tdist_status tdist_file_store_new(const char* path, int64_t timeout_ms, tdist_store** out) {
  return guarded("tdist_file_store_new", [&] {
    out_check(out);
    if (!path || !*path) usage("the path is NULL or empty");
    *out = handle(new tdist_store{std::make_shared<FileStore>(path, store_timeout(timeout_ms))});
  });
}

tdist_status tdist_store_port(tdist_store* s, int* port) {
  return guarded("tdist_store_port", [&] {
    if (!port) usage("the output pointer is NULL");
    auto* tcp = dynamic_cast<TCPStore*>(&store_of(s));
    if (!tcp) usage("the store is not a TCPStore");
    *port = tcp->port();
  });
}

tdist_status tdist_store_set(tdist_store* s, const char* key, const void* value, size_t n) {
  return guarded("tdist_store_set", [&] {
    if (!value && n > 0) usage("the value is NULL");
    store_of(s).set(key_of(key), std::string_view(static_cast<const char*>(value), n));
  });
}

tdist_status tdist_store_get(tdist_store* s, const char* key, void* value, size_t cap, size_t* n, int64_t timeout_ms) {
  return guarded("tdist_store_get", [&] {
    if (!n) usage("the size pointer is NULL");
    *n = 0;
    Store& store = store_of(s);
    const auto t = timeout_of(timeout_ms);
    const Bytes v = t ? store.get(key_of(key), *t) : store.get(key_of(key));
    *n = v.size();
    if (v.size() > cap) usage("the value has " + std::to_string(v.size()) + " bytes; the buffer holds " + std::to_string(cap));
    if (!v.empty()) {
      if (!value) usage("the buffer is NULL");
      std::memcpy(value, v.data(), v.size());
    }
  });
}

tdist_status tdist_store_add(tdist_store* s, const char* key, int64_t delta, int64_t* result) {
  return guarded("tdist_store_add", [&] {
    const int64_t r = store_of(s).add(key_of(key), delta);
    if (result) *result = r;
  });
}

tdist_status tdist_store_wait(tdist_store* s, const char* const* keys, size_t n, int64_t timeout_ms) {
  return guarded("tdist_store_wait", [&] {
    Store& store = store_of(s);
    const auto list = names(keys, n, "keys");
    const auto t = timeout_of(timeout_ms);
    if (t) {
      store.wait(list, *t);
    } else {
      store.wait(list);
    }
  });
}

tdist_status tdist_store_free(tdist_store* s) {
  return guarded("tdist_store_free", [&] { release(s, "store"); });
}

}  // extern "C"
