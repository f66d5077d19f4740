#include "run/elastic_agent.h"

#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include "store/socket.h"
#include "tdist/errors.h"
#include "util/env.h"

namespace tdist_run {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kPollInterval{100};
// A node of a round whose beat has not changed for this long (or, with
// etcd, whose beat expired with its lease) is taken for
// lost (its launcher was killed, or its machine is gone).
constexpr milliseconds kDeadNode{10'000};
// A call to the store while the ranks run (see poll).
constexpr milliseconds kPollCallTimeout{5'000};
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

}  // namespace

ElasticAgent::ElasticAgent(ElasticOptions options) : o_(std::move(options)) {
  store_ = o_.store.backend == RdzvStoreOptions::kEtcd ? make_etcd_rdzv_store(o_.store)
                                                       : make_builtin_rdzv_store(o_.store);
}

ElasticAgent::~ElasticAgent() = default;

std::string ElasticAgent::key(const std::string& name) const { return "tdist-run/" + o_.run_id + "/" + name; }

std::string ElasticAgent::key(int64_t round, const std::string& name) const {
  return key("round/" + std::to_string(round) + "/" + name);
}

std::optional<std::string> ElasticAgent::get_if(const std::string& k) { return store_->get(k); }

void ElasticAgent::try_close(int64_t round, int64_t nodes) {
  store_->compare_set(key(round, "closed"), "", std::to_string(nodes));
}

StopRequest ElasticAgent::restart_reason(const std::string& why) const {
  const bool membership = why.rfind("membership: ", 0) == 0;
  return StopRequest{membership ? StopRequest::kMembership : StopRequest::kRestart, why};
}

// What a waiting agent has seen of each node of the round before its own.
struct ElasticAgent::Watch {
  std::vector<BeatSeen> nodes;
};

bool ElasticAgent::silent(int64_t round, int node, BeatSeen& b) {
  const std::string j = std::to_string(node);
  const std::optional<int64_t> beat = store_->read_beat(key(round, "beat/" + j));
  const auto now = Clock::now();
  // Expired with its node's lease: gone. (A node beats before it sets
  // nproc/<node>, so with nproc there a beat that is not expired.)
  if (!beat && (b.seen || (store_->durable() && store_->has(key(round, "nproc/" + j))))) return true;
  if (!b.looked || beat != b.beat) {
    b.looked = true;
    b.seen = b.seen || beat.has_value();
    b.beat = beat;
    b.since = now;
  }
  return now - b.since >= kDeadNode;
}

bool ElasticAgent::round_over(int64_t r, Watch& w) {
  const auto closed = get_if(key(r, "closed"));
  if (!closed) return true;  // never closed: nobody runs in it
  const int64_t nodes = parse_count(*closed, "a round's node count", 1 << 20);
  if (w.nodes.size() != static_cast<size_t>(nodes)) w.nodes.assign(static_cast<size_t>(nodes), BeatSeen{});
  bool all_out = true;
  for (int64_t j = 0; j < nodes; ++j) {
    if (store_->has(key(r, "stopped/" + std::to_string(j)))) continue;
    if (!silent(r, static_cast<int>(j), w.nodes[static_cast<size_t>(j)])) all_out = false;
  }
  if (!all_out) return false;
  // Every node of it stopped or went silent: over, by a restart if none was asked.
  if (!store_->has(key(r, "restart"))) {
    store_->compare_set(key(r, "restart"), "", "round " + std::to_string(r) + "'s launchers stopped answering");
  }
  return true;
}

std::optional<Membership> ElasticAgent::take_place(int64_t g, int64_t index, int64_t nodes,
                                                   const std::function<bool()>& interrupted) {
  round_ = g;
  node_ = static_cast<int>(index);
  nodes_ = static_cast<int>(nodes);
  next_round_ = g + 1;
  watched_ = BeatSeen{};
  // The first beat before nproc/<node>: a node with nproc set has beaten
  // (silent() relies on it).
  store_->beat(key(g, "beat/" + std::to_string(index)));
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
    store_->beat(key(g, "beat/" + std::to_string(index)));
    if (std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return store_->has(k); })) break;
    if (store_->has(key(g, "restart"))) return std::nullopt;
    // A node that left the rendezvous (stopped/<node> set, no nproc) or
    // has not come by now: restart the round without it. It is marked
    // stopped, so the next round need not wait for it to fall silent.
    const bool late = Clock::now() > until;
    for (int64_t j = 0; j < nodes; ++j) {
      const std::string j_text = std::to_string(j);
      if (store_->has(key(g, "nproc/" + j_text))) continue;
      if (!late && !store_->has(key(g, "stopped/" + j_text))) continue;
      store_->set(key(g, "stopped/" + j_text), "1");
      store_->compare_set(key(g, "restart"), "", "node " + j_text + " of round " + std::to_string(g) + " never came");
      return std::nullopt;
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  Membership m;
  m.round = g;
  m.node = static_cast<int>(index);
  m.nodes = static_cast<int>(nodes);
  const std::string master = get_if(key(g, "master")).value_or("");
  const size_t colon = master.rfind(':');
  const auto port = tdist::detail::parse_int(colon == std::string::npos ? "" : master.substr(colon + 1));
  if (!port || *port < 1 || *port > 65535) {
    throw tdist::StoreError("tdist-run: the rendezvous store holds '" + master + "' for the ranks' store");
  }
  m.master_addr = master.substr(0, colon);
  m.master_port = static_cast<int>(*port);
  for (int64_t j = 0; j < nodes; ++j) {
    const int64_t n = parse_count(get_if(key(g, "nproc/" + std::to_string(j))).value_or(""), "a node's rank count", 4096);
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
    if (next_round_ == 0 && store_->has(key(newest, "finished"))) {
      throw tdist::Error("tdist-run: the job '" + o_.run_id + "' in " + store_->describe() +
                         " has already finished; a new job there needs another --rdzv-id (or " +
                         (store_->durable() ? "the old job's keys to expire, --rdzv-conf job_ttl after its last launcher)"
                                            : "the old one's launchers to be gone)"));
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
          store_->compare_set(key("round"), cur, std::to_string(g));
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
      if (g > 0 && store_->has(key(g - 1, "finished"))) return std::nullopt;  // the job is done without this node
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
                                  std::to_string(g) + " at " + store_->describe() + ": " + std::to_string(n) +
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
  // Each call bounded by kPollCallTimeout while the ranks run: a store that
  // does not answer raises TimeoutError, and the launcher decides
  // (run/elastic_run.cpp) instead of sitting in the call.
  struct Bounded {
    RdzvStore& store;
    explicit Bounded(RdzvStore& s) : store(s) { store.set_call_timeout(kPollCallTimeout); }
    ~Bounded() { store.set_call_timeout(kRdzvCallTimeout); }
  } bounded(*store_);
  store_->beat(key(round_, "beat/" + std::to_string(node_)));
  if (auto a = get_if(key("abort"))) return StopRequest{StopRequest::kAbort, *a};
  std::optional<std::string> why = get_if(key(round_, "restart"));
  if (!why && nodes_ < o_.max_nodes && store_->add(key(round_ + 1, "joined"), 0) > 0) {
    why = store_->compare_set(key(round_, "restart"), "", "membership: a node is waiting to join");
  }
  // Each node watches the next one of its round (a ring: every node is
  // watched, at one read a poll): one gone silent stops the round, whether
  // or not its peers' ranks have noticed (a node cut off or frozen leaves
  // them waiting in a collective until its timeout).
  if (!why && nodes_ > 1) {
    const int next = (node_ + 1) % nodes_;
    const std::string next_text = std::to_string(next);
    if (silent(round_, next, watched_) && !store_->has(key(round_, "stopped/" + next_text))) {
      why = store_->compare_set(key(round_, "restart"), "",
                                "node " + next_text + " of round " + std::to_string(round_) +
                                    " went silent: its launcher has not answered for " + seconds_text(kDeadNode) +
                                    " (lost, cut off or frozen)");
    }
  }
  if (!why) return std::nullopt;
  return restart_reason(*why);
}

void ElasticAgent::request_restart(const std::string& why) {
  store_->compare_set(key(round_, "restart"), "", why);
}

void ElasticAgent::abort(const std::string& why) {
  store_->compare_set(key("abort"), "", why);
  // The host lingers a moment, so that the others read why before its
  // store is gone.
  if (store_->host_pid() > 0) std::this_thread::sleep_for(milliseconds(2000));
}

std::optional<StopRequest> ElasticAgent::finish(const std::function<bool()>& interrupted) {
  store_->add(key(round_, "done"), 1);
  const auto deadline = Clock::now() + o_.exit_barrier;
  for (;;) {
    store_->beat(key(round_, "beat/" + std::to_string(node_)));
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
  if (store_->host_pid() > 0) {
    const auto until = Clock::now() + milliseconds(5000);
    while (Clock::now() < until && store_->add(key(round_, "left"), 0) < nodes_) std::this_thread::sleep_for(kPollInterval);
  }
  return std::nullopt;
}

}  // namespace tdist_run
