// The TCP sockets of a process (those it listens on, and the others), read from /proc: its socket inodes
// (/proc/PID/fd) matched against the kernel's tables (/proc/net/tcp, tcp6).
// Tests use it to check what a job exposes to the network.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace tdist::test {

struct ListeningSocket {
  std::string address;  // the local address, as inet_ntop writes it
  uint16_t port = 0;
  bool listening = false;  // else connected (or connecting, closing)
  bool loopback() const {
    return address.rfind("127.", 0) == 0 || address == "::1" || address.rfind("::ffff:127.", 0) == 0;
  }
  std::string text() const { return address + ":" + std::to_string(port); }
};

namespace detail_listening {

inline std::set<std::string> socket_inodes(pid_t pid) {
  std::set<std::string> inodes;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = opendir(dir.c_str());
  if (!d) return inodes;
  while (dirent* e = readdir(d)) {
    char target[256];
    const ssize_t n = readlink((dir + "/" + e->d_name).c_str(), target, sizeof target - 1);
    if (n <= 0) continue;
    const std::string t(target, static_cast<size_t>(n));
    if (t.rfind("socket:[", 0) == 0) inodes.insert(t.substr(8, t.size() - 9));
  }
  closedir(d);
  return inodes;
}

// "0100007F" (v4) or 32 hex digits (v6): 32-bit words in host order.
inline std::string address_from_hex(const std::string& hex) {
  unsigned char bytes[16];
  const size_t words = hex.size() / 8;
  for (size_t w = 0; w < words; ++w) {
    const uint32_t v = static_cast<uint32_t>(std::strtoul(hex.substr(w * 8, 8).c_str(), nullptr, 16));
    std::memcpy(bytes + 4 * w, &v, 4);
  }
  char text[INET6_ADDRSTRLEN] = "";
  inet_ntop(words == 1 ? AF_INET : AF_INET6, bytes, text, sizeof text);
  return text;
}

}  // namespace detail_listening

// Every TCP socket of the process, listening or not.
inline std::vector<ListeningSocket> tcp_sockets(pid_t pid = getpid()) {
  const auto inodes = detail_listening::socket_inodes(pid);
  std::vector<ListeningSocket> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retr, uid, timeout, inode;
      f >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (!inodes.count(inode)) continue;
      const size_t colon = local.find(':');
      ListeningSocket s;
      s.address = detail_listening::address_from_hex(local.substr(0, colon));
      s.port = static_cast<uint16_t>(std::strtoul(local.substr(colon + 1).c_str(), nullptr, 16));
      s.listening = state == "0A";  // TCP_LISTEN
      out.push_back(s);
    }
  }
  return out;
}

inline std::vector<ListeningSocket> listening_sockets(pid_t pid = getpid()) {
  std::vector<ListeningSocket> out;
  for (const auto& s : tcp_sockets(pid)) {
    if (s.listening) out.push_back(s);
  }
  return out;
}

}  // namespace tdist::test
