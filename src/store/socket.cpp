#include "store/socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "tdist/errors.h"
#include "util/env.h"

namespace tdist::detail {

namespace {

int remaining_ms(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
}

// Waits for events on fd until deadline; false on timeout.
bool wait_fd(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) throw NetworkError("poll failed: " + errno_string(errno));
  }
}

std::string endpoint(const std::string& host, uint16_t port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

void set_nonblocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw NetworkError("fcntl(O_NONBLOCK) failed: " + errno_string(errno));
  }
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

Fd listen_tcp(const std::string& host, uint16_t port, uint16_t* bound_port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  hints.ai_family = host.empty() ? AF_INET6 : AF_UNSPEC;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 && host.empty()) {  // no IPv6 on this machine
    hints.ai_family = AF_INET;
    rc = getaddrinfo(nullptr, service.c_str(), &hints, &res);
  }
  if (rc != 0) {
    throw NetworkError("cannot resolve '" + host + "' to listen on: " + gai_strerror(rc));
  }
  int last_err = 0;
  Fd fd;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    Fd s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s.valid()) {
      last_err = errno;
      continue;
    }
    int one = 1, zero = 0;
    setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (ai->ai_family == AF_INET6) setsockopt(s.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (::bind(s.get(), ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(s.get(), 4096) == 0) {
      fd = std::move(s);
      break;
    }
    last_err = errno;
  }
  freeaddrinfo(res);
  if (!fd.valid()) {
    throw NetworkError("cannot listen on " + endpoint(host.empty() ? "*" : host, port) + ": " +
                       errno_string(last_err) +
                       (last_err == EADDRINUSE ? ". Another process, perhaps another job's store, uses this port; "
                                                 "pick another MASTER_PORT"
                        : last_err == EADDRNOTAVAIL
                            ? ". That is not an address of this machine: give the address of this machine that "
                              "the other ranks reach, or set TDIST_STORE_BIND to the address to listen on ('*' "
                              "for every interface)"
                            : ""));
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  *bound_port = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                                 : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  set_nonblocking(fd.get());
  return fd;
}

namespace {

// One attempt at every address of host:port, each before the deadline; an
// invalid Fd and *error set when none connected.
Fd try_connect(const std::string& host, uint16_t port, Deadline deadline, std::string* error) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_family = AF_UNSPEC;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    *error = std::string("cannot resolve host: ") + gai_strerror(rc);
    return Fd();
  }
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    Fd s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s.valid()) {
      *error = errno_string(errno);
      continue;
    }
    // Connect without blocking past the deadline.
    set_nonblocking(s.get());
    int c = ::connect(s.get(), ai->ai_addr, ai->ai_addrlen);
    if (c != 0 && errno == EINPROGRESS) {
      if (!wait_fd(s.get(), POLLOUT, deadline)) {
        *error = "connect timed out";
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      c = err == 0 ? 0 : -1;
      errno = err;
    }
    if (c == 0) {
      int flags = fcntl(s.get(), F_GETFL, 0);
      fcntl(s.get(), F_SETFL, flags & ~O_NONBLOCK);
      set_nodelay(s.get());
      freeaddrinfo(res);
      return s;
    }
    *error = errno_string(errno);
  }
  freeaddrinfo(res);
  return Fd();
}

}  // namespace

Fd connect_tcp(const std::string& host, uint16_t port, Deadline deadline) {
  auto pause = std::chrono::milliseconds(10);
  std::string last_error = "no attempt made";
  for (;;) {
    if (Fd s = try_connect(host, port, deadline, &last_error); s.valid()) return s;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      throw TimeoutError("could not connect to the TCPStore server at " + endpoint(host, port) +
                         " before the timeout (last error: " + last_error +
                         "). Is the master rank running, and are MASTER_ADDR/MASTER_PORT right? (The master's "
                         "store listens only on the address MASTER_ADDR names; see TDIST_STORE_BIND)");
    }
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::milliseconds(1000));
  }
}

Fd connect_tcp_once(const std::string& host, uint16_t port, Deadline deadline) {
  std::string error = "no attempt made";
  Fd s = try_connect(host, port, deadline, &error);
  if (!s.valid()) throw NetworkError("cannot connect to " + endpoint(host, port) + ": " + error);
  return s;
}

void send_all(int fd, const char* data, size_t size, Deadline deadline) {
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::send(fd, data + done, size - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_fd(fd, POLLOUT, deadline)) throw TimeoutError("sending to the TCPStore server timed out");
      continue;
    }
    throw NetworkError("send failed: " + errno_string(errno));
  }
}

size_t recv_some(int fd, char* data, size_t size, Deadline deadline) {
  for (;;) {
    ssize_t n = ::recv(fd, data, size, MSG_DONTWAIT);
    if (n >= 0) return static_cast<size_t>(n);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_fd(fd, POLLIN, deadline)) throw TimeoutError("receiving from the TCPStore server timed out");
      continue;
    }
    throw NetworkError("recv failed: " + errno_string(errno));
  }
}

uint16_t find_free_port() {
  Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) throw NetworkError("socket failed: " + errno_string(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw NetworkError("bind failed: " + errno_string(errno));
  }
  socklen_t len = sizeof addr;
  getsockname(s.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  return ntohs(addr.sin_port);
}

}  // namespace tdist::detail
