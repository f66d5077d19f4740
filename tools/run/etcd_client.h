// A client of etcd's v3 API through its JSON gateway (etcd 3.4 and later:
// POST /v3/kv/range, /v3/kv/put, /v3/kv/txn, /v3/lease/grant,
// /v3/lease/keepalive), over plain HTTP/1.1, one connection per request:
// only what tdist-run's rendezvous needs (run/rdzv_store.h).
//
// Several endpoints, members of one cluster. A request goes to the member
// that answered last; when that one cannot be reached, does not answer
// within the request timeout, or answers with a server error (a member cut
// off from its cluster's quorum times out its requests, or says "no
// leader"), the next one is tried, round the list, until the operation's
// deadline. Then NetworkError (or TimeoutError) names every endpoint and
// what each last said. A request may have been applied even though its
// answer was lost; callers make their writes safe to repeat.
//
// Bounded: an answer is at most 1 MiB and is read before its deadline;
// its JSON goes through the bounded reader; keys and values are bytes
// (base64 in the JSON, decoded strictly). Nothing read is executed.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tdist_run {

struct EtcdEndpoint {
  std::string host;
  int port = 2379;
};

// "h1:2379,h2:2379,[::1]:2379" (an "http://" before each is allowed;
// "https://" is refused: this client speaks plain HTTP). Raises
// tdist::UsageError naming what is wrong.
std::vector<EtcdEndpoint> parse_etcd_endpoints(const std::string& text);

std::string base64_encode(const std::string& bytes);
// nullopt when `text` is not strict base64 (RFC 4648, with padding).
std::optional<std::string> base64_decode(const std::string& text);

struct EtcdValue {
  std::string value;
  int64_t mod_revision = 0;
};

struct EtcdTimeouts {
  // One request to one member (connect, send, answer).
  std::chrono::milliseconds request{3000};
  // One operation, across the members, retries included.
  std::chrono::milliseconds op{10'000};
};

class EtcdClient {
 public:
  EtcdClient(std::vector<EtcdEndpoint> endpoints, EtcdTimeouts timeouts);

  std::optional<EtcdValue> get(const std::string& key);
  // lease 0: none.
  void put(const std::string& key, const std::string& value, int64_t lease = 0);
  // Puts `value` if the key's mod revision is `revision` (0: the key is
  // absent). True when it did.
  bool put_if_revision(const std::string& key, const std::string& value, int64_t revision, int64_t lease = 0);
  // Puts `desired` if the key holds `expected` (nullopt: absent). Returns
  // what the key holds afterwards (nullopt: absent).
  std::optional<std::string> put_if_value(const std::string& key, const std::optional<std::string>& expected,
                                          const std::string& desired, int64_t lease = 0);
  // A lease of ttl_s seconds; its ID.
  int64_t grant_lease(int64_t ttl_s);
  // Renews a lease; false when it is gone (expired or revoked).
  bool keep_alive(int64_t lease);

  // "etcd at h1:2379,h2:2379".
  std::string describe() const;

 private:
  // POSTs body to path at the members in turn (see the header); the
  // answer's JSON object.
  nlohmann::json call(const std::string& path, const nlohmann::json& body);
  nlohmann::json call_one(const EtcdEndpoint& e, const std::string& path, const std::string& body,
                          std::chrono::steady_clock::time_point deadline);

  std::vector<EtcdEndpoint> endpoints_;
  EtcdTimeouts timeouts_;
  size_t current_ = 0;  // the member that answered last
};

}  // namespace tdist_run
