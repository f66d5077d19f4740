// Shared-secret authentication for the TCPStore: a challenge-response with
// HMAC-SHA256, in both directions, so the token never crosses the wire and a
// client also knows it reached a server holding the same token.
//
//   server -> client  hello: server_nonce
//   client -> server  auth:  client_nonce, HMAC(token, "tdist-client" | server_nonce | client_nonce)
//                            [, who: how the client describes itself, for the server's refusal log]
//   server -> client  ok:    HMAC(token, "tdist-server" | client_nonce | server_nonce)
//
// Where the token comes from (resolve_token): the explicit one, else
// TDIST_STORE_TOKEN, else the file TDIST_STORE_TOKEN_FILE names (which must
// belong to this user and be unreadable by others), else none. tdist-run
// puts a fresh random token in every single-node job's environment.
#pragma once

#include <optional>
#include <string>

#include "tdist/store.h"

namespace tdist::detail {

// The token to use (see above); empty: no authentication.
std::string resolve_token(const std::optional<std::string>& explicit_token);

// Reads a token file: its content without trailing white space. Raises
// UsageError naming the file when it is missing, empty, not owned by this
// user, or readable or writable by group or others.
std::string read_token_file(const std::string& path);

// A new job token: 32 bytes from the operating system's cryptographic
// source, as 64 hex digits.
std::string generate_token();

Bytes random_nonce();
// HMAC-SHA256 of message under key: 32 bytes.
Bytes hmac_sha256(const std::string& key, const Bytes& message);
Bytes client_mac(const std::string& token, const Bytes& server_nonce, const Bytes& client_nonce);
Bytes server_mac(const std::string& token, const Bytes& server_nonce, const Bytes& client_nonce);
// Constant-time comparison.
bool macs_equal(const Bytes& a, const Bytes& b);

}  // namespace tdist::detail
