// tdist-run's etcd client (tools/run/etcd_client.h): base64 and endpoint
// lists; what a hostile or broken server can do to it (every answer
// bounded in size and time, refused by name); and a real etcd: reads,
// writes, transactions, leases that expire, and a member that is gone.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <thread>

#include "run/etcd_client.h"
#include "store/socket.h"
#include "tdist/errors.h"
#include "tests/util/etcd.h"
#include "tests/util/skip.h"

using namespace std::chrono_literals;
using tdist_run::EtcdClient;
using tdist_run::EtcdTimeouts;

namespace {

EtcdTimeouts quick() {
  EtcdTimeouts t;
  t.request = 300ms;
  t.op = 1000ms;
  return t;
}

// A server that answers every connection with `answer` (after reading the
// request), or never answers when `answer` is empty; until destroyed.
class FakeServer {
 public:
  explicit FakeServer(std::string answer) : answer_(std::move(answer)) {
    uint16_t port = 0;
    fd_ = tdist::detail::listen_tcp("127.0.0.1", 0, &port);
    port_ = port;
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeServer() {
    stop_ = true;
    thread_.join();
  }
  int port() const { return port_; }

 private:
  void serve() {
    std::vector<tdist::detail::Fd> held;
    while (!stop_) {
      pollfd p{fd_.get(), POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      tdist::detail::Fd c(accept(fd_.get(), nullptr, nullptr));
      if (!c.valid()) continue;
      char buf[4096];
      pollfd q{c.get(), POLLIN, 0};
      if (poll(&q, 1, 1000) > 0) (void)!recv(c.get(), buf, sizeof buf, 0);
      if (answer_.empty()) {
        held.push_back(std::move(c));  // never answers, never closes
        continue;
      }
      for (size_t at = 0; at < answer_.size();) {
        const ssize_t n = send(c.get(), answer_.data() + at, answer_.size() - at, MSG_NOSIGNAL);
        if (n <= 0) break;
        at += static_cast<size_t>(n);
      }
    }
  }
  std::string answer_;
  tdist::detail::Fd fd_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

std::string http(const std::string& body) {
  return "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

// What a get() from a server answering `answer` raises; "" when it raises
// nothing. Also checks that it took no longer than the op's bound.
std::string error_of(const std::string& answer) {
  FakeServer s(answer);
  EtcdClient c({{"127.0.0.1", s.port()}}, quick());
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  try {
    c.get("k");
  } catch (const tdist::Error& e) {
    what = e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s) << what;
  return what;
}

}  // namespace

TEST(EtcdClient, Base64RoundTripsAndIsStrict) {
  std::mt19937 rng(7);
  for (size_t n = 0; n < 40; ++n) {
    std::string b(n, '\0');
    for (char& ch : b) ch = static_cast<char>(rng());
    const std::string e = tdist_run::base64_encode(b);
    EXPECT_EQ(e.size() % 4, 0u);
    EXPECT_EQ(tdist_run::base64_decode(e), b);
  }
  EXPECT_EQ(tdist_run::base64_encode("foo"), "Zm9v");
  EXPECT_EQ(tdist_run::base64_decode("YmFy"), "bar");
  for (const char* bad : {"abc", "ab=c", "a===", "ab c", "=abc", "Zm9v=", "Zg=A", "Zm9v\n"}) {
    EXPECT_FALSE(tdist_run::base64_decode(bad).has_value()) << bad;
  }
}

TEST(EtcdClient, EndpointListsAreCheckedByName) {
  const auto e = tdist_run::parse_etcd_endpoints("h1:2379,http://h2:2380/,[::1]:1,h4");
  ASSERT_EQ(e.size(), 4u);
  EXPECT_EQ(e[0].host, "h1");
  EXPECT_EQ(e[1].host, "h2");
  EXPECT_EQ(e[1].port, 2380);
  EXPECT_EQ(e[2].host, "::1");
  EXPECT_EQ(e[3].port, 2379);
  for (const char* bad : {"", "h:0", "h:99999", ":5", "https://h:2379", "h1:2379,,h2:2379", "h:x"}) {
    EXPECT_THROW(tdist_run::parse_etcd_endpoints(bad), tdist::UsageError) << bad;
  }
}

TEST(EtcdClient, HostileAnswersAreRefusedByNameWithinTheirBounds) {
  EXPECT_NE(error_of("").find("no member answered"), std::string::npos);  // never answers: timed out
  EXPECT_NE(error_of("SSH-2.0-OpenSSH\r\n").find("not HTTP"), std::string::npos);
  EXPECT_NE(error_of(http("notjs")).find("not JSON"), std::string::npos);
  EXPECT_NE(error_of(http(std::string(2 << 20, ' '))).find("over 1 MiB"), std::string::npos);
  EXPECT_NE(error_of(http(std::string(5000, '[') + std::string(5000, ']'))).find("not JSON"), std::string::npos);
  EXPECT_NE(error_of(http(R"({"kvs":[{"key":"aw==","value":"!!!!"}]})")).find("not base64"), std::string::npos);
  EXPECT_NE(error_of(http(R"({"kvs":"x"})")).find("bad 'kvs'"), std::string::npos);
  EXPECT_NE(error_of(http(R"({"kvs":[{"value":"eA==","mod_revision":"x1"}]})")).find("bad 'mod_revision'"),
            std::string::npos);
  EXPECT_NE(error_of("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n").find("chunk"),
            std::string::npos);
  EXPECT_NE(error_of("HTTP/1.1 200 OK\r\nContent-Length: 900\r\n\r\n{}").find("cut short"), std::string::npos);
  EXPECT_NE(error_of("HTTP/1.1 200 OK\r\nContent-Len").find("in its headers"), std::string::npos);
  // etcd's own refusal: named, not retried.
  const std::string refusal = R"({"code":3,"message":"key is not given"})";
  EXPECT_NE(error_of("HTTP/1.1 400 Bad\r\nContent-Length: " + std::to_string(refusal.size()) + "\r\n\r\n" + refusal)
                .find("etcd refused /v3/kv/range: key is not given"),
            std::string::npos);
  // A well-formed answer is read.
  EXPECT_EQ(error_of(http(R"({"kvs":[{"key":"aw==","value":"eA==","mod_revision":"3"}],"count":"1"})")), "");
}

TEST(EtcdClient, ARealClusterReadsWritesAndExpiresLeases) {
  if (tdist::test::etcd_program().empty()) TDIST_SKIP_OR_FAIL_IN_CI("etcd is not installed (Debian's etcd-server)");
  tdist::test::TempDir dir;
  tdist::test::EtcdCluster cluster(dir.path(), 1);
  ASSERT_TRUE(cluster.start()) << cluster.log(0);
  // The first endpoint is nobody: the client goes on to the member.
  const int dead = tdist::detail::find_free_port();
  EtcdClient c({{"127.0.0.1", dead}, {"127.0.0.1", cluster.client_port(0)}}, EtcdTimeouts{});
  EXPECT_FALSE(c.get("a").has_value());
  c.put("a", std::string("b\0c", 3));
  const auto v = c.get("a");
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->value, std::string("b\0c", 3));
  EXPECT_FALSE(c.put_if_revision("a", "x", v->mod_revision + 100));
  EXPECT_TRUE(c.put_if_revision("a", "x", v->mod_revision));
  EXPECT_EQ(c.get("a")->value, "x");
  EXPECT_TRUE(c.put_if_revision("new", "1", 0));
  EXPECT_FALSE(c.put_if_revision("new", "2", 0));
  EXPECT_EQ(c.put_if_value("cas", std::nullopt, "one"), "one");
  EXPECT_EQ(c.put_if_value("cas", std::nullopt, "two"), "one");
  EXPECT_EQ(c.put_if_value("cas", std::string("one"), "three"), "three");
  EXPECT_EQ(c.put_if_value("cas", std::string("one"), "four"), "three");

  const int64_t lease = c.grant_lease(2);
  c.put("leased", "1", lease);
  EXPECT_TRUE(c.keep_alive(lease));
  EXPECT_TRUE(c.get("leased").has_value());
  bool gone = false;
  for (int i = 0; i < 100 && !gone; ++i) {
    std::this_thread::sleep_for(100ms);
    gone = !c.get("leased").has_value();
  }
  EXPECT_TRUE(gone) << "a key under a lease no one renewed outlived it";
  EXPECT_FALSE(c.keep_alive(lease));

  // Every member gone: an error naming them, within the op's bound.
  cluster.kill_member(0);
  EtcdClient lost({{"127.0.0.1", dead}, {"127.0.0.1", cluster.client_port(0)}}, quick());
  const auto t0 = std::chrono::steady_clock::now();
  try {
    lost.get("a");
    ADD_FAILURE() << "a cluster with no member answered";
  } catch (const tdist::NetworkError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(dead)), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(cluster.client_port(0))), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
}
