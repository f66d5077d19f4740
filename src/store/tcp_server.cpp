// TCPStoreServer: one event-loop thread (epoll) serving every client.
//
// All store state is owned by the loop thread; no locks guard it. A client
// that blocks in get/wait parks its connection (no further frames of that
// connection are read into requests) until the keys arrive or its deadline
// passes; every other connection keeps being served. A bad frame, an
// oversized request, a failed handshake or a client that stops reading its
// replies closes that one connection.
//
// With a token, a connection is untrusted until it authenticates: it may
// send only a few small frames (TCPStoreLimits::max_handshake_bytes), must
// authenticate within handshake_timeout, and at most max_handshaking such
// connections are kept. Past that, the oldest connection of the peer that
// holds the most of them goes (a peer: the uid owning the client's socket
// when it is on this machine, else the client's address; see store/peer.h),
// so a flood from another user or host evicts its own connections, never
// the job's ranks. A refused client is logged, with its address and how it
// described itself.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "store/auth.h"
#include "store/kv.h"
#include "store/peer.h"
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

struct Waiter {
  uint8_t op = 0;  // kGet or kWait
  std::vector<std::string> keys;
  Clock::time_point deadline;
  uint64_t seq = 0;  // distinguishes this wait from later ones on the conn
};

struct Conn {
  detail::Fd fd;
  uint64_t id = 0;
  std::string peer;    // the client's address, for the refusal log
  std::string peer_key;  // who it is, for fairness before authentication (store/peer.h)
  std::string in;      // bytes received, not yet parsed
  std::string out;     // bytes to send
  size_t out_pos = 0;
  bool authed = false;
  bool close_after_flush = false;
  bool want_write = false;  // EPOLLOUT registered
  Bytes server_nonce;
  std::optional<Waiter> waiting;
  uint64_t wait_seq = 0;
};

// A client's self-description, made safe to print.
std::string printable(const Bytes& b) {
  std::string s;
  for (size_t i = 0; i < b.size() && i < 200; ++i) {
    const char ch = static_cast<char>(b[i]);
    s.push_back(ch >= 32 && ch < 127 ? ch : '?');
  }
  return s;
}

Message reply(Status s) {
  Message m;
  m.kind = static_cast<uint8_t>(s);
  return m;
}

Message error_reply(const std::string& what) {
  Message m = reply(Status::kError);
  m.values.push_back(to_bytes(what));
  return m;
}

std::string address_of(const sockaddr_storage& a) {
  char text[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (a.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(a);
    inet_ntop(AF_INET, &v4.sin_addr, text, sizeof text);
    port = ntohs(v4.sin_port);
    return std::string(text) + ":" + std::to_string(port);
  }
  if (a.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
    inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof text);
    port = ntohs(v6.sin6_port);
  }
  return "[" + std::string(text) + "]:" + std::to_string(port);
}

// What an unauthenticated client may send: one auth frame, small.
TCPStoreLimits handshake_limits(const TCPStoreLimits& l) {
  TCPStoreLimits h = l;
  h.max_key_bytes = 256;
  h.max_value_bytes = l.max_handshake_bytes;
  h.max_keys_per_request = 4;
  return h;
}

// Refusals logged to stderr before the log goes quiet (all are counted).
constexpr int kLoggedRefusals = 20;
constexpr size_t kKeptRefusals = 16;

}  // namespace

struct TCPStoreServer::Impl {
  TCPStoreServerOptions options;
  std::string token;
  detail::Fd listen_fd;
  detail::Fd epoll_fd;
  detail::Fd wake_fd;
  uint16_t port = 0;
  std::thread loop_thread;
  std::atomic<bool> stopping{false};

  // Loop-thread state.
  detail::KeyValueMap map;
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> conns;
  std::unordered_map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> waiters_by_key;
  std::multimap<Clock::time_point, std::pair<uint64_t, uint64_t>> deadlines;
  uint64_t next_id = 1;
  // Connections still to authenticate, oldest first, with their deadlines,
  // and the same grouped by peer (PeerIdentifier::key).
  std::map<uint64_t, Clock::time_point> handshaking;
  std::unordered_map<std::string, std::set<uint64_t>> handshaking_by_peer;
  detail::PeerIdentifier peers;
  // Held open so that, out of descriptors, the server can still accept a
  // connection to close it (rather than spin on a listen socket that stays
  // readable).
  detail::Fd spare_fd{::open("/dev/null", O_RDONLY | O_CLOEXEC)};
  TCPStoreLimits pre_auth_limits;
  int64_t refusals = 0;

  // Shared with refused_clients().
  mutable std::mutex refused_mu;
  std::deque<std::string> refused;

  // Shared with wait_for_clients().
  mutable std::mutex joined_mu;
  mutable std::condition_variable joined_cv;
  int64_t joined = 0;

  void note_joined() {
    {
      std::lock_guard<std::mutex> lock(joined_mu);
      ++joined;
    }
    joined_cv.notify_all();
  }

  void epoll_set(Conn& c, bool add) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | (c.want_write ? uint32_t(EPOLLOUT) : 0u);
    ev.data.u64 = c.id;
    epoll_ctl(epoll_fd.get(), add ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, c.fd.get(), &ev);
  }

  void end_handshake(uint64_t id, const std::string& peer_key) {
    if (handshaking.erase(id) == 0) return;
    auto it = handshaking_by_peer.find(peer_key);
    if (it == handshaking_by_peer.end()) return;
    it->second.erase(id);
    if (it->second.empty()) handshaking_by_peer.erase(it);
  }

  // Over max_handshaking: drops the oldest unauthenticated connection of
  // the peer holding the most (ties: the peer with the oldest). A job's
  // ranks, a handful per peer, are never the ones a flood displaces.
  void evict_one_handshaking() {
    const std::set<uint64_t>* victim = nullptr;
    for (const auto& [key, ids] : handshaking_by_peer) {
      if (!victim || ids.size() > victim->size() ||
          (ids.size() == victim->size() && *ids.begin() < *victim->begin())) {
        victim = &ids;
      }
    }
    if (victim) close_conn(*victim->begin());
  }

  void close_conn(uint64_t id) {
    auto it = conns.find(id);
    if (it == conns.end()) {
      handshaking.erase(id);
      return;
    }
    end_handshake(id, it->second->peer_key);
    epoll_ctl(epoll_fd.get(), EPOLL_CTL_DEL, it->second->fd.get(), nullptr);
    conns.erase(it);  // waiters naming it are skipped as stale
  }

  // Queues m and tries to send at once. Returns false if the conn was closed.
  bool send(Conn& c, const Message& m) {
    wire::encode_frame(m, &c.out);
    if (c.out.size() - c.out_pos > options.limits.max_pending_reply_bytes) {
      close_conn(c.id);
      return false;
    }
    return flush(c);
  }

  bool flush(Conn& c) {
    while (c.out_pos < c.out.size()) {
      ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_pos, c.out.size() - c.out_pos,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out_pos += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      close_conn(c.id);
      return false;
    }
    if (c.out_pos == c.out.size()) {
      c.out.clear();
      c.out_pos = 0;
      if (c.close_after_flush) {
        close_conn(c.id);
        return false;
      }
    } else if (c.out_pos > (1u << 20)) {
      c.out.erase(0, c.out_pos);
      c.out_pos = 0;
    }
    const bool need_write = !c.out.empty();
    if (need_write != c.want_write) {
      c.want_write = need_write;
      epoll_set(c, false);
    }
    return true;
  }

  // Sends a final error and closes once it is flushed.
  void refuse(Conn& c, const std::string& why) {
    c.close_after_flush = true;
    c.in.clear();
    send(c, error_reply(why));
  }

  // Logs and remembers a client refused for its token.
  void note_refused(const Conn& c, const std::string& who, const std::string& why) {
    const std::string entry = c.peer + (who.empty() ? "" : " (" + who + ")");
    {
      std::lock_guard<std::mutex> lock(refused_mu);
      refused.push_back(entry + ": " + why);
      if (refused.size() > kKeptRefusals) refused.pop_front();
    }
    if (++refusals <= kLoggedRefusals) {
      std::fprintf(stderr, "tdist TCPStore server on port %u: refused %s: %s%s\n", static_cast<unsigned>(port),
                   entry.c_str(), why.c_str(),
                   refusals == kLoggedRefusals ? " (further refusals are not logged)" : "");
    }
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t addr_len = sizeof addr;
      int fd = ::accept4(listen_fd.get(), reinterpret_cast<sockaddr*>(&addr), &addr_len,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if ((errno == EMFILE || errno == ENFILE) && !handshaking.empty()) {
          evict_one_handshaking();  // make room, then take the waiting one
          continue;
        }
        if ((errno == EMFILE || errno == ENFILE) && spare_fd.valid()) {
          // Nothing to evict: accept the waiting connection only to close
          // it (its client retries), so the loop does not spin on it.
          spare_fd.reset();
          const int doomed = ::accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC);
          if (doomed >= 0) ::close(doomed);
          spare_fd.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
          continue;
        }
        if (errno == EMFILE || errno == ENFILE) {
          // No spare either (the reopen above lost the descriptor): the
          // listening socket stays readable, so pause rather than spin, and
          // try to get the spare back.
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          spare_fd.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
        }
        return;  // EAGAIN: try again on the next event
      }
      detail::set_nodelay(fd);
      auto c = std::make_unique<Conn>();
      c->fd.reset(fd);
      c->id = next_id++;
      c->peer = address_of(addr);
      if (!token.empty()) {
        sockaddr_storage local{};
        socklen_t local_len = sizeof local;
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len);
        c->peer_key = peers.key(addr, local);
      }
      Conn& conn = *c;
      conns.emplace(conn.id, std::move(c));
      epoll_set(conn, true);
      if (conns.size() > options.limits.max_connections) {
        refuse(conn, std::string(wire::kBusyReply) + " (limit " +
                         std::to_string(options.limits.max_connections) + ")");
        continue;
      }
      Message hello = reply(Status::kHello);
      hello.number = wire::kProtocolVersion;
      if (!token.empty()) {
        hello.number |= wire::kHelloAuthRequired;
        conn.server_nonce = detail::random_nonce();
        hello.values.push_back(conn.server_nonce);
        handshaking.emplace(conn.id, Clock::now() + options.limits.handshake_timeout);
        handshaking_by_peer[conn.peer_key].insert(conn.id);
        const uint64_t id = conn.id;  // conn may be the one evicted
        while (handshaking.size() > std::max<size_t>(options.limits.max_handshaking, 1)) evict_one_handshaking();
        if (!conns.count(id)) continue;
      } else {
        conn.authed = true;
        note_joined();
      }
      send(conn, hello);
    }
  }

  void read_from(Conn& c) {
    char buf[64 * 1024];
    for (;;) {
      ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        c.in.append(buf, static_cast<size_t>(n));
        if (!c.authed && c.in.size() > options.limits.max_handshake_bytes) break;  // refused below
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      // End of stream or error: the client left (possibly mid-request).
      close_conn(c.id);
      return;
    }
    if (!c.authed && c.in.size() > options.limits.max_handshake_bytes) {
      refuse(c, "TCPStore server: too much data before authenticating");
      return;
    }
    // An honest client sends nothing while it waits for a reply; bytes piling
    // up behind a parked request are a misbehaving client.
    if (c.waiting && c.in.size() > options.limits.max_value_bytes + (size_t(16) << 20)) {
      refuse(c, "TCPStore server: too much data sent while a request was waiting");
      return;
    }
    process(c);
  }

  // Handles every complete frame of c, in order, until c parks on a wait.
  void process(Conn& c) {
    size_t pos = 0;
    const uint64_t id = c.id;
    while (!c.waiting && !c.close_after_flush) {
      Message m;
      auto r = wire::parse_frame(reinterpret_cast<const uint8_t*>(c.in.data()) + pos,
                                 c.in.size() - pos, c.authed ? options.limits : pre_auth_limits,
                                 /*is_request=*/true, &m);
      if (r.status == wire::ParseStatus::kNeedMore) break;
      if (r.status == wire::ParseStatus::kBad) {
        refuse(c, "TCPStore server: bad request: " + r.error);
        return;
      }
      pos += r.consumed;
      if (!handle(c, m)) return;  // c was closed
      if (conns.find(id) == conns.end()) return;
    }
    if (conns.find(id) != conns.end()) c.in.erase(0, pos);
  }

  // Returns false when c was closed.
  bool handle(Conn& c, const Message& m) {
    const Op op = static_cast<Op>(m.kind);
    if (!c.authed) {
      if (op != Op::kAuth) {
        note_refused(c, "", std::string("sent '") + wire::op_name(m.kind) + "' without authenticating");
        refuse(c, "TCPStore server: authentication required: this store belongs to a job with a token "
                  "(TDIST_STORE_TOKEN); is another job using the same port?");
        return false;
      }
      const Bytes& client_nonce = m.values[0];
      if (!detail::macs_equal(m.values[1], detail::client_mac(token, c.server_nonce, client_nonce))) {
        const std::string who = m.values.size() > 2 ? printable(m.values[2]) : std::string();
        note_refused(c, who, "wrong token (a process of another job on the same port, or one started with "
                             "another TDIST_STORE_TOKEN)");
        refuse(c, "TCPStore server: authentication failed: this store belongs to another job, or the token "
                  "(TDIST_STORE_TOKEN) differs from the job's");
        return false;
      }
      end_handshake(c.id, c.peer_key);
      c.authed = true;
      note_joined();
      Message ok = reply(Status::kOk);
      ok.values.push_back(detail::server_mac(token, c.server_nonce, client_nonce));
      return send(c, ok);
    }
    Message out = reply(Status::kOk);
    try {
      switch (op) {
        case Op::kSet:
          map.set(m.keys[0], m.values[0]);
          notify(m.keys);
          break;
        case Op::kMultiSet:
          for (size_t i = 0; i < m.keys.size(); ++i) map.set(m.keys[i], m.values[i]);
          notify(m.keys);
          break;
        case Op::kGet:
        case Op::kWait:
          if (!map.contains_all(m.keys)) {
            park(c, m);
            return true;
          }
          if (op == Op::kGet) out.values = map.values(m.keys);
          break;
        case Op::kAdd:
          out.number = map.add(m.keys[0], m.number);
          notify(m.keys);
          break;
        case Op::kCompareSet:
          out.values.push_back(map.compare_set(m.keys[0], m.values[0], m.values[1]));
          notify(m.keys);
          break;
        case Op::kCheck: out.number = map.contains_all(m.keys) ? 1 : 0; break;
        case Op::kDelete: out.number = map.erase(m.keys[0]) ? 1 : 0; break;
        case Op::kNumKeys: out.number = static_cast<int64_t>(map.size()); break;
        case Op::kPing: out.number = wire::kProtocolVersion; break;
        case Op::kAuth: out = error_reply("TCPStore server: already authenticated"); break;
      }
    } catch (const StoreError& e) {
      out = error_reply(e.what());
    }
    return send(c, out);
  }

  void park(Conn& c, const Message& m) {
    Waiter w;
    w.op = m.kind;
    w.keys = m.keys;
    const int64_t ms = std::max<int64_t>(1, std::min<int64_t>(m.number, int64_t(1) << 40));
    w.deadline = Clock::now() + std::chrono::milliseconds(ms);
    w.seq = ++c.wait_seq;
    for (const auto& k : map.missing(w.keys)) waiters_by_key[k].emplace_back(c.id, w.seq);
    deadlines.emplace(w.deadline, std::make_pair(c.id, w.seq));
    c.waiting = std::move(w);
  }

  // Conn c's wait is over (keys present or deadline). Sends the reply and
  // resumes reading its buffered frames.
  void finish_wait(Conn& c, bool timed_out) {
    Waiter w = std::move(*c.waiting);
    c.waiting.reset();
    Message out;
    if (timed_out) {
      out = reply(Status::kTimeout);
      for (const auto& k : map.missing(w.keys)) out.values.push_back(to_bytes(k));
    } else {
      out = reply(Status::kOk);
      if (static_cast<Op>(w.op) == Op::kGet) out.values = map.values(w.keys);
    }
    const uint64_t id = c.id;
    if (!send(c, out)) return;
    if (conns.count(id)) process(c);
  }

  Conn* waiting_conn(uint64_t id, uint64_t seq) {
    auto it = conns.find(id);
    if (it == conns.end() || !it->second->waiting || it->second->waiting->seq != seq) return nullptr;
    return it->second.get();
  }

  void notify(const std::vector<std::string>& keys) {
    for (const auto& key : keys) {
      auto it = waiters_by_key.find(key);
      if (it == waiters_by_key.end()) continue;
      auto list = std::move(it->second);
      waiters_by_key.erase(it);
      for (auto [id, seq] : list) {
        Conn* c = waiting_conn(id, seq);
        if (!c) continue;
        auto missing = map.missing(c->waiting->keys);
        if (missing.empty()) {
          finish_wait(*c, false);
        } else {
          // A key it saw earlier may have been deleted since: watch all again.
          for (const auto& k : missing) waiters_by_key[k].emplace_back(id, seq);
        }
      }
    }
  }

  int expire_and_next_timeout_ms() {
    const auto now = Clock::now();
    while (!deadlines.empty() && deadlines.begin()->first <= now) {
      auto [id, seq] = deadlines.begin()->second;
      deadlines.erase(deadlines.begin());
      if (Conn* c = waiting_conn(id, seq)) finish_wait(*c, true);
    }
    // Handshakes that ran out of time (deadlines grow with the id, so the
    // oldest is first).
    while (!handshaking.empty() && handshaking.begin()->second <= now) close_conn(handshaking.begin()->first);
    std::optional<Clock::time_point> next;
    if (!deadlines.empty()) next = deadlines.begin()->first;
    if (!handshaking.empty() && (!next || handshaking.begin()->second < *next)) next = handshaking.begin()->second;
    if (!next) return -1;
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*next - now).count();
    return static_cast<int>(std::min<int64_t>(ms + 1, 60'000));
  }

  void run() {
    epoll_event events[256];
    while (!stopping.load(std::memory_order_acquire)) {
      const int timeout = expire_and_next_timeout_ms();
      int n = epoll_wait(epoll_fd.get(), events, 256, timeout);
      if (n < 0) {
        if (errno == EINTR) continue;
        break;
      }
      for (int i = 0; i < n; ++i) {
        const uint64_t tag = events[i].data.u64;
        if (tag == 0) {
          accept_all();
          continue;
        }
        if (tag == UINT64_MAX) continue;  // wake-up: the loop condition decides
        auto it = conns.find(tag);
        if (it == conns.end()) continue;
        Conn& c = *it->second;
        if (events[i].events & EPOLLOUT) {
          if (!flush(c)) continue;
        }
        if (events[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) read_from(c);
      }
    }
    conns.clear();
  }
};

TCPStoreServer::TCPStoreServer(TCPStoreServerOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->token = detail::resolve_token(impl_->options.token);
  impl_->pre_auth_limits = handshake_limits(impl_->options.limits);
  std::string host = impl_->options.host;
  if (host == "0.0.0.0" || host == "*") host.clear();
  impl_->listen_fd = detail::listen_tcp(host, impl_->options.port, &impl_->port);
  impl_->epoll_fd.reset(epoll_create1(EPOLL_CLOEXEC));
  impl_->wake_fd.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!impl_->epoll_fd.valid() || !impl_->wake_fd.valid()) {
    throw NetworkError("TCPStore server: epoll/eventfd failed: " + detail::errno_string(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  epoll_ctl(impl_->epoll_fd.get(), EPOLL_CTL_ADD, impl_->listen_fd.get(), &ev);
  ev.data.u64 = UINT64_MAX;
  epoll_ctl(impl_->epoll_fd.get(), EPOLL_CTL_ADD, impl_->wake_fd.get(), &ev);
  impl_->loop_thread = std::thread([this] { impl_->run(); });
}

TCPStoreServer::~TCPStoreServer() { stop(); }

void TCPStoreServer::stop() {
  if (!impl_ || !impl_->loop_thread.joinable()) return;
  impl_->stopping.store(true, std::memory_order_release);
  uint64_t one = 1;
  ssize_t ignored = ::write(impl_->wake_fd.get(), &one, sizeof one);
  (void)ignored;
  impl_->loop_thread.join();
  impl_->listen_fd.reset();
}

uint16_t TCPStoreServer::port() const { return impl_->port; }

int64_t TCPStoreServer::num_clients_joined() const {
  std::lock_guard<std::mutex> lock(impl_->joined_mu);
  return impl_->joined;
}

std::vector<std::string> TCPStoreServer::refused_clients() const {
  std::lock_guard<std::mutex> lock(impl_->refused_mu);
  return {impl_->refused.begin(), impl_->refused.end()};
}

void TCPStoreServer::wait_for_clients(int64_t n, Milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(impl_->joined_mu);
  if (!impl_->joined_cv.wait_for(lock, timeout, [&] { return impl_->joined >= n; })) {
    std::string refused;
    for (const auto& who : refused_clients()) refused += "; refused: " + who;
    throw TimeoutError("TCPStore server on port " + std::to_string(impl_->port) + ": only " +
                       std::to_string(impl_->joined) + " of " + std::to_string(n) +
                       " workers connected within " + detail::format_duration_ms(timeout.count()) +
                       ". Did every rank start, with the same MASTER_ADDR and MASTER_PORT?" + refused);
  }
}

}  // namespace tdist
