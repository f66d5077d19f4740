// The built-in rendezvous store (run/rdzv_store.h): a TCPStore hosted by
// the first launcher that can listen at the endpoint.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "run/rdzv_store.h"
#include "tdist/errors.h"
#include "tdist/store.h"

namespace tdist_run {

namespace {

// The store's host: a process of its own (see the header), serving until
// the launcher that forked it is gone. Writes 'y' to `report` once it
// listens, or 'n' and why it cannot.
[[noreturn]] void serve_store(pid_t launcher, int report, const RdzvStoreOptions& o) {
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != launcher) _exit(1);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE}) signal(sig, SIG_IGN);
  prctl(PR_SET_NAME, "tdist-run-store");
  std::unique_ptr<tdist::TCPStoreServer> server;
  std::string answer = "y";
  try {
    tdist::TCPStoreServerOptions so;
    const char* bind = std::getenv("TDIST_STORE_BIND");
    so.host = bind && *bind ? bind : o.endpoint_host;
    so.port = static_cast<uint16_t>(o.endpoint_port);
    so.token = o.token;
    server = std::make_unique<tdist::TCPStoreServer>(so);
  } catch (const std::exception& e) {
    answer = std::string("n") + e.what();
  }
  (void)!write(report, answer.data(), answer.size());
  close(report);
  if (!server) _exit(0);
  for (;;) pause();
}

// Forks the host; its pid, or -1 and *error when it cannot listen.
pid_t start_host(const RdzvStoreOptions& o, std::string* error) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw tdist::Error(std::string("tdist-run: pipe: ") + std::strerror(errno));
  std::fflush(nullptr);
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) throw tdist::Error(std::string("tdist-run: fork: ") + std::strerror(errno));
  if (pid == 0) {
    close(fds[0]);
    serve_store(launcher, fds[1], o);
  }
  close(fds[1]);
  std::string answer;
  char buf[512];
  for (;;) {
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  if (answer == "y") return pid;
  *error = answer.empty() ? "its process died" : answer.substr(1);
  waitpid(pid, nullptr, 0);
  return -1;
}

class BuiltinStore final : public RdzvStore {
 public:
  explicit BuiltinStore(const RdzvStoreOptions& o) : o_(o) {
    std::string host_error;
    host_pid_ = start_host(o, &host_error);
    tdist::TCPStoreOptions co;
    co.port = static_cast<uint16_t>(o.endpoint_port);
    co.is_server = false;
    co.token = o.token;
    co.timeout = kRdzvCallTimeout;  // joining waits as long for a host that starts late
    char host[256] = "?";
    gethostname(host, sizeof host - 1);
    co.client_name = std::string("tdist-run on ") + host;
    try {
      store_ = std::make_unique<tdist::TCPStore>(o.endpoint_host, co);
    } catch (const std::exception& e) {
      stop_host();
      throw tdist::Error("tdist-run: cannot reach the rendezvous store at " + o.endpoint_host + ":" +
                         std::to_string(o.endpoint_port) + ": " + e.what() +
                         (host_error.empty() ? "" : " (and cannot host it here: " + host_error + ")"));
    }
  }
  ~BuiltinStore() override {
    store_.reset();
    stop_host();
  }

  std::optional<std::string> get(const std::string& key) override {
    if (!store_->check({key})) return std::nullopt;
    return store_->get_string(key);
  }
  void set(const std::string& key, const std::string& value) override { store_->set(key, value); }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    return tdist::to_string(store_->compare_set(key, tdist::to_bytes(expected), tdist::to_bytes(desired)));
  }
  void beat(const std::string& key) override { store_->add(key, 1); }
  std::optional<int64_t> read_beat(const std::string& key) override { return store_->add(key, 0); }
  bool durable() const override { return false; }
  void set_call_timeout(std::chrono::milliseconds timeout) override { store_->set_timeout(timeout); }
  pid_t host_pid() const override { return host_pid_; }
  std::string describe() const override {
    return "the rendezvous at " + o_.endpoint_host + ":" + std::to_string(o_.endpoint_port);
  }

 private:
  void stop_host() {
    if (host_pid_ <= 0) return;
    kill(host_pid_, SIGKILL);
    waitpid(host_pid_, nullptr, 0);
    host_pid_ = -1;
  }

  RdzvStoreOptions o_;
  pid_t host_pid_ = -1;
  std::unique_ptr<tdist::TCPStore> store_;
};

}  // namespace

std::unique_ptr<RdzvStore> make_builtin_rdzv_store(const RdzvStoreOptions& o) {
  return std::make_unique<BuiltinStore>(o);
}

}  // namespace tdist_run
