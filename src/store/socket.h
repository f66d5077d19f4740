// Thin POSIX socket helpers. Every blocking helper takes a deadline and
// raises TimeoutError past it; failures raise NetworkError with errno text.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace tdist::detail {

using Deadline = std::chrono::steady_clock::time_point;

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Binds and listens on host:port (host empty: every interface, IPv6
// dual-stack when the machine has it). Returns the socket (non-blocking) and
// the port actually bound in *bound_port.
Fd listen_tcp(const std::string& host, uint16_t port, uint16_t* bound_port);

// Connects to host:port, retrying with backoff while the server is not yet
// there (refused, unreachable) until deadline. The socket is blocking, with
// TCP_NODELAY.
Fd connect_tcp(const std::string& host, uint16_t port, Deadline deadline);
// One attempt (each address of host once, before the deadline): raises
// NetworkError naming host:port and why when none connects.
Fd connect_tcp_once(const std::string& host, uint16_t port, Deadline deadline);

// Sends all of data or throws.
void send_all(int fd, const char* data, size_t size, Deadline deadline);
// Receives up to size bytes, at least one; returns 0 at end of stream.
size_t recv_some(int fd, char* data, size_t size, Deadline deadline);

void set_nonblocking(int fd);
void set_nodelay(int fd);

// A port that is free right now on the loopback interface (for tests and the
// launcher's default; racy by nature, so callers should tolerate EADDRINUSE).
uint16_t find_free_port();

}  // namespace tdist::detail
