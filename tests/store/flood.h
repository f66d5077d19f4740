// A connection flood against a store port, from another user where this
// machine allows it: the attack of issue 34 item 1. The flood runs in a
// forked child that, when started as root, drops to uid/gid 65534 (nobody)
// first. It keeps `connections` connections open to 127.0.0.1:port, opening
// a new one at once for every one the server closes (or refuses: the port
// may not be listened on yet); every third of them sends a junk frame one
// byte at a time, 20 ms apart. Nothing it does authenticates.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace tdist::test {

class Flood {
 public:
  // Starts the flood. as_other_user: drop to nobody first; if that fails the
  // flood does not run and why_not() says why.
  Flood(uint16_t port, int connections, bool as_other_user) {
    int ready[2];
    if (pipe(ready) != 0) {
      why_not_ = "pipe failed";
      return;
    }
    pid_ = fork();
    if (pid_ == 0) {
      close(ready[0]);
      std::string err;
      if (as_other_user) {
        if (getuid() != 0) {
          err = "not root, so the flood cannot run as another user";
        } else if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) {
          err = "setuid(nobody) failed";
        } else if (getuid() != 65534) {
          err = "still not nobody after setuid";
        }
      }
      const char status = err.empty() ? 'y' : 'n';
      ssize_t ignored = write(ready[1], &status, 1);
      if (!err.empty()) ignored = write(ready[1], err.data(), err.size());
      (void)ignored;
      close(ready[1]);
      if (!err.empty()) _exit(0);
      run(port, connections);
    }
    close(ready[1]);
    char buf[256];
    const ssize_t n = read(ready[0], buf, sizeof buf);
    close(ready[0]);
    if (n <= 0 || buf[0] != 'y') {
      why_not_ = n > 1 ? std::string(buf + 1, static_cast<size_t>(n - 1)) : "the flood process did not start";
      stop();
    }
  }
  ~Flood() { stop(); }
  Flood(const Flood&) = delete;
  Flood& operator=(const Flood&) = delete;

  bool running() const { return pid_ > 0 && why_not_.empty(); }
  const std::string& why_not() const { return why_not_; }

  void stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  struct Conn {
    int fd = -1;
    bool slow = false;
    size_t sent = 0;
  };

  static int open_one(uint16_t port) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);  // EINPROGRESS; refusals show as POLLERR
    return fd;
  }

  [[noreturn]] static void run(uint16_t port, int connections) {
    // A frame that claims 1000 bytes of an unknown op, never completed.
    std::string junk(4, '\0');
    junk[0] = static_cast<char>(0xe8);
    junk[1] = 0x03;
    junk += std::string(996, 'j');
    std::vector<Conn> conns(static_cast<size_t>(connections));
    for (size_t i = 0; i < conns.size(); ++i) conns[i].slow = i % 3 == 0;
    auto last_drip = std::chrono::steady_clock::now();
    for (;;) {
      std::vector<pollfd> pfds;
      for (auto& c : conns) {
        if (c.fd < 0) {
          c.fd = open_one(port);
          c.sent = 0;
        }
        pfds.push_back({c.fd, POLLIN, 0});
      }
      if (poll(pfds.data(), pfds.size(), 10) < 0) continue;
      char buf[4096];
      for (size_t i = 0; i < conns.size(); ++i) {
        if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        const ssize_t n = recv(conns[i].fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) continue;  // the server's hello: ignored
        close(conns[i].fd);   // closed or refused: come back at once
        conns[i].fd = -1;
      }
      if (std::chrono::steady_clock::now() - last_drip >= std::chrono::milliseconds(20)) {
        last_drip = std::chrono::steady_clock::now();
        for (auto& c : conns) {
          if (c.fd >= 0 && c.slow && c.sent < junk.size() &&
              send(c.fd, junk.data() + c.sent, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1) {
            ++c.sent;
          }
        }
      }
    }
  }

  pid_t pid_ = -1;
  std::string why_not_;
};

}  // namespace tdist::test
