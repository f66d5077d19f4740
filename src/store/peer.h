// Who is on the other end of an accepted TCP connection, for the store
// server's fairness between clients that have not authenticated yet.
//
// On this machine (loopback, or any address whose client socket lives in this
// network namespace) the answer is the uid that owns the client's socket,
// asked of the kernel through NETLINK_SOCK_DIAG with the connection's exact
// address pair: another local user cannot pose as the job's user. For a
// remote client it is the client's IP address (without the port).
#pragma once

#include <sys/socket.h>

#include <string>

#include "store/socket.h"

namespace tdist::detail {

class PeerIdentifier {
 public:
  PeerIdentifier();  // opens the netlink socket; without one, every key is an address
  // "uid N" or "address A" for the connection from `peer` to `local`. Never
  // blocks: the kernel answers an exact lookup within the send.
  std::string key(const sockaddr_storage& peer, const sockaddr_storage& local);

 private:
  Fd diag_;
  unsigned seq_ = 0;
};

}  // namespace tdist::detail
