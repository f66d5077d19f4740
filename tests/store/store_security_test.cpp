// The store's doors: where a server listens, what a client that has not
// authenticated may do (send little, stay briefly, be one of a few), how a
// refused client is named, and the files that hold secrets or job state
// (token files, FileStore files, checkpoint files) being private.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "store/auth.h"
#include "store/socket.h"
#include "store/wire.h"
#include "tdist/store.h"
#include "tests/store/flood.h"
#include "tests/util/listening.h"
#include "tests/util/process.h"
#include "tests/util/skip.h"
#include "util/private_file.h"

using namespace std::chrono_literals;
namespace test = tdist::test;
namespace wire = tdist::wire;

namespace {

tdist::TCPStoreServerOptions server_with_token(const std::string& token) {
  tdist::TCPStoreServerOptions o;
  o.token = token;
  return o;
}

std::unique_ptr<tdist::TCPStore> client(uint16_t port, const std::string& token, const std::string& name = "") {
  tdist::TCPStoreOptions o;
  o.port = port;
  o.timeout = 5s;
  o.token = token;
  o.client_name = name;
  return std::make_unique<tdist::TCPStore>("127.0.0.1", o);
}

// Where this process listens on `port`.
std::vector<std::string> listening_on(uint16_t port) {
  std::vector<std::string> out;
  for (const auto& s : test::listening_sockets()) {
    if (s.port == port) out.push_back(s.address);
  }
  return out;
}

// A raw connection that has read the server's hello.
int raw_connect(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("connect");
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// Reads until the server closes; returns what came and whether it closed
// (false: still open after the receive timeout).
std::pair<std::string, bool> drain(int fd) {
  std::string all;
  char buf[4096];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n == 0) return {all, true};
    if (n < 0) return {all, errno == ECONNRESET};
    all.append(buf, static_cast<size_t>(n));
  }
}

bool is_hex64(const std::string& s) {
  return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

bool closed_by_server(int fd) {
  char c;
  for (;;) {
    const ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT | MSG_PEEK);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
    // Pending bytes (the hello, maybe a refusal): consume and look again.
    char buf[4096];
    recv(fd, buf, sizeof buf, MSG_DONTWAIT);
  }
}

TEST(StoreSecurity, AServerListensOnLoopbackUnlessToldOtherwise) {
  tdist::TCPStoreServer by_default(tdist::TCPStoreServerOptions{});
  EXPECT_EQ(listening_on(by_default.port()), std::vector<std::string>{"127.0.0.1"});

  // The master TCPStore listens where its clients connect...
  tdist::TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.timeout = 5s;
  o.token = std::string("t");
  tdist::TCPStore loopback("127.0.0.1", o);
  EXPECT_EQ(listening_on(loopback.port()), std::vector<std::string>{"127.0.0.1"});
  // ...or where it is told to.
  o.bind_address = "*";
  tdist::TCPStore everywhere("127.0.0.1", o);
  const auto all = listening_on(everywhere.port());
  ASSERT_EQ(all.size(), 1u);
  EXPECT_TRUE(all[0] == "::" || all[0] == "0.0.0.0") << all[0];
  o.bind_address.reset();
  setenv("TDIST_STORE_BIND", "0.0.0.0", 1);
  tdist::TCPStore by_env("127.0.0.1", o);
  unsetenv("TDIST_STORE_BIND");
  const auto env_all = listening_on(by_env.port());
  ASSERT_EQ(env_all.size(), 1u);
  EXPECT_TRUE(env_all[0] == "::" || env_all[0] == "0.0.0.0") << env_all[0];
}

TEST(StoreSecurity, AMasterAddressOfAnotherMachineIsAClearError) {
  tdist::TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.timeout = 2s;
  o.token = std::string("t");
  try {
    tdist::TCPStore master("192.0.2.1", o);  // TEST-NET-1: nobody's address
    FAIL() << "listened on an address this machine does not have";
  } catch (const tdist::NetworkError& e) {
    EXPECT_NE(std::string(e.what()).find("not an address of this machine"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("TDIST_STORE_BIND"), std::string::npos) << e.what();
  }
}

TEST(StoreSecurity, AClientThatHasNotAuthenticatedMaySendOnlyALittle) {
  tdist::TCPStoreServer server(server_with_token("s3cret"));
  const int fd = raw_connect(server.port());
  // A frame that claims a 1 MiB body, then the body: cut off at the
  // handshake's 4 KiB, long before the whole frame.
  std::string big(4, '\0');
  const uint32_t len = 1u << 20;
  std::memcpy(big.data(), &len, 4);
  big += std::string(64 * 1024, 'x');
  send(fd, big.data(), big.size(), MSG_NOSIGNAL);
  auto [reply, closed] = drain(fd);
  close(fd);
  EXPECT_TRUE(closed);
  EXPECT_NE(reply.find("too much data before authenticating"), std::string::npos) << reply;
  auto honest = client(server.port(), "s3cret");
  honest->set("k", "v");
  EXPECT_EQ(honest->get_string("k"), "v");
}

TEST(StoreSecurity, AClientThatNeverAuthenticatesIsDropped) {
  auto o = server_with_token("s3cret");
  o.limits.handshake_timeout = 300ms;
  tdist::TCPStoreServer server(o);
  const int fd = raw_connect(server.port());
  const auto t0 = std::chrono::steady_clock::now();
  auto [hello, closed] = drain(fd);  // the hello, then nothing until the server gives up
  close(fd);
  EXPECT_TRUE(closed);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  // An authenticated client is not subject to it.
  auto c = client(server.port(), "s3cret");
  std::this_thread::sleep_for(600ms);
  c->set("still", "here");
  EXPECT_EQ(c->get_string("still"), "here");
}

TEST(StoreSecurity, AFloodOfIdleConnectionsDoesNotKeepRanksOut) {
  auto o = server_with_token("s3cret");
  o.limits.max_handshaking = 8;
  tdist::TCPStoreServer server(o);
  std::vector<int> idle;
  for (int i = 0; i < 100; ++i) idle.push_back(raw_connect(server.port()));
  auto honest = client(server.port(), "s3cret", "rank 1");
  honest->set("k", "v");
  EXPECT_EQ(client(server.port(), "s3cret")->get_string("k"), "v");
  std::this_thread::sleep_for(100ms);
  int still_open = 0;
  for (int fd : idle) {
    if (!closed_by_server(fd)) ++still_open;
    close(fd);
  }
  EXPECT_LE(still_open, 8) << "the server kept more unauthenticated connections than its limit";
}

// Issue 34, item 1: another user holds 1000 connections to the master's
// port (idle ones, and ones that send junk a byte at a time), and
// opens a new one for every one closed; a 4-rank job, each rank a process,
// still starts. Before, the server dropped its oldest unauthenticated
// connection, which under the churn was a rank's, and ranks did not retry.
TEST(StoreSecurity, AFloodFromAnotherUserDoesNotKeepAJobOut) {
  const uint16_t port = tdist::detail::find_free_port();
  test::Flood flood(port, 1000, /*as_other_user=*/true);
  if (!flood.running()) TDIST_SKIP_OR_FAIL_IN_CI("no flood from a second uid on this machine: " << flood.why_not());
  static constexpr int kWorld = 4;
  std::vector<pid_t> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    ranks.push_back(test::fork_child([port, rank] {
      try {
        tdist::TCPStoreOptions o;
        o.port = port;
        o.is_server = rank == 0;
        o.num_workers = kWorld;
        o.timeout = 30s;
        o.token = std::string("job-token");
        o.client_name = "rank " + std::to_string(rank);
        tdist::TCPStore store("127.0.0.1", o);
        store.set("rank/" + std::to_string(rank), "here");
        store.wait({"rank/0", "rank/1", "rank/2", "rank/3"});
        if (store.add("done", 1) == kWorld) store.set("all_done", "1");
        if (rank == 0) store.wait({"all_done"});  // the server outlives the last reply
        return 0;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        return 1;
      }
    }));
    // The master first, as a launcher starts it; the flood then fills it.
    if (rank == 0) std::this_thread::sleep_for(1s);
  }
  for (int rank = 0; rank < kWorld; ++rank) {
    const int st = test::wait_child(ranks[rank], 60s);
    EXPECT_TRUE(test::exited_ok(st)) << "rank " << rank << ": " << test::describe_status(st);
  }
}

// The server keeps the unauthenticated connections of the peer with the
// most of them in check, not those of a peer with a few: with 4 of its own
// waiting, a flood of 100 from one address cannot push the job's out.
TEST(StoreSecurity, AFloodEvictsItsOwnConnectionsFirst) {
  auto o = server_with_token("s3cret");
  o.limits.max_handshaking = 16;
  tdist::TCPStoreServer server(o);
  // Four connections of "the job", from this process's uid, idle for now.
  std::vector<int> mine;
  for (int i = 0; i < 4; ++i) mine.push_back(raw_connect(server.port()));
  test::Flood flood(server.port(), 100, /*as_other_user=*/true);
  if (!flood.running()) TDIST_SKIP_OR_FAIL_IN_CI("no flood from a second uid on this machine: " << flood.why_not());
  std::this_thread::sleep_for(1500ms);  // thousands of evictions by now
  for (int fd : mine) {
    EXPECT_FALSE(closed_by_server(fd)) << "a connection of the job's user was dropped for the flood";
    close(fd);
  }
}

TEST(StoreSecurity, ARefusedClientIsNamedAndToldWhy) {
  tdist::TCPStoreServer server(server_with_token("job-a"));
  try {
    client(server.port(), "job-b", "rank 3, pid 4242");
    FAIL() << "a wrong token was accepted";
  } catch (const tdist::StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("this store belongs to another job"), std::string::npos) << e.what();
  }
  try {
    client(server.port(), "");
    FAIL() << "a client without a token was accepted";
  } catch (const tdist::StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("requires a token and this process has none"), std::string::npos)
        << e.what();
  }
  const auto refused = server.refused_clients();
  ASSERT_EQ(refused.size(), 1u);  // the tokenless client gave up before sending anything
  EXPECT_EQ(refused[0].rfind("127.0.0.1:", 0), 0u) << refused[0];
  EXPECT_NE(refused[0].find(" (rank 3, pid 4242): wrong token"), std::string::npos) << refused[0];
  EXPECT_EQ(server.num_clients_joined(), 0);
}

TEST(StoreSecurity, TokenFilesMustBePrivate) {
  test::TempDir dir;
  const std::string path = dir.path() + "/token";
  std::ofstream(path) << "  secret-with-spaces-inside kept \n\n";
  chmod(path.c_str(), 0600);
  EXPECT_EQ(tdist::detail::read_token_file(path), "  secret-with-spaces-inside kept");
  setenv("TDIST_STORE_TOKEN_FILE", path.c_str(), 1);
  EXPECT_EQ(tdist::detail::resolve_token(std::nullopt), "  secret-with-spaces-inside kept");
  setenv("TDIST_STORE_TOKEN", "env-wins", 1);
  EXPECT_EQ(tdist::detail::resolve_token(std::nullopt), "env-wins");
  unsetenv("TDIST_STORE_TOKEN");
  for (mode_t mode : {0640, 0604, 0620}) {
    chmod(path.c_str(), mode);
    try {
      tdist::detail::resolve_token(std::nullopt);
      FAIL() << "mode " << std::oct << mode << " accepted";
    } catch (const tdist::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("lets others in"), std::string::npos) << e.what();
    }
  }
  unsetenv("TDIST_STORE_TOKEN_FILE");
  chmod(path.c_str(), 0600);
  std::ofstream(path) << "\n";
  EXPECT_THROW(tdist::detail::read_token_file(path), tdist::UsageError);
  EXPECT_THROW(tdist::detail::read_token_file(dir.path() + "/missing"), tdist::UsageError);
}

TEST(StoreSecurity, GeneratedTokensAreLongAndFresh) {
  const std::string a = tdist::detail::generate_token(), b = tdist::detail::generate_token();
  EXPECT_TRUE(is_hex64(a)) << a;
  EXPECT_NE(a, b);
}

TEST(StoreSecurity, PrivateMeansThisUserAlone) {
  test::TempDir dir;
  const std::string path = dir.path() + "/f";
  std::ofstream(path) << "x";
  const int fd = open(path.c_str(), O_RDONLY);
  fchmod(fd, 0600);
  EXPECT_EQ(tdist::detail::why_not_private(fd), "");
  fchmod(fd, 0644);
  EXPECT_EQ(tdist::detail::why_not_private(fd), "has mode 644, which lets others in");
  fchmod(fd, 0600);
  // Another user's file: made so when we may (root), else one of root's.
  int other = -1;
  if (geteuid() == 0) {
    ASSERT_EQ(fchown(fd, 65534, 65534), 0);
    other = fd;
  } else {
    other = open("/etc/hostname", O_RDONLY);
    ASSERT_GE(other, 0);
  }
  struct stat st {};
  fstat(other, &st);
  EXPECT_EQ(tdist::detail::why_not_private(other),
            "belongs to uid " + std::to_string(st.st_uid) + ", not to this user");
  if (other != fd) close(other);
  close(fd);
}

TEST(StoreSecurity, AFileStoreIsPrivateAndRefusesAnotherUsersFile) {
  test::TempDir dir;
  const std::string path = dir.path() + "/store";
  {
    tdist::FileStore store(path, 5s);
    store.set("k", "v");
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 077, 0u) << std::oct << st.st_mode;
  }
  std::ofstream(path) << "";  // a file already there, of another user
  chmod(path.c_str(), 0600);
  if (geteuid() == 0) {
    ASSERT_EQ(chown(path.c_str(), 65534, 65534), 0);
    try {
      tdist::FileStore store(path, 5s);
      FAIL() << "used another user's store file";
    } catch (const tdist::StoreError& e) {
      EXPECT_NE(std::string(e.what()).find("belongs to uid 65534"), std::string::npos) << e.what();
    }
  } else {
    // Not root: a file of root's stands in for another user's.
    EXPECT_THROW(tdist::FileStore("/etc/hostname", 1s), tdist::StoreError);
  }
}

}  // namespace
