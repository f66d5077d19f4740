#include "store/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cctype>
#include <cstdlib>
#include <cstring>

#include "store/wire.h"
#include "util/open_file.h"
#include "util/private_file.h"

namespace tdist::detail {

namespace {

Bytes hmac(const std::string& token, const std::string& label, const Bytes& a, const Bytes& b) {
  Bytes msg(label.begin(), label.end());
  msg.insert(msg.end(), a.begin(), a.end());
  msg.insert(msg.end(), b.begin(), b.end());
  return hmac_sha256(token, msg);
}

}  // namespace

Bytes hmac_sha256(const std::string& key, const Bytes& message) {
  Bytes out(EVP_MAX_MD_SIZE);
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), message.data(), message.size(), out.data(),
            &len)) {
    throw StoreError("HMAC-SHA256 failed in OpenSSL");
  }
  out.resize(len);
  return out;
}

std::string resolve_token(const std::optional<std::string>& explicit_token) {
  if (explicit_token) return *explicit_token;
  if (const char* env = std::getenv("TDIST_STORE_TOKEN"); env && *env) return env;
  if (const char* file = std::getenv("TDIST_STORE_TOKEN_FILE"); file && *file) return read_token_file(file);
  return {};
}

std::string read_token_file(const std::string& path) {
  const std::string what = "token file '" + path + "'";
  // Not through a link, and never blocking on a FIFO or device put there.
  std::string error;
  const int fd = open_regular(path, O_RDONLY | O_NOFOLLOW, error);
  if (fd < 0) throw UsageError("the token file " + error);
  std::string text;
  try {
    if (const std::string why = why_not_private(fd); !why.empty()) {
      throw UsageError("the " + what + " " + why + ": a job's token must be readable by its user alone "
                       "(chmod 600 the file, and make a new token if others could read it)");
    }
    char buf[4096];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw UsageError("cannot read the " + what + ": " + std::strerror(errno));
      if (n == 0) break;
      text.append(buf, static_cast<size_t>(n));
      if (text.size() > (1u << 16)) throw UsageError("the " + what + " is over 64 KiB; a token is one line");
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  if (text.empty()) throw UsageError("the " + what + " is empty");
  return text;
}

std::string generate_token() {
  unsigned char raw[32];
  if (RAND_bytes(raw, sizeof raw) != 1) {
    throw StoreError("cannot make a job token: OpenSSL could not produce random bytes");
  }
  static const char* digits = "0123456789abcdef";
  std::string hex;
  for (unsigned char b : raw) {
    hex.push_back(digits[b >> 4]);
    hex.push_back(digits[b & 15]);
  }
  return hex;
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
