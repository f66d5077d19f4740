// What this process has sent over TCP: the sum of tcpi_bytes_sent (RFC
// 4898's HCDataOctetsOut: payload bytes handed to the wire, retransmits
// included) over its open TCP sockets, read with getsockopt(TCP_INFO) on
// every descriptor in /proc/self/fd. Take the difference around what is
// measured: sockets opened and closed meanwhile are missed, which for a
// process group's long-lived connections (Gloo's pairs, the store) is none.
// Linux only; 0 where TCP_INFO lacks the field (kernels before 4.19).
#pragma once

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <linux/tcp.h>

namespace tdist::bench {

// Both counters of this process's open TCP sockets: what was sent
// (retransmits included) and what of it was sent again (tcpi_bytes_retrans:
// loss, or on a busy machine's loopback a tail-loss probe or a spurious
// timeout). sent - retransmitted is what the program asked to send.
struct TcpSent {
  uint64_t sent = 0;
  uint64_t retransmitted = 0;
};

inline TcpSent tcp_sent() {
  TcpSent total;
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return total;
  const int own = dirfd(dir);
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == own) continue;
    struct stat st {};
    if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    ::tcp_info info{};
    socklen_t len = sizeof info;
    if (getsockopt(static_cast<int>(fd), IPPROTO_TCP, TCP_INFO, &info, &len) != 0) continue;  // not TCP
    if (len >= offsetof(::tcp_info, tcpi_bytes_retrans) + sizeof info.tcpi_bytes_retrans) {
      total.sent += info.tcpi_bytes_sent;
      total.retransmitted += info.tcpi_bytes_retrans;
    }
  }
  closedir(dir);
  return total;
}

inline uint64_t tcp_bytes_sent() { return tcp_sent().sent; }

}  // namespace tdist::bench
