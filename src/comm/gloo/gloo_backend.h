// The gloo backend (built when TDIST_WITH_GLOO is on).
#pragma once

#include <memory>
#include <string>

#include "comm/backend.h"

namespace tdist::comm::gloo_backend {

struct GlooOptions {
  std::string iface;     // network interface to use (TDIST_GLOO_IFNAME or GLOO_SOCKET_IFNAME)
  std::string hostname;  // or an address/host name to bind (TDIST_GLOO_HOSTNAME)
  // Neither: the local address that routes to the master.
  static GlooOptions from_env();
};

std::unique_ptr<Backend> make_gloo_backend(const BackendContext& ctx, const GlooOptions& options);

}  // namespace tdist::comm::gloo_backend
