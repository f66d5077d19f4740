#include "run/elastic_agent.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "store/socket.h"
#include "tdist/errors.h"
#include "tdist/store.h"
#include "util/env.h"

namespace tdist_run {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kPollInterval{100};
// A round whose agents have not bumped its beat counter for this long is
// taken for dead (every one of its launchers was killed): the agents
// waiting for it to end end it themselves.
constexpr milliseconds kDeadRound{15'000};

std::string seconds_text(milliseconds d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(d.count()) / 1000);
  return buf;
}

int64_t parse_count(const std::string& text, const std::string& what) {
  const auto v = tdist::detail::parse_int(text);
  if (!v || *v < 0) throw tdist::StoreError("tdist-run: the rendezvous store holds '" + text + "' for " + what);
  return *v;
}

// The store's host: a process of its own (see the header), serving until
// the launcher that forked it is gone. Writes 'y' to `report` once it
// listens, or 'n' and why it cannot.
[[noreturn]] void serve_store(pid_t launcher, int report, const ElasticOptions& o) {
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

}  // namespace

ElasticAgent::ElasticAgent(ElasticOptions options) : o_(std::move(options)) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw tdist::Error(std::string("tdist-run: pipe: ") + std::strerror(errno));
  std::fflush(nullptr);
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) throw tdist::Error(std::string("tdist-run: fork: ") + std::strerror(errno));
  if (pid == 0) {
    close(fds[0]);
    serve_store(launcher, fds[1], o_);
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
  std::string host_error;
  if (answer == "y") {
    host_pid_ = pid;
  } else {
    host_error = answer.empty() ? "its process died" : answer.substr(1);
    waitpid(pid, nullptr, 0);
  }
  tdist::TCPStoreOptions co;
  co.port = static_cast<uint16_t>(o_.endpoint_port);
  co.is_server = false;
  co.token = o_.token;
  co.timeout = milliseconds(60'000);
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  co.client_name = std::string("tdist-run on ") + host;
  try {
    store_ = std::make_unique<tdist::TCPStore>(o_.endpoint_host, co);
  } catch (const std::exception& e) {
    throw tdist::Error("tdist-run: cannot reach the rendezvous store at " + o_.endpoint_host + ":" +
                       std::to_string(o_.endpoint_port) + ": " + e.what() +
                       (host_error.empty() ? "" : " (and cannot host it here: " + host_error + ")"));
  }
}

ElasticAgent::~ElasticAgent() {
  store_.reset();
  if (host_pid_ > 0) {
    kill(host_pid_, SIGKILL);
    waitpid(host_pid_, nullptr, 0);
  }
}

std::string ElasticAgent::key(int64_t round, const std::string& name) const {
  return "tdist-run/round/" + std::to_string(round) + "/" + name;
}

std::optional<std::string> ElasticAgent::get_if(const std::string& k) {
  if (!store_->check({k})) return std::nullopt;
  return store_->get_string(k);
}

void ElasticAgent::try_close(int64_t round, int64_t nodes) {
  store_->compare_set(key(round, "closed"), {}, tdist::to_bytes(std::to_string(nodes)));
}

std::optional<Membership> ElasticAgent::rendezvous(const std::function<bool()>& interrupted) {
  int64_t g = next_round_;
  if (auto r = get_if("tdist-run/round")) g = std::max(g, parse_count(*r, "the newest round"));
  const auto deadline = Clock::now() + o_.join_timeout;
  for (;;) {
    // Announce the round, so that an agent started later looks here first.
    for (std::string cur = get_if("tdist-run/round").value_or("");;) {
      if (!cur.empty() && parse_count(cur, "the newest round") >= g) break;
      const std::string now = tdist::to_string(
          store_->compare_set("tdist-run/round", tdist::to_bytes(cur), tdist::to_bytes(std::to_string(g))));
      if (now == std::to_string(g) || now == cur) break;
      cur = now;
    }
    const int64_t index = store_->add(key(g, "joined"), 1) - 1;
    std::optional<Clock::time_point> min_seen;
    int64_t last_beat = -1;
    Clock::time_point beat_seen = Clock::now();
    bool late = false;
    while (!late) {
      if (interrupted()) throw tdist::Error("tdist-run: interrupted in the rendezvous");
      if (auto a = get_if("tdist-run/abort")) throw tdist::Error("tdist-run: the job was given up: " + *a);
      if (auto c = get_if(key(g, "closed"))) {
        const int64_t nodes = parse_count(*c, "a round's node count");
        if (index >= nodes) {
          late = true;  // wait in the next round
          continue;
        }
        round_ = g;
        next_round_ = g + 1;
        nodes_ = static_cast<int>(nodes);
        Membership m;
        m.round = g;
        m.node = static_cast<int>(index);
        m.nodes = nodes_;
        store_->set(key(g, "nproc/" + std::to_string(index)), std::to_string(o_.nproc));
        if (index == 0) {
          store_->set(key(g, "master"),
                      o_.local_addr + ":" + std::to_string(tdist::detail::find_free_port()));
        }
        const auto left = [&] {
          return std::max(milliseconds(1000), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
        };
        const std::string master = tdist::to_string(store_->get(key(g, "master"), left()));
        const size_t colon = master.rfind(':');
        const auto port = tdist::detail::parse_int(colon == std::string::npos ? "" : master.substr(colon + 1));
        if (!port || *port < 1 || *port > 65535) {
          throw tdist::StoreError("tdist-run: the rendezvous store holds '" + master + "' for the ranks' store");
        }
        m.master_addr = master.substr(0, colon);
        m.master_port = static_cast<int>(*port);
        for (int64_t j = 0; j < nodes; ++j) {
          const int64_t n = parse_count(tdist::to_string(store_->get(key(g, "nproc/" + std::to_string(j)), left())),
                                        "a node's rank count");
          if (n < 1 || n > 4096) throw tdist::StoreError("tdist-run: node " + std::to_string(j) + " has " +
                                                         std::to_string(n) + " ranks");
          if (j < index) m.first_rank += static_cast<int>(n);
          m.world_size += static_cast<int>(n);
        }
        return m;
      }
      // Round g-1 has ended: by a restart, by finishing, or by every agent
      // of it going silent.
      bool prev_ended = g == 0 || next_round_ == g;
      if (!prev_ended) {
        if (get_if(key(g - 1, "finished"))) return std::nullopt;  // the job is done without this node
        prev_ended = store_->check({key(g - 1, "restart")}) || !store_->check({key(g - 1, "closed")});
        if (!prev_ended) {
          const int64_t beat = store_->add(key(g - 1, "beat"), 0);
          if (beat != last_beat) {
            last_beat = beat;
            beat_seen = Clock::now();
          } else if (Clock::now() - beat_seen > kDeadRound) {
            store_->compare_set(key(g - 1, "restart"), {},
                                tdist::to_bytes("round " + std::to_string(g - 1) + "'s launchers stopped answering"));
            prev_ended = true;
          }
        }
      }
      const int64_t n = store_->add(key(g, "joined"), 0);
      if (prev_ended && n >= o_.max_nodes) {
        try_close(g, o_.max_nodes);
        continue;
      }
      if (prev_ended && n >= o_.min_nodes) {
        if (!min_seen) min_seen = Clock::now();
        if (Clock::now() - *min_seen >= o_.last_call) {
          try_close(g, n);
          continue;
        }
      }
      if (Clock::now() > deadline) {
        throw tdist::TimeoutError("tdist-run: waited " + seconds_text(o_.join_timeout) + " in rendezvous round " +
                                  std::to_string(g) + " at " + o_.endpoint_host + ":" +
                                  std::to_string(o_.endpoint_port) + ": " + std::to_string(n) +
                                  " node(s) came, the job needs " + std::to_string(o_.min_nodes) + " to " +
                                  std::to_string(o_.max_nodes) +
                                  (prev_ended ? "" : " (and the previous round's nodes are still running)"));
      }
      std::this_thread::sleep_for(kPollInterval);
    }
    ++g;
  }
}

std::optional<StopRequest> ElasticAgent::poll() {
  store_->add(key(round_, "beat"), 1);
  if (auto a = get_if("tdist-run/abort")) return StopRequest{StopRequest::kAbort, *a};
  std::optional<std::string> why = get_if(key(round_, "restart"));
  if (!why && nodes_ < o_.max_nodes && store_->add(key(round_ + 1, "joined"), 0) > 0) {
    why = tdist::to_string(store_->compare_set(key(round_, "restart"), {},
                                               tdist::to_bytes("membership: a node is waiting to join")));
  }
  if (!why) return std::nullopt;
  const bool membership = why->rfind("membership: ", 0) == 0;
  return StopRequest{membership ? StopRequest::kMembership : StopRequest::kRestart, *why};
}

void ElasticAgent::request_restart(const std::string& why) {
  store_->compare_set(key(round_, "restart"), {}, tdist::to_bytes(why));
}

void ElasticAgent::abort(const std::string& why) {
  store_->compare_set("tdist-run/abort", {}, tdist::to_bytes(why));
  // The host lingers a moment, so that the others read why before its
  // store is gone.
  if (hosts_store()) std::this_thread::sleep_for(milliseconds(2000));
}

bool ElasticAgent::finish(const std::function<bool()>& interrupted) {
  store_->add(key(round_, "done"), 1);
  const auto deadline = Clock::now() + o_.exit_barrier;
  for (;;) {
    store_->add(key(round_, "beat"), 1);
    if (interrupted()) throw tdist::Error("tdist-run: interrupted while waiting for the other nodes to finish");
    if (auto a = get_if("tdist-run/abort")) throw tdist::Error("tdist-run: the job was given up: " + *a);
    const int64_t done = store_->add(key(round_, "done"), 0);
    if (done >= nodes_) {
      store_->set(key(round_, "finished"), "1");
      break;
    }
    if (store_->check({key(round_, "restart")})) return false;
    if (Clock::now() > deadline) {
      throw tdist::TimeoutError("tdist-run: this node's ranks finished, but only " + std::to_string(done) + " of " +
                                std::to_string(nodes_) + " nodes' had after " + seconds_text(o_.exit_barrier));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  // Every agent counts itself out; the host keeps the store until all
  // have (or a few seconds), so none finds it gone.
  store_->add(key(round_, "left"), 1);
  if (hosts_store()) {
    const auto until = Clock::now() + milliseconds(5000);
    while (Clock::now() < until && store_->add(key(round_, "left"), 0) < nodes_) std::this_thread::sleep_for(kPollInterval);
  }
  return true;
}

}  // namespace tdist_run
