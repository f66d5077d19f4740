#include "store/peer.h"

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

namespace tdist::detail {

namespace {

// An address as (family, 16 bytes, port in network order); a v4-mapped IPv6
// address becomes the IPv4 one, as the client's own socket is IPv4 then.
struct Endpoint {
  int family = AF_UNSPEC;
  uint32_t addr[4] = {0, 0, 0, 0};
  uint16_t port_be = 0;
};

std::optional<Endpoint> endpoint_of(const sockaddr_storage& a) {
  Endpoint e;
  if (a.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(a);
    e.family = AF_INET;
    e.addr[0] = v4.sin_addr.s_addr;
    e.port_be = v4.sin_port;
    return e;
  }
  if (a.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
    e.port_be = v6.sin6_port;
    if (IN6_IS_ADDR_V4MAPPED(&v6.sin6_addr)) {
      e.family = AF_INET;
      std::memcpy(&e.addr[0], &v6.sin6_addr.s6_addr[12], 4);
    } else {
      e.family = AF_INET6;
      std::memcpy(e.addr, &v6.sin6_addr, 16);
    }
    return e;
  }
  return std::nullopt;
}

std::string address_text(const Endpoint& e) {
  char text[INET6_ADDRSTRLEN] = "?";
  inet_ntop(e.family, e.addr, text, sizeof text);
  return text;
}

}  // namespace

PeerIdentifier::PeerIdentifier() {
  diag_.reset(::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, NETLINK_SOCK_DIAG));
}

std::string PeerIdentifier::key(const sockaddr_storage& peer_addr, const sockaddr_storage& local_addr) {
  const auto peer = endpoint_of(peer_addr);
  const auto local = endpoint_of(local_addr);
  if (!peer) return "address ?";
  const std::string by_address = "address " + address_text(*peer);
  if (!diag_.valid() || !local || local->family != peer->family) return by_address;

  // The client's socket: its source is the peer, its destination us.
  struct {
    nlmsghdr nlh;
    inet_diag_req_v2 req;
  } msg{};
  msg.nlh.nlmsg_len = sizeof msg;
  msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  msg.nlh.nlmsg_flags = NLM_F_REQUEST;
  msg.nlh.nlmsg_seq = ++seq_;
  msg.req.sdiag_family = static_cast<uint8_t>(peer->family);
  msg.req.sdiag_protocol = IPPROTO_TCP;
  msg.req.idiag_states = ~0u;
  msg.req.id.idiag_sport = peer->port_be;
  msg.req.id.idiag_dport = local->port_be;
  std::memcpy(msg.req.id.idiag_src, peer->addr, sizeof peer->addr);
  std::memcpy(msg.req.id.idiag_dst, local->addr, sizeof local->addr);
  msg.req.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  msg.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(diag_.get(), &msg, sizeof msg, 0, reinterpret_cast<sockaddr*>(&kernel), sizeof kernel) !=
      static_cast<ssize_t>(sizeof msg)) {
    return by_address;
  }
  // The answer (or an error: not a socket of this namespace) is queued by
  // the time sendto returns; anything else queued is a stale answer.
  alignas(nlmsghdr) char buf[8192];
  for (int tries = 0; tries < 4; ++tries) {
    const ssize_t got = ::recv(diag_.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return by_address;
    int len = static_cast<int>(got);
    for (auto* h = reinterpret_cast<nlmsghdr*>(buf); NLMSG_OK(h, len); h = NLMSG_NEXT(h, len)) {
      if (h->nlmsg_seq != seq_) continue;
      if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY || h->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg))) {
        return by_address;  // NLMSG_ERROR: not found here
      }
      const auto* d = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
      return "uid " + std::to_string(d->idiag_uid);
    }
  }
  return by_address;
}

}  // namespace tdist::detail
