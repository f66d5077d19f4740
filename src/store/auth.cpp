#include "store/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdlib>

#include "store/wire.h"

namespace tdist::detail {

namespace {

Bytes hmac(const std::string& token, const std::string& label, const Bytes& a, const Bytes& b) {
  Bytes msg(label.begin(), label.end());
  msg.insert(msg.end(), a.begin(), a.end());
  msg.insert(msg.end(), b.begin(), b.end());
  Bytes out(EVP_MAX_MD_SIZE);
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), msg.data(), msg.size(),
            out.data(), &len)) {
    throw StoreError("TCPStore authentication: HMAC-SHA256 failed in OpenSSL");
  }
  out.resize(len);
  return out;
}

}  // namespace

std::string resolve_token(const std::optional<std::string>& explicit_token) {
  if (explicit_token) return *explicit_token;
  const char* env = std::getenv("TDIST_STORE_TOKEN");
  return env ? std::string(env) : std::string();
}

Bytes random_nonce() {
  Bytes n(wire::kNonceBytes);
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    throw StoreError("TCPStore authentication: OpenSSL could not produce random bytes");
  }
  return n;
}

Bytes client_mac(const std::string& token, const Bytes& server_nonce, const Bytes& client_nonce) {
  return hmac(token, "tdist-client", server_nonce, client_nonce);
}

Bytes server_mac(const std::string& token, const Bytes& server_nonce, const Bytes& client_nonce) {
  return hmac(token, "tdist-server", client_nonce, server_nonce);
}

bool macs_equal(const Bytes& a, const Bytes& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace tdist::detail
