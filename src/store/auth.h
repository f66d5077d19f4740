// Shared-secret authentication for the TCPStore: a challenge-response with
// HMAC-SHA256, in both directions, so the token never crosses the wire and a
// client also knows it reached a server holding the same token.
//
//   server -> client  hello: server_nonce
//   client -> server  auth:  client_nonce, HMAC(token, "tdist-client" | server_nonce | client_nonce)
//   server -> client  ok:    HMAC(token, "tdist-server" | client_nonce | server_nonce)
#pragma once

#include <optional>
#include <string>

#include "tdist/store.h"

namespace tdist::detail {

// The token to use: the explicit one if given, else TDIST_STORE_TOKEN, else
// empty (no authentication).
std::string resolve_token(const std::optional<std::string>& explicit_token);

Bytes random_nonce();
Bytes client_mac(const std::string& token, const Bytes& server_nonce, const Bytes& client_nonce);
Bytes server_mac(const std::string& token, const Bytes& server_nonce, const Bytes& client_nonce);
// Constant-time comparison.
bool macs_equal(const Bytes& a, const Bytes& b);

}  // namespace tdist::detail
