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
// A node of a round whose beat has not changed for this long is taken for
// lost (its launcher was killed, or its machine is gone).
constexpr milliseconds kDeadNode{10'000};
// How long the nodes of a closed round have to say they are there.
constexpr milliseconds kMemberWait{10'000};
// Round numbers stay far below overflow, whatever the store holds.
constexpr int64_t kMaxRound = int64_t(1) << 40;

std::string seconds_text(milliseconds d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(d.count()) / 1000);
  return buf;
}

int64_t parse_count(const std::string& text, const std::string& what, int64_t most) {
  const auto v = tdist::detail::parse_int(text);
  if (!v || *v < 0 || *v > most) throw tdist::StoreError("tdist-run: the rendezvous store holds '" + text + "' for " + what);
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

std::string ElasticAgent::key(const std::string& name) const { return "tdist-run/" + o_.run_id + "/" + name; }

std::string ElasticAgent::key(int64_t round, const std::string& name) const {
  return key("round/" + std::to_string(round) + "/" + name);
}

std::optional<std::string> ElasticAgent::get_if(const std::string& k) {
  if (!store_->check({k})) return std::nullopt;
  return store_->get_string(k);
}

void ElasticAgent::try_close(int64_t round, int64_t nodes) {
  store_->compare_set(key(round, "closed"), {}, tdist::to_bytes(std::to_string(nodes)));
}

StopRequest ElasticAgent::restart_reason(const std::string& why) const {
  const bool membership = why.rfind("membership: ", 0) == 0;
  return StopRequest{membership ? StopRequest::kMembership : StopRequest::kRestart, why};
}

// What a waiting agent has seen of each node of the round before its own.
struct ElasticAgent::Watch {
  std::vector<int64_t> beat;
  std::vector<Clock::time_point> since;
};

bool ElasticAgent::round_over(int64_t r, Watch& w) {
  const auto closed = get_if(key(r, "closed"));
  if (!closed) return true;  // never closed: nobody runs in it
  const int64_t nodes = parse_count(*closed, "a round's node count", 1 << 20);
  if (w.beat.size() != static_cast<size_t>(nodes)) {
    w.beat.assign(static_cast<size_t>(nodes), -1);
    w.since.assign(static_cast<size_t>(nodes), Clock::now());
  }
  bool all_out = true;
  for (int64_t j = 0; j < nodes; ++j) {
    if (store_->check({key(r, "stopped/" + std::to_string(j))})) continue;
    const int64_t beat = store_->add(key(r, "beat/" + std::to_string(j)), 0);
    if (beat != w.beat[j]) {
      w.beat[j] = beat;
      w.since[j] = Clock::now();
    }
    if (Clock::now() - w.since[j] < kDeadNode) all_out = false;
  }
  if (!all_out) return false;
  // Every node of it stopped or went silent: over, by a restart if none was asked.
  if (!store_->check({key(r, "restart")})) {
    store_->compare_set(key(r, "restart"), {},
                        tdist::to_bytes("round " + std::to_string(r) + "'s launchers stopped answering"));
  }
  return true;
}

std::optional<Membership> ElasticAgent::take_place(int64_t g, int64_t index, int64_t nodes,
                                                   const std::function<bool()>& interrupted) {
  round_ = g;
  node_ = static_cast<int>(index);
  nodes_ = static_cast<int>(nodes);
  next_round_ = g + 1;
  store_->set(key(g, "nproc/" + std::to_string(index)), std::to_string(o_.nproc));
  if (index == 0) {
    store_->set(key(g, "master"), o_.local_addr + ":" + std::to_string(tdist::detail::find_free_port()));
  }
  // Every node of the round says how many ranks it has as soon as it sees
  // the round closed; one that does not within kMemberWait is taken for
  // gone (it joined, then was stopped or lost), and the round restarts.
  std::vector<std::string> keys = {key(g, "master")};
  for (int64_t j = 0; j < nodes; ++j) keys.push_back(key(g, "nproc/" + std::to_string(j)));
  const auto until = Clock::now() + kMemberWait;
  for (;;) {
    if (interrupted()) throw Interrupted("tdist-run: interrupted in the rendezvous");
    store_->add(key(g, "beat/" + std::to_string(index)), 1);
    if (store_->check(keys)) break;
    if (store_->check({key(g, "restart")})) return std::nullopt;
    // A node that left the rendezvous (stopped/<node> set, no nproc) or
    // has not come by now: restart the round without it. It is marked
    // stopped, so the next round need not wait for it to fall silent.
    const bool late = Clock::now() > until;
    for (int64_t j = 0; j < nodes; ++j) {
      const std::string j_text = std::to_string(j);
      if (store_->check({key(g, "nproc/" + j_text)})) continue;
      if (!late && !store_->check({key(g, "stopped/" + j_text)})) continue;
      store_->set(key(g, "stopped/" + j_text), "1");
      store_->compare_set(key(g, "restart"), {},
                          tdist::to_bytes("node " + j_text + " of round " + std::to_string(g) + " never came"));
      return std::nullopt;
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  Membership m;
  m.round = g;
  m.node = static_cast<int>(index);
  m.nodes = static_cast<int>(nodes);
  const std::string master = store_->get_string(key(g, "master"));
  const size_t colon = master.rfind(':');
  const auto port = tdist::detail::parse_int(colon == std::string::npos ? "" : master.substr(colon + 1));
  if (!port || *port < 1 || *port > 65535) {
    throw tdist::StoreError("tdist-run: the rendezvous store holds '" + master + "' for the ranks' store");
  }
  m.master_addr = master.substr(0, colon);
  m.master_port = static_cast<int>(*port);
  for (int64_t j = 0; j < nodes; ++j) {
    const int64_t n = parse_count(store_->get_string(key(g, "nproc/" + std::to_string(j))), "a node's rank count", 4096);
    if (n < 1) throw tdist::StoreError("tdist-run: node " + std::to_string(j) + " has no ranks");
    if (j < index) m.first_rank += static_cast<int>(n);
    m.world_size += static_cast<int>(n);
  }
  return m;
}

std::optional<Membership> ElasticAgent::rendezvous(const std::function<bool()>& interrupted) {
  // This node's ranks of its last round are gone: say so (round_over).
  if (round_ >= 0) store_->set(key(round_, "stopped/" + std::to_string(node_)), "1");
  int64_t g = next_round_;
  if (auto r = get_if(key("round"))) {
    const int64_t newest = parse_count(*r, "the newest round", kMaxRound);
    if (next_round_ == 0 && store_->check({key(newest, "finished")})) {
      throw tdist::Error("tdist-run: the job '" + o_.run_id + "' at " + o_.endpoint_host + ":" +
                         std::to_string(o_.endpoint_port) +
                         " has already finished; a new job there needs another --rdzv-id (or the old one's "
                         "launchers to be gone)");
    }
    g = std::max(g, newest);
  }
  const auto deadline = Clock::now() + o_.join_timeout;
  for (;;) {
    if (g >= kMaxRound) throw tdist::StoreError("tdist-run: the rendezvous has run out of round numbers");
    // Announce the round, so that an agent started later looks here first.
    for (std::string cur = get_if(key("round")).value_or("");;) {
      if (!cur.empty() && parse_count(cur, "the newest round", kMaxRound) >= g) break;
      const std::string now =
          tdist::to_string(store_->compare_set(key("round"), tdist::to_bytes(cur), tdist::to_bytes(std::to_string(g))));
      if (now == std::to_string(g) || now == cur) break;
      cur = now;
    }
    const int64_t index = store_->add(key(g, "joined"), 1) - 1;
    // Leaving the rendezvous by an exception (interrupted, timed out): this
    // node is out of round g, for whoever counted it in.
    struct Withdraw {
      ElasticAgent* agent;
      std::string key;
      bool armed = true;
      ~Withdraw() {
        if (!armed) return;
        try {
          agent->store_->set(key, "1");
        } catch (...) {
        }
      }
    } withdraw{this, key(g, "stopped/" + std::to_string(index))};
    std::optional<Clock::time_point> min_seen;
    Watch watch;
    bool next = false;
    while (!next) {
      if (interrupted()) throw Interrupted("tdist-run: interrupted in the rendezvous");
      if (auto a = get_if(key("abort"))) throw tdist::Error("tdist-run: the job was given up: " + *a);
      if (auto c = get_if(key(g, "closed"))) {
        const int64_t nodes = parse_count(*c, "a round's node count", 1 << 20);
        if (index >= nodes) {
          next = true;  // too late for this round: wait in the next
          continue;
        }
        if (auto m = take_place(g, index, nodes, interrupted)) {
          withdraw.armed = false;
          return m;
        }
        store_->set(key(g, "stopped/" + std::to_string(index)), "1");  // no ranks were started
        next = true;
        continue;
      }
      const bool prev_over = g == 0 || round_over(g - 1, watch);
      if (g > 0 && store_->check({key(g - 1, "finished")})) return std::nullopt;  // the job is done without this node
      const int64_t n = store_->add(key(g, "joined"), 0);
      if (prev_over && n >= o_.max_nodes) {
        try_close(g, o_.max_nodes);
        continue;
      }
      if (prev_over && n >= o_.min_nodes) {
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
                                  (prev_over ? "" : " (and the previous round's nodes are still running)"));
      }
      std::this_thread::sleep_for(kPollInterval);
    }
    ++g;
  }
}

std::optional<StopRequest> ElasticAgent::poll() {
  store_->add(key(round_, "beat/" + std::to_string(node_)), 1);
  if (auto a = get_if(key("abort"))) return StopRequest{StopRequest::kAbort, *a};
  std::optional<std::string> why = get_if(key(round_, "restart"));
  if (!why && nodes_ < o_.max_nodes && store_->add(key(round_ + 1, "joined"), 0) > 0) {
    why = tdist::to_string(store_->compare_set(key(round_, "restart"), {},
                                               tdist::to_bytes("membership: a node is waiting to join")));
  }
  if (!why) return std::nullopt;
  return restart_reason(*why);
}

void ElasticAgent::request_restart(const std::string& why) {
  store_->compare_set(key(round_, "restart"), {}, tdist::to_bytes(why));
}

void ElasticAgent::abort(const std::string& why) {
  store_->compare_set(key("abort"), {}, tdist::to_bytes(why));
  // The host lingers a moment, so that the others read why before its
  // store is gone.
  if (hosts_store()) std::this_thread::sleep_for(milliseconds(2000));
}

std::optional<StopRequest> ElasticAgent::finish(const std::function<bool()>& interrupted) {
  store_->add(key(round_, "done"), 1);
  const auto deadline = Clock::now() + o_.exit_barrier;
  for (;;) {
    store_->add(key(round_, "beat/" + std::to_string(node_)), 1);
    if (interrupted()) throw Interrupted("tdist-run: interrupted while waiting for the other nodes to finish");
    if (auto a = get_if(key("abort"))) throw tdist::Error("tdist-run: the job was given up: " + *a);
    const int64_t done = store_->add(key(round_, "done"), 0);
    if (done >= nodes_) {
      store_->set(key(round_, "finished"), "1");
      break;
    }
    if (auto why = get_if(key(round_, "restart"))) return restart_reason(*why);
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
  return std::nullopt;
}

}  // namespace tdist_run
