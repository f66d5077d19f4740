// TCPStore beyond the conformance suite: many client processes, a server
// that starts late, dies and comes back, rogue clients sending garbage, the
// connection limit, and shared-secret authentication.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "store/auth.h"
#include "store/socket.h"
#include "store/wire.h"
#include "tdist/store.h"
#include "tests/util/process.h"
#include "tests/util/paths.h"

using namespace std::chrono_literals;
using tdist::Bytes;
using tdist::to_bytes;
namespace test = tdist::test;
namespace wire = tdist::wire;

namespace {

tdist::TCPStoreServerOptions local_server(std::optional<std::string> token = std::string()) {
  tdist::TCPStoreServerOptions o;
  o.host = "127.0.0.1";
  o.token = std::move(token);
  return o;
}

std::unique_ptr<tdist::TCPStore> client(uint16_t port, std::chrono::milliseconds timeout = 10s,
                                        std::optional<std::string> token = std::string()) {
  tdist::TCPStoreOptions o;
  o.port = port;
  o.timeout = timeout;
  o.token = std::move(token);
  return std::make_unique<tdist::TCPStore>("127.0.0.1", o);
}

// A raw TCP connection for playing a rogue client.
class RawConn {
 public:
  explicit RawConn(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("connect");
    timeval tv{5, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~RawConn() { close(fd_); }
  void send_bytes(const std::string& b) { ASSERT_EQ(::send(fd_, b.data(), b.size(), MSG_NOSIGNAL), (ssize_t)b.size()); }
  // Reads until the server closes (or 5 s pass); returns everything read
  // and whether the connection was closed.
  std::pair<std::string, bool> read_until_closed() {
    std::string all;
    char buf[4096];
    for (;;) {
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n == 0) return {all, true};
      if (n < 0) return {all, errno == ECONNRESET};
      all.append(buf, n);
    }
  }
  wire::Message read_message() {
    std::string in;
    char buf[4096];
    for (;;) {
      wire::Message m;
      auto r = wire::parse_frame(reinterpret_cast<const uint8_t*>(in.data()), in.size(), {}, false, &m);
      if (r.status == wire::ParseStatus::kOk) return m;
      if (r.status == wire::ParseStatus::kBad) throw std::runtime_error("bad reply " + r.error);
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) throw std::runtime_error("closed before a full reply");
      in.append(buf, n);
    }
  }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
};

std::string frame(uint8_t kind, std::vector<std::string> keys, std::vector<Bytes> values, int64_t number = 0) {
  wire::Message m;
  m.kind = kind;
  m.keys = std::move(keys);
  m.values = std::move(values);
  m.number = number;
  std::string out;
  wire::encode_frame(m, &out);
  return out;
}

std::string le32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

TEST(TCPStore, EightProcessesHammeringAddAndCompareSetEndExact) {
  tdist::TCPStoreServer server(local_server());
  constexpr int kProcs = 8, kOps = 300;
  std::vector<pid_t> kids;
  for (int p = 0; p < kProcs; ++p) {
    kids.push_back(test::fork_child([&, p] {
      auto s = client(server.port());
      for (int i = 0; i < kOps; ++i) {
        s->add("counter", 1);
        // Increment a second counter "N/proc/step" with compare_set retries
        // (unique desired values: a reply equal to ours proves our swap).
        for (;;) {
          Bytes old = s->compare_set("cas", {}, to_bytes("0/init/0"));
          const long long n = std::stoll(tdist::to_string(old));
          Bytes next = to_bytes(std::to_string(n + 1) + "/" + std::to_string(p) + "/" + std::to_string(i));
          if (s->compare_set("cas", old, next) == next) break;
        }
      }
      return 0;
    }));
  }
  for (pid_t k : kids) {
    int st = test::wait_child(k, 90s);
    EXPECT_TRUE(test::exited_ok(st)) << test::describe_status(st);
  }
  auto s = client(server.port());
  EXPECT_EQ(s->get_string("counter"), std::to_string(kProcs * kOps));
  const std::string cas = s->get_string("cas");
  EXPECT_EQ(cas.substr(0, cas.find('/')), std::to_string(kProcs * kOps));
  EXPECT_GE(server.num_clients_joined(), kProcs + 1);
}

TEST(TCPStore, ClientWaitsForAServerThatStartsLate) {
  const uint16_t port = tdist::detail::find_free_port();
  std::unique_ptr<tdist::TCPStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(400ms);
    auto o = local_server();
    o.port = port;
    server = std::make_unique<tdist::TCPStoreServer>(o);
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto s = client(port, 10s);
  starter.join();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 300ms);
  s->set("k", "v");
  EXPECT_EQ(s->get_string("k"), "v");
}

TEST(TCPStore, ConnectingToNothingTimesOutNamingTheAddress) {
  const uint16_t port = tdist::detail::find_free_port();
  try {
    client(port, 300ms);
    FAIL() << "connected to nothing";
  } catch (const tdist::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos) << e.what();
  }
}

// A standalone server process (tdist-store-server) we can kill -9.
pid_t start_server_process(uint16_t port) {
  const std::string server = tdist::test::bin_dir() + "/tdist-store-server";
  pid_t pid = test::fork_child([port, &server] {
    std::string p = std::to_string(port);
    execl(server.c_str(), "tdist-store-server", "--host", "127.0.0.1", "--port", p.c_str(),
          static_cast<char*>(nullptr));
    return 127;
  });
  return pid;
}

// A client of a server (a process) that was killed under it: the call in
// flight fails loudly and drops the connection (the next call reconnects).
std::unique_ptr<tdist::TCPStore> client_of_a_killed_server(uint16_t port, std::chrono::milliseconds timeout) {
  const pid_t server = start_server_process(port);
  auto s = client(port, timeout);
  s->set("before", "1");
  kill(server, SIGKILL);
  test::wait_child(server, 10s);
  EXPECT_THROW(s->set("during", "1"), tdist::NetworkError);
  return s;
}

TEST(TCPStore, SurvivesAServerRestart) {
  const uint16_t port = tdist::detail::find_free_port();
  auto s = client_of_a_killed_server(port, 10s);
  // Once the server is back, the same client reconnects.
  const pid_t server = start_server_process(port);
  s->set("after", "2");
  EXPECT_EQ(s->get_string("after"), "2");
  EXPECT_FALSE(s->check({"before"}));  // a restarted server starts empty
  kill(server, SIGTERM);
  EXPECT_TRUE(test::exited_ok(test::wait_child(server, 10s)));
}

TEST(TCPStore, ABlockedGetFailsFastWhenTheServerDies) {
  const uint16_t port = tdist::detail::find_free_port();
  pid_t server = start_server_process(port);
  auto s = client(port, 60s);
  std::thread killer([&] {
    std::this_thread::sleep_for(200ms);
    kill(server, SIGKILL);
  });
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(s->get("never", 60s), tdist::NetworkError);
  killer.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  test::wait_child(server, 10s);
}

// One thread's call reconnecting to a server that does not answer holds the
// connection for the store's whole timeout; another thread's call with a
// short timeout (a rank asking which peers stopped beating) gives up within
// its own, and says why.
TEST(TCPStore, ACallWaitsBehindAnotherThreadsReconnectOnlyForItsOwnTimeout) {
  const uint16_t port = tdist::detail::find_free_port();
  auto s = client_of_a_killed_server(port, 5s);
  // A listener that never accepts: connecting succeeds (the kernel's
  // backlog), and the server's greeting never comes.
  uint16_t bound = 0;
  const tdist::detail::Fd listener = tdist::detail::listen_tcp("127.0.0.1", port, &bound);
  std::thread reconnecting([&] { EXPECT_THROW(s->set("beat", "1"), tdist::TimeoutError); });
  std::this_thread::sleep_for(300ms);  // the set is waiting for the greeting
  const auto t0 = std::chrono::steady_clock::now();
  try {
    s->get("beat", 1s);
    ADD_FAILURE() << "a get from a silent server returned";
  } catch (const tdist::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("busy with another call"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2500ms);
  reconnecting.join();
}

TEST(TCPStore, ServerSideTimeoutKeepsTheConnectionUsable) {
  tdist::TCPStoreServer server(local_server());
  auto s = client(server.port());
  EXPECT_THROW(s->get("missing", 100ms), tdist::TimeoutError);
  s->set("next", "fine");
  EXPECT_EQ(s->get_string("next"), "fine");
  EXPECT_EQ(server.num_clients_joined(), 1);  // no reconnect was needed
}

TEST(TCPStore, RogueClientsCannotHurtHonestOnes) {
  tdist::TCPStoreLimits limits;
  limits.max_value_bytes = 1 << 20;
  limits.max_key_bytes = 256;
  auto o = local_server();
  o.limits = limits;
  tdist::TCPStoreServer server(o);
  auto honest = client(server.port());
  honest->set("k", "v");

  // An honest client keeps a get parked while the rogues do their worst.
  auto waiter = client(server.port());
  std::thread parked([&] { EXPECT_EQ(waiter->get_string("late"), "here"); });

  const std::vector<std::pair<std::string, std::string>> rogues = {
      {"garbage", std::string("\xde\xad\xbe\xef garbage that is not a frame at all", 38)},
      {"oversized length", le32(0xfffffff0u) + "x"},
      {"unknown op", frame(200, {"k"}, {})},
      {"wrong field counts", frame(static_cast<uint8_t>(wire::Op::kSet), {"k"}, {})},
      {"key over limit", frame(static_cast<uint8_t>(wire::Op::kSet), {std::string(1000, 'k')}, {to_bytes("v")})},
      {"value over limit", frame(static_cast<uint8_t>(wire::Op::kSet), {"k"}, {Bytes(2 << 20, 1)})},
      {"empty key", frame(static_cast<uint8_t>(wire::Op::kGet), {""}, {}, 10)},
      {"too short", le32(3) + "abc"},
      {"trailing bytes", [] {
         std::string f = frame(static_cast<uint8_t>(wire::Op::kPing), {}, {});
         f[0] = static_cast<char>(f[0] + 1);
         return f + "X";
       }()},
  };
  for (const auto& [name, bytes] : rogues) {
    RawConn rogue(server.port());
    rogue.read_message();  // hello
    rogue.send_bytes(bytes);
    auto [reply, closed] = rogue.read_until_closed();
    EXPECT_TRUE(closed) << name << ": the server kept the connection";
    EXPECT_NE(reply.find("bad request"), std::string::npos) << name << ": got '" << reply << "'";
    // Honest traffic is untouched.
    EXPECT_EQ(honest->get_string("k"), "v") << "after " << name;
    honest->add("survived", 1);
  }
  {
    // A client that disconnects in the middle of a frame, and one that
    // disconnects while its get is parked.
    RawConn half(server.port());
    half.read_message();
    half.send_bytes(frame(static_cast<uint8_t>(wire::Op::kSet), {"half"}, {to_bytes("value")}).substr(0, 10));
  }
  {
    RawConn quitter(server.port());
    quitter.read_message();
    quitter.send_bytes(frame(static_cast<uint8_t>(wire::Op::kGet), {"late"}, {}, 60000));
  }
  EXPECT_FALSE(honest->check({"half"}));
  honest->set("late", "here");
  parked.join();
  EXPECT_EQ(honest->get_string("survived"), std::to_string(rogues.size()));
}

TEST(TCPStore, ConnectionLimitRefusesOnlyTheExtraClient) {
  auto o = local_server();
  o.limits.max_connections = 3;
  tdist::TCPStoreServer server(o);
  auto a = client(server.port()), b = client(server.port()), c = client(server.port());
  // A full server is busy, not hostile: the client retries until its
  // timeout, then names the refusal.
  try {
    client(server.port(), 2s);
    FAIL() << "a fourth client was accepted";
  } catch (const tdist::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("too many connections"), std::string::npos) << e.what();
  }
  a->set("x", "1");
  EXPECT_EQ(c->get_string("x"), "1");
  a.reset();  // a slot frees up
  std::this_thread::sleep_for(50ms);
  auto d = client(server.port());
  EXPECT_EQ(d->get_string("x"), "1");
}

TEST(TCPStore, MasterWaitsForWorkers) {
  const uint16_t port = tdist::detail::find_free_port();
  std::vector<std::thread> workers;
  std::vector<std::unique_ptr<tdist::TCPStore>> clients(2);
  for (int i = 0; i < 2; ++i) {
    workers.emplace_back([&, i] {
      std::this_thread::sleep_for(100ms * (i + 1));
      clients[i] = client(port);
    });
  }
  tdist::TCPStoreOptions o;
  o.port = port;
  o.is_server = true;
  o.num_workers = 3;
  o.timeout = 10s;
  o.token = std::string();
  tdist::TCPStore master("127.0.0.1", o);
  for (auto& t : workers) t.join();
  EXPECT_GE(master.server()->num_clients_joined(), 3);
}

TEST(TCPStore, MasterTimesOutWhenWorkersNeverCome) {
  tdist::TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.num_workers = 3;
  o.timeout = 300ms;
  o.token = std::string();
  try {
    tdist::TCPStore master("127.0.0.1", o);
    FAIL() << "no timeout";
  } catch (const tdist::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("only 1 of 3 workers"), std::string::npos) << e.what();
  }
}

TEST(TCPStoreAuth, RightTokenWorks) {
  tdist::TCPStoreServer server(local_server("s3cret"));
  auto s = client(server.port(), 5s, "s3cret");
  s->set("k", "v");
  EXPECT_EQ(client(server.port(), 5s, "s3cret")->get_string("k"), "v");
}

TEST(TCPStoreAuth, WrongOrMissingTokenIsRefused) {
  tdist::TCPStoreServer server(local_server("s3cret"));
  try {
    client(server.port(), 5s, "guess");
    FAIL() << "wrong token accepted";
  } catch (const tdist::StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("authentication failed"), std::string::npos) << e.what();
  }
  try {
    client(server.port(), 5s, std::string());
    FAIL() << "missing token accepted";
  } catch (const tdist::StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("TDIST_STORE_TOKEN"), std::string::npos) << e.what();
  }
  // A client that skips authentication and sends a command is cut off
  // before the command runs.
  RawConn raw(server.port());
  auto hello = raw.read_message();
  EXPECT_TRUE(hello.number & wire::kHelloAuthRequired);
  raw.send_bytes(frame(static_cast<uint8_t>(wire::Op::kSet), {"sneaky"}, {to_bytes("1")}));
  auto [reply, closed] = raw.read_until_closed();
  EXPECT_TRUE(closed);
  EXPECT_NE(reply.find("authentication required"), std::string::npos);
  EXPECT_FALSE(client(server.port(), 5s, "s3cret")->check({"sneaky"}));
  EXPECT_EQ(server.num_clients_joined(), 1);  // only the checking client above
}

TEST(TCPStoreAuth, ClientWithTokenRefusesAServerWithoutAuth) {
  tdist::TCPStoreServer server(local_server(std::string()));
  EXPECT_THROW(client(server.port(), 5s, "s3cret"), tdist::StoreError);
}

TEST(TCPStoreAuth, TokenFromTheEnvironment) {
  setenv("TDIST_STORE_TOKEN", "from-env", 1);
  tdist::TCPStoreServer server(local_server(std::nullopt));
  auto ok = client(server.port(), 5s, std::nullopt);
  ok->set("k", "v");
  unsetenv("TDIST_STORE_TOKEN");
  EXPECT_THROW(client(server.port(), 5s, std::nullopt), tdist::StoreError);
}

TEST(TCPStoreAuth, TheTokenNeverCrossesTheWire) {
  // Play the server: send a challenge, capture everything the client sends.
  const std::string token = "a-long-and-recognisable-token-0123456789";
  uint16_t port = 0;
  tdist::detail::Fd listener = tdist::detail::listen_tcp("127.0.0.1", 0, &port);
  std::string captured;
  Bytes server_nonce = tdist::detail::random_nonce();
  std::thread fake([&] {
    int fd = -1;
    for (int i = 0; i < 500 && fd < 0; ++i) {
      fd = accept(listener.get(), nullptr, nullptr);
      if (fd < 0) std::this_thread::sleep_for(10ms);
    }
    ASSERT_GE(fd, 0);
    wire::Message hello;
    hello.kind = static_cast<uint8_t>(wire::Status::kHello);
    hello.number = wire::kProtocolVersion | wire::kHelloAuthRequired;
    hello.values = {server_nonce};
    std::string out;
    wire::encode_frame(hello, &out);
    ::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
    char buf[4096];
    timeval tv{2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n > 0) captured.assign(buf, n);
    close(fd);  // never answer: the client must give up with an error
  });
  EXPECT_ANY_THROW(client(port, 3s, token));
  fake.join();
  ASSERT_FALSE(captured.empty());
  EXPECT_EQ(captured.find(token), std::string::npos);
  EXPECT_EQ(captured.find("recognisable"), std::string::npos);
  wire::Message auth;
  auto r = wire::parse_frame(reinterpret_cast<const uint8_t*>(captured.data()), captured.size(), {}, true, &auth);
  ASSERT_EQ(r.status, wire::ParseStatus::kOk);
  ASSERT_EQ(auth.values.size(), 2u);
  // What it sent is the HMAC of our challenge under the token.
  EXPECT_EQ(auth.values[1], tdist::detail::client_mac(token, server_nonce, auth.values[0]));
}

}  // namespace
