// TCPStore: a client connection to a TCPStoreServer (and, on the master, the
// server itself). One request is in flight per connection; a mutex serialises
// the threads that share a TCPStore object.
#include <unistd.h>

#include <cstdlib>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

#include "store/auth.h"
#include "store/kv.h"
#include "store/socket.h"
#include "store/wire.h"
#include "tdist/store.h"
#include "util/env.h"

namespace tdist {

namespace {

using Clock = std::chrono::steady_clock;
using wire::Message;
using wire::Op;
using wire::Status;

// How much longer than the server's own timeout a client waits for a reply
// to get/wait, before it decides the server itself is gone.
constexpr Milliseconds kReplySlack{5000};

// What the server may send before it has proved it holds the token (its
// hello, its answer to our authentication): small, whoever is listening.
TCPStoreLimits handshake_reply_limits() {
  TCPStoreLimits l;
  l.max_key_bytes = 256;
  l.max_value_bytes = 4096;
  l.max_keys_per_request = 4;
  return l;
}

// Backoff between connection attempts: doubling from 10 ms to 500 ms, with
// jitter, so that ranks turned away together do not come back together.
Milliseconds next_pause(Milliseconds pause, std::minstd_rand& rng) {
  const auto doubled = std::min<int64_t>(pause.count() * 2, 500);
  return Milliseconds(doubled / 2 + static_cast<int64_t>(rng() % static_cast<uint64_t>(doubled / 2 + 1)));
}

}  // namespace

struct TCPStore::Impl {
  std::string host;
  uint16_t port = 0;
  std::string token;
  std::string client_name;
  std::unique_ptr<TCPStoreServer> server;
  // The connection (fd, inbuf) is one call's at a time: `busy`, under mu.
  // A call waits for it, behind another thread's call (a reconnect, a slow
  // reply), only as long as its own timeout allows. (A flag and a condition
  // variable rather than a timed mutex: ThreadSanitizer does not see
  // std::timed_mutex's timed lock.)
  std::mutex mu;
  std::condition_variable idle;
  bool busy = false;
  detail::Fd fd;        // invalid when not connected
  std::string inbuf;    // received bytes not yet parsed
  TCPStoreLimits reply_limits;

  std::string where() const { return host + ":" + std::to_string(port); }

  Message read_frame(Clock::time_point deadline, const char* op, const TCPStoreLimits* limits = nullptr) {
    char buf[64 * 1024];
    for (;;) {
      Message m;
      auto r = wire::parse_frame(reinterpret_cast<const uint8_t*>(inbuf.data()), inbuf.size(),
                                 limits ? *limits : reply_limits, /*is_request=*/false, &m);
      if (r.status == wire::ParseStatus::kOk) {
        inbuf.erase(0, r.consumed);
        return m;
      }
      if (r.status == wire::ParseStatus::kBad) {
        const std::string what = "TCPStore " + std::string(op) + ": the server at " + where() +
                                 " sent a malformed reply (" + r.error + ")";
        // In the handshake (limits given) that is no tdist server: a refusal for good.
        if (limits) throw StoreError(what + "; is something else listening on that port?");
        throw NetworkError(what);
      }
      size_t n = detail::recv_some(fd.get(), buf, sizeof buf, deadline);
      if (n == 0) {
        throw NetworkError("TCPStore " + std::string(op) + ": the server at " + where() +
                           " closed the connection");
      }
      inbuf.append(buf, n);
    }
  }

  // Throws the server's error message, if m is one.
  void raise_if_error(const Message& m, const char* op) {
    if (m.kind == static_cast<uint8_t>(Status::kError)) {
      std::string msg = m.values.empty() ? "unknown error" : to_string(m.values[0]);
      throw StoreError("TCPStore " + std::string(op) + " at " + where() + ": " + msg);
    }
  }

  // Connects and authenticates, retrying until deadline while the server
  // drops the connection during the handshake (a server with too many
  // connections, or one evicting unauthenticated ones under a flood, or one
  // restarting): TimeoutError past the deadline, naming the last failure.
  // A refusal for good (a wrong or missing token, another protocol) is
  // raised at once.
  void connect(Clock::time_point deadline) {
    std::minstd_rand rng(static_cast<unsigned>(getpid()) ^
                         static_cast<unsigned>(Clock::now().time_since_epoch().count()));
    Milliseconds pause{10};
    for (int attempt = 1;; ++attempt) {
      std::string failure;
      try {
        connect_once(deadline);
        return;
      } catch (const NetworkError& e) {
        failure = e.what();
      } catch (const StoreError& e) {
        if (std::string(e.what()).find(wire::kBusyReply) == std::string::npos) throw;
        failure = e.what();
      }
      const auto now = Clock::now();
      if (now + pause >= deadline) {
        throw TimeoutError("TCPStore: could not complete the handshake with the server at " + where() +
                           " before the timeout, in " + std::to_string(attempt) +
                           " attempt(s); the last failed with: " + failure);
      }
      std::this_thread::sleep_for(pause);
      pause = next_pause(pause, rng);
    }
  }

  // One attempt of connect().
  void connect_once(Clock::time_point deadline) {
    inbuf.clear();
    fd = detail::connect_tcp(host, port, deadline);
    const TCPStoreLimits small = handshake_reply_limits();
    try {
      Message hello = read_frame(deadline, "connect", &small);
      raise_if_error(hello, "connect");
      if (hello.kind != static_cast<uint8_t>(Status::kHello) ||
          (hello.number & 0xffffffff) != wire::kProtocolVersion) {
        throw StoreError("TCPStore: the server at " + where() +
                         " speaks another protocol (is it a tdist TCPStore of the same version?)");
      }
      const bool server_wants_auth = (hello.number & wire::kHelloAuthRequired) != 0;
      if (server_wants_auth && token.empty()) {
        throw StoreError("TCPStore: the server at " + where() +
                         " requires a token and this process has none: it belongs to a job started with one "
                         "(tdist-run gives every job its own), perhaps another job on the same port. Set "
                         "TDIST_STORE_TOKEN or TDIST_STORE_TOKEN_FILE to the job's token");
      }
      if (!server_wants_auth && !token.empty()) {
        throw StoreError("TCPStore: TDIST_STORE_TOKEN is set but the server at " + where() +
                         " does not authenticate clients; refusing to talk to it");
      }
      if (server_wants_auth) {
        if (hello.values.size() != 1 || hello.values[0].size() != wire::kNonceBytes) {
          throw StoreError("TCPStore: malformed authentication challenge from " + where());
        }
        Message auth;
        auth.kind = static_cast<uint8_t>(Op::kAuth);
        Bytes client_nonce = detail::random_nonce();
        auth.values = {client_nonce, detail::client_mac(token, hello.values[0], client_nonce)};
        if (!client_name.empty()) auth.values.push_back(to_bytes(client_name.substr(0, 200)));
        std::string frame;
        wire::encode_frame(auth, &frame);
        detail::send_all(fd.get(), frame.data(), frame.size(), deadline);
        Message ok = read_frame(deadline, "authenticate", &small);
        raise_if_error(ok, "authenticate");
        if (ok.values.size() != 1 ||
            !detail::macs_equal(ok.values[0], detail::server_mac(token, hello.values[0], client_nonce))) {
          throw StoreError("TCPStore: the server at " + where() +
                           " could not prove it holds the same TDIST_STORE_TOKEN");
        }
      }
    } catch (...) {
      fd.reset();
      throw;
    }
  }

  // Sends one request and returns its reply. `wait_budget` is how long the
  // server may legitimately take (get/wait); the store timeout bounds the rest.
  Message request(const Message& req, Milliseconds store_timeout, Milliseconds wait_budget) {
    const char* op = wire::op_name(req.kind);
    // A call with its own timeout (get/wait) is bounded by it while it waits
    // for the connection and while it reconnects; the others by the store's
    // timeout. (The heartbeat's set may hold the connection for a whole
    // store timeout while the server is out of reach; a rank asking with a
    // short timeout which peers stopped beating must not wait behind it.)
    const auto connected_by = Clock::now() + (wait_budget.count() > 0 ? wait_budget : store_timeout);
    {
      std::unique_lock<std::mutex> lock(mu);
      if (!idle.wait_until(lock, connected_by, [this] { return !busy; })) {
        throw TimeoutError("TCPStore " + std::string(op) + ": the connection to the server at " + where() +
                           " stayed busy with another call (a reconnect or a slow reply) past this call's timeout");
      }
      busy = true;
    }
    struct GiveBack {
      Impl& impl;
      ~GiveBack() {
        {
          std::lock_guard<std::mutex> lock(impl.mu);
          impl.busy = false;
        }
        impl.idle.notify_one();
      }
    } give_back{*this};
    if (!fd.valid()) connect(connected_by);
    std::string frame;
    wire::encode_frame(req, &frame);
    const auto deadline = Clock::now() + store_timeout + wait_budget + (wait_budget.count() ? kReplySlack : Milliseconds(0));
    try {
      detail::send_all(fd.get(), frame.data(), frame.size(), deadline);
      Message m = read_frame(deadline, op);
      raise_if_error(m, op);
      return m;
    } catch (const NetworkError& e) {
      fd.reset();  // the next call reconnects
      throw NetworkError(std::string(e.what()) + " (during " + op + "; the next call will reconnect)");
    } catch (const TimeoutError& e) {
      // A reply may still arrive later; this connection is out of step.
      fd.reset();
      throw TimeoutError("TCPStore " + std::string(op) + ": no reply from the server at " + where() +
                         " within the timeout; is the server alive? (" + e.what() + ")");
    }
  }
};

TCPStore::TCPStore(std::string host, TCPStoreOptions options)
    : Store(options.timeout), impl_(std::make_unique<Impl>()) {
  impl_->host = std::move(host);
  impl_->port = options.port;
  impl_->token = detail::resolve_token(options.token);
  impl_->client_name = options.client_name;
  // Replies may carry up to a whole multi_get; be generous, but bounded.
  impl_->reply_limits.max_value_bytes = size_t(4) << 30;
  impl_->reply_limits.max_keys_per_request = size_t(1) << 24;
  if (options.num_workers && *options.num_workers < 1) {
    throw UsageError("TCPStore: num_workers must be at least 1, got " + std::to_string(*options.num_workers));
  }
  if (options.is_server) {
    TCPStoreServerOptions so;
    so.host = impl_->host;
    if (const char* bind = std::getenv("TDIST_STORE_BIND"); bind && *bind) so.host = bind;
    if (options.bind_address) so.host = *options.bind_address;
    so.port = options.port;
    so.token = impl_->token;
    so.limits = options.limits;
    impl_->server = std::make_unique<TCPStoreServer>(so);
    impl_->port = impl_->server->port();
  }
  impl_->connect(Clock::now() + options.timeout);  // no other thread has this store yet
  if (impl_->server && options.num_workers && options.wait_for_workers) {
    impl_->server->wait_for_clients(*options.num_workers, options.timeout);
  }
}

TCPStore::~TCPStore() {
  impl_->fd.reset();  // no call may be running: the store is being destroyed
  impl_->server.reset();
}

const std::string& TCPStore::host() const { return impl_->host; }
uint16_t TCPStore::port() const { return impl_->port; }
TCPStoreServer* TCPStore::server() const { return impl_->server.get(); }

namespace {

Message make(Op op, std::vector<std::string> keys = {}, std::vector<Bytes> values = {}, int64_t number = 0) {
  Message m;
  m.kind = static_cast<uint8_t>(op);
  m.keys = std::move(keys);
  m.values = std::move(values);
  m.number = number;
  return m;
}

}  // namespace

void TCPStore::do_set(const std::string& key, const Bytes& value) {
  impl_->request(make(Op::kSet, {key}, {value}), timeout(), Milliseconds(0));
}

std::vector<Bytes> TCPStore::do_get(const std::vector<std::string>& keys, Milliseconds t) {
  Message r = impl_->request(make(Op::kGet, keys, {}, t.count()), timeout(), t);
  if (r.kind == static_cast<uint8_t>(Status::kTimeout)) {
    std::vector<std::string> missing;
    for (const auto& v : r.values) missing.push_back(to_string(v));
    throw TimeoutError(detail::store_timeout_message("TCPStore", keys.size() == 1 ? "get" : "multi_get",
                                                     missing, t.count()));
  }
  if (r.values.size() != keys.size()) {
    throw NetworkError("TCPStore get: the server at " + impl_->where() + " sent " +
                       std::to_string(r.values.size()) + " values for " + std::to_string(keys.size()) + " keys");
  }
  return std::move(r.values);
}

int64_t TCPStore::do_add(const std::string& key, int64_t delta) {
  return impl_->request(make(Op::kAdd, {key}, {}, delta), timeout(), Milliseconds(0)).number;
}

Bytes TCPStore::do_compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  Message r = impl_->request(make(Op::kCompareSet, {key}, {expected, desired}), timeout(), Milliseconds(0));
  if (r.values.size() != 1) throw NetworkError("TCPStore compare_set: malformed reply from " + impl_->where());
  return std::move(r.values[0]);
}

void TCPStore::do_wait(const std::vector<std::string>& keys, Milliseconds t) {
  Message r = impl_->request(make(Op::kWait, keys, {}, t.count()), timeout(), t);
  if (r.kind == static_cast<uint8_t>(Status::kTimeout)) {
    std::vector<std::string> missing;
    for (const auto& v : r.values) missing.push_back(to_string(v));
    throw TimeoutError(detail::store_timeout_message("TCPStore", "wait", missing, t.count()));
  }
}

bool TCPStore::do_check(const std::vector<std::string>& keys) {
  return impl_->request(make(Op::kCheck, keys), timeout(), Milliseconds(0)).number != 0;
}

bool TCPStore::do_delete_key(const std::string& key) {
  return impl_->request(make(Op::kDelete, {key}), timeout(), Milliseconds(0)).number != 0;
}

int64_t TCPStore::do_num_keys() {
  return impl_->request(make(Op::kNumKeys), timeout(), Milliseconds(0)).number;
}

void TCPStore::do_multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  impl_->request(make(Op::kMultiSet, keys, values), timeout(), Milliseconds(0));
}

}  // namespace tdist
