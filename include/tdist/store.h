// The Store: a small key-value store shared by all processes of a job.
//
// Ranks use it to find each other before any collective runs. Every
// implementation (TCPStore, FileStore, HashStore, PrefixStore) passes the same
// conformance suite (tests/store/store_conformance_test.cpp).
//
// Thread safety: every Store method may be called from several threads at
// once. Blocking calls (get, wait, multi_get) take a timeout; without one they
// use the store's default timeout(). A timeout raises tdist::TimeoutError
// naming the keys and how long the call waited.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tdist/errors.h"

namespace tdist {

using Bytes = std::vector<uint8_t>;
using Milliseconds = std::chrono::milliseconds;

// The default timeout of a new store, as in torch.distributed (5 minutes).
inline constexpr Milliseconds kDefaultStoreTimeout{300'000};

Bytes to_bytes(std::string_view s);
std::string to_string(const Bytes& b);

class Store {
 public:
  explicit Store(Milliseconds timeout = kDefaultStoreTimeout);
  virtual ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Sets key to value, waking every caller blocked on key.
  void set(const std::string& key, const Bytes& value);
  void set(const std::string& key, std::string_view value);

  // Returns the value of key, blocking until the key exists or the timeout
  // passes (TimeoutError).
  Bytes get(const std::string& key);
  Bytes get(const std::string& key, Milliseconds timeout);
  std::string get_string(const std::string& key);

  // Atomically adds delta to the integer held by key (a missing key counts
  // as 0) and returns the new value. The value is stored as decimal text, so
  // get() of a counter returns e.g. "42". Adding to a key whose value is not
  // an integer raises StoreError.
  int64_t add(const std::string& key, int64_t delta);

  // Atomically: if the current value of key equals expected (a missing key
  // equals the empty value), sets it to desired. Returns the value of key
  // after the call; an empty result means the key is (still) missing.
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired);

  // Blocks until every key exists (TimeoutError otherwise).
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, Milliseconds timeout);

  // True when every key exists right now; never blocks.
  bool check(const std::vector<std::string>& keys);

  // Removes key; returns whether it existed.
  bool delete_key(const std::string& key);

  // The number of keys in the store. A PrefixStore counts the keys of the
  // whole store under it, as in torch.distributed.
  int64_t num_keys();

  // Values of keys in order, blocking until all exist.
  std::vector<Bytes> multi_get(const std::vector<std::string>& keys);
  std::vector<Bytes> multi_get(const std::vector<std::string>& keys, Milliseconds timeout);

  // Sets keys[i] to values[i] for every i, as one request.
  void multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values);

  Milliseconds timeout() const { return Milliseconds(timeout_ms_.load(std::memory_order_relaxed)); }
  void set_timeout(Milliseconds timeout);

 protected:
  // Implementations receive validated arguments: keys are non-empty, sizes
  // of keys and values agree, timeouts are positive.
  virtual void do_set(const std::string& key, const Bytes& value) = 0;
  virtual std::vector<Bytes> do_get(const std::vector<std::string>& keys, Milliseconds timeout) = 0;
  virtual int64_t do_add(const std::string& key, int64_t delta) = 0;
  virtual Bytes do_compare_set(const std::string& key, const Bytes& expected,
                               const Bytes& desired) = 0;
  virtual void do_wait(const std::vector<std::string>& keys, Milliseconds timeout) = 0;
  virtual bool do_check(const std::vector<std::string>& keys) = 0;
  virtual bool do_delete_key(const std::string& key) = 0;
  virtual int64_t do_num_keys() = 0;
  virtual void do_multi_set(const std::vector<std::string>& keys,
                            const std::vector<Bytes>& values) = 0;

 private:
  std::atomic<int64_t> timeout_ms_;
};

// ---------------------------------------------------------------------------
// HashStore: in-process, for tests and for ranks that are threads.
class HashStore final : public Store {
 public:
  explicit HashStore(Milliseconds timeout = kDefaultStoreTimeout);
  ~HashStore() override;

 protected:
  void do_set(const std::string& key, const Bytes& value) override;
  std::vector<Bytes> do_get(const std::vector<std::string>& keys, Milliseconds timeout) override;
  int64_t do_add(const std::string& key, int64_t delta) override;
  Bytes do_compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void do_wait(const std::vector<std::string>& keys, Milliseconds timeout) override;
  bool do_check(const std::vector<std::string>& keys) override;
  bool do_delete_key(const std::string& key) override;
  int64_t do_num_keys() override;
  void do_multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// ---------------------------------------------------------------------------
// PrefixStore: every key is stored as "<prefix>/<key>" in the store under it.
// Used to give subgroups and separate jobs their own namespace.
class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);

  const std::shared_ptr<Store>& underlying_store() const { return store_; }

 protected:
  void do_set(const std::string& key, const Bytes& value) override;
  std::vector<Bytes> do_get(const std::vector<std::string>& keys, Milliseconds timeout) override;
  int64_t do_add(const std::string& key, int64_t delta) override;
  Bytes do_compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void do_wait(const std::vector<std::string>& keys, Milliseconds timeout) override;
  bool do_check(const std::vector<std::string>& keys) override;
  bool do_delete_key(const std::string& key) override;
  int64_t do_num_keys() override;
  void do_multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;

 private:
  std::string full(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> full(const std::vector<std::string>& keys) const;

  std::string prefix_;
  std::shared_ptr<Store> store_;
};

// ---------------------------------------------------------------------------
// FileStore: a store in one file, shared by processes on one host or on a
// shared filesystem. Every operation holds an exclusive lock on the file
// (flock), so operations are atomic across processes. The file is an
// append-only log of records; each FileStore replays what it has not yet
// seen. Each FileStore object counts as one user of the file: the last one to
// be destroyed removes the file. A truncated or corrupt file raises
// StoreError naming the path and offset.
class FileStore final : public Store {
 public:
  explicit FileStore(std::string path, Milliseconds timeout = kDefaultStoreTimeout);
  ~FileStore() override;

  const std::string& path() const;

 protected:
  void do_set(const std::string& key, const Bytes& value) override;
  std::vector<Bytes> do_get(const std::vector<std::string>& keys, Milliseconds timeout) override;
  int64_t do_add(const std::string& key, int64_t delta) override;
  Bytes do_compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void do_wait(const std::vector<std::string>& keys, Milliseconds timeout) override;
  bool do_check(const std::vector<std::string>& keys) override;
  bool do_delete_key(const std::string& key) override;
  int64_t do_num_keys() override;
  void do_multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// ---------------------------------------------------------------------------
// TCPStore: a server holds the data; every TCPStore object is a client of it.

// Limits the server enforces. A request over a limit closes only the
// connection that sent it; the server keeps serving everyone else.
struct TCPStoreLimits {
  size_t max_key_bytes = 64 * 1024;
  size_t max_value_bytes = 256u << 20;  // also bounds one multi_set
  size_t max_keys_per_request = 1 << 16;
  size_t max_connections = 8192;
  // Replies queued for a client that does not read them.
  size_t max_pending_reply_bytes = 512u << 20;
  // A client that has not authenticated yet (when the server has a token)
  // may send at most this many bytes, must finish the handshake within
  // handshake_timeout, and is one of at most max_handshaking such clients:
  // past that the oldest is dropped, so idle or flooding connections cannot
  // keep the job's ranks out.
  size_t max_handshake_bytes = 4096;
  Milliseconds handshake_timeout{10000};
  size_t max_handshaking = 128;
};

struct TCPStoreServerOptions {
  // Address to listen on: loopback unless told otherwise; "*" or "0.0.0.0"
  // for every interface.
  std::string host = "127.0.0.1";
  uint16_t port = 0;              // 0: pick a free port
  // Shared secret. When non-empty, a client must prove it holds the same
  // token (HMAC-SHA256 challenge-response; the token never crosses the
  // wire) before any command runs. Empty: read TDIST_STORE_TOKEN.
  std::optional<std::string> token;
  TCPStoreLimits limits;
};

// The server alone: an event loop (epoll) on a background thread. Used by the
// master TCPStore, or standalone (tools/tdist_store_server.cpp).
class TCPStoreServer {
 public:
  explicit TCPStoreServer(TCPStoreServerOptions options = {});
  ~TCPStoreServer();  // stops the loop and closes every connection
  TCPStoreServer(const TCPStoreServer&) = delete;
  TCPStoreServer& operator=(const TCPStoreServer&) = delete;

  uint16_t port() const;
  // Clients that completed the handshake since the server started.
  int64_t num_clients_joined() const;
  // The last few clients refused for a wrong or missing token, each as
  // "<address> (<how the client described itself>)". Also logged to stderr.
  std::vector<std::string> refused_clients() const;
  // Blocks until num_clients_joined() >= n; TimeoutError otherwise.
  void wait_for_clients(int64_t n, Milliseconds timeout) const;
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct TCPStoreOptions {
  uint16_t port = 29500;
  // Start a server in this process (the master rank). With port 0 the
  // server picks a free port, readable from TCPStore::port().
  bool is_server = false;
  // With is_server: the constructor waits until this many clients
  // (including its own) have connected.
  std::optional<int> num_workers;
  bool wait_for_workers = true;
  // Default timeout of blocking calls; also how long a client keeps
  // retrying to connect while the server is starting.
  Milliseconds timeout = kDefaultStoreTimeout;
  // See TCPStoreServerOptions::token; a client uses the same rule.
  std::optional<std::string> token;
  TCPStoreLimits limits;  // for the server, when is_server
  // With is_server: the address the server listens on. Default: the
  // TDIST_STORE_BIND environment variable if set, else `host` itself (the
  // address the other ranks connect to), so a job whose master address is
  // loopback is reachable from this machine only. "*" listens on every
  // interface.
  std::optional<std::string> bind_address;
  // How this client describes itself to the server (as "rank 3"); the
  // server names it when it refuses the client's token.
  std::string client_name;
};

// On the master (is_server), the server lives exactly as long as this
// object: keep it until the other ranks have had their last reply.
class TCPStore final : public Store {
 public:
  TCPStore(std::string host, TCPStoreOptions options = {});
  ~TCPStore() override;

  const std::string& host() const;
  uint16_t port() const;
  // The server owned by this store, or nullptr on a client.
  TCPStoreServer* server() const;

 protected:
  void do_set(const std::string& key, const Bytes& value) override;
  std::vector<Bytes> do_get(const std::vector<std::string>& keys, Milliseconds timeout) override;
  int64_t do_add(const std::string& key, int64_t delta) override;
  Bytes do_compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void do_wait(const std::vector<std::string>& keys, Milliseconds timeout) override;
  bool do_check(const std::vector<std::string>& keys) override;
  bool do_delete_key(const std::string& key) override;
  int64_t do_num_keys() override;
  void do_multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tdist
