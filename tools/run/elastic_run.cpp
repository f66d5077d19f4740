#include "run/elastic_run.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "run/elastic_agent.h"
#include "run/supervisor.h"
#include "store/auth.h"
#include "tdist/errors.h"

namespace tdist_run {

namespace {

// How long a built-in rendezvous store may stop answering before the job
// is given up (its host's node cut off or frozen for good).
constexpr std::chrono::seconds kBuiltinOutage{60};

bool interrupted() { return stop_signal() != 0; }

// The agent's options from the command line. A token of kind kGenerate
// (one node at most) becomes the node's own secret, kept for every round.
ElasticOptions agent_options(const Options& o, TokenPlan& token) {
  ElasticOptions eo;
  eo.min_nodes = o.min_nodes;
  eo.max_nodes = o.nnodes;
  eo.nproc = o.nproc;
  eo.store.backend = o.rdzv_backend == "etcd" ? RdzvStoreOptions::kEtcd : RdzvStoreOptions::kBuiltin;
  eo.store.endpoint = o.rdzv_endpoint;
  eo.store.endpoint_host = o.master_addr;
  eo.store.endpoint_port = o.master_port;
  eo.store.run_id = o.rdzv_id;
  eo.store.job_ttl = std::chrono::seconds(static_cast<int64_t>(o.job_ttl_s));
  eo.local_addr = o.local_addr;
  eo.run_id = o.rdzv_id;
  eo.join_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.join_timeout_s * 1000));
  eo.last_call = std::chrono::milliseconds(static_cast<int64_t>(o.last_call_s * 1000));
  try {
    switch (token.kind) {
      case TokenPlan::kGiven: eo.store.token = token.token; break;
      case TokenPlan::kKeep: eo.store.token = tdist::detail::resolve_token(std::nullopt); break;
      case TokenPlan::kNone: break;
      case TokenPlan::kGenerate:
        eo.store.token = tdist::detail::generate_token();
        token = {TokenPlan::kGiven, eo.store.token};
        break;
    }
  } catch (const tdist::Error& e) {
    usage(e.what());
  }
  return eo;
}

// A round's membership as a start of this node's ranks.
Placement placement_of(const Membership& m, int restart_count) {
  Placement at;
  at.first_rank = m.first_rank;
  at.world = m.world_size;
  at.group_rank = m.node;
  at.group_world = m.nodes;
  at.master_addr = m.master_addr;
  at.master_port = m.master_port;
  at.restart_count = restart_count;
  return at;
}

// The job's rounds on this node, from the first rendezvous to the end.
class Rounds {
 public:
  Rounds(const Options& o, TokenPlan token, ElasticAgent& agent, Supervisor& supervisor)
      : o_(o), token_(std::move(token)), agent_(agent), supervisor_(supervisor) {}

  // The launcher's exit code.
  int run();

 private:
  // Runs round m's start; the exit code when the launcher is done, else
  // nullopt (to the rendezvous again), with `counts` set when the round
  // ended in a failure, which counts against --max-restarts.
  std::optional<int> run_round(const Membership& m, bool& counts);

  const Options& o_;
  const TokenPlan token_;
  ElasticAgent& agent_;
  Supervisor& supervisor_;
  int restarts_ = 0;
  int last_world_ = 0;
};

int Rounds::run() {
  for (;;) {
    const auto m = agent_.rendezvous(interrupted);
    if (!m) {
      std::fprintf(stderr, "tdist-run: the job finished before this node could join it\n");
      return 0;
    }
    std::fprintf(stderr, "tdist-run: round %lld: node %d of %d, ranks %d to %d of a world of %d%s\n",
                 static_cast<long long>(m->round), m->node, m->nodes, m->first_rank, m->first_rank + o_.nproc - 1,
                 m->world_size,
                 last_world_ && last_world_ != m->world_size ? (" (was " + std::to_string(last_world_) + ")").c_str()
                                                             : "");
    last_world_ = m->world_size;
    bool counts = false;
    if (const auto code = run_round(*m, counts)) return *code;
    if (counts && restarts_ >= o_.max_restarts) {
      const std::string why = "node " + std::to_string(m->node) + " is out of restarts (--max-restarts " +
                              std::to_string(o_.max_restarts) + ")";
      std::fprintf(stderr, "tdist-run: %s; giving the job up\n", why.c_str());
      agent_.abort(why);
      return 1;
    }
    if (counts) ++restarts_;
    std::fprintf(stderr, "tdist-run: to the rendezvous again (restart %d of %d)\n", restarts_, o_.max_restarts);
  }
}

std::optional<int> Rounds::run_round(const Membership& m, bool& counts) {
  // An etcd cluster may be out of reach for a while (this node cut off, a
  // leader election): the ranks go on, and the round is given up only when
  // the outage outlasts the join timeout. A built-in store that refuses or
  // drops the connection is gone for good (its host's node is); one that
  // stops answering (its node cut off or frozen) is waited for up to
  // kBuiltinOutage, each call bounded by a few seconds, so the launcher
  // relays output and can stop its ranks meanwhile.
  std::optional<std::chrono::steady_clock::time_point> outage;
  const StopCheck check = [&]() -> std::optional<StopRequest> {
    try {
      auto stop = agent_.poll();
      if (outage) {
        std::fprintf(stderr, "tdist-run: %s answers again\n", agent_.store().describe().c_str());
        agent_.after_outage();
      }
      outage.reset();
      return stop;
    } catch (const std::exception& e) {
      const bool durable = agent_.store().durable();
      if (!durable && dynamic_cast<const tdist::TimeoutError*>(&e) == nullptr) {
        return StopRequest{StopRequest::kAbort, std::string("the rendezvous store is gone: ") + e.what()};
      }
      const auto now = std::chrono::steady_clock::now();
      if (!outage) {
        outage = now;
        std::fprintf(stderr, "tdist-run: cannot reach %s (%s); the ranks go on\n", agent_.store().describe().c_str(),
                     e.what());
      }
      const double limit_s = durable ? o_.join_timeout_s : kBuiltinOutage.count();
      if (now - *outage > std::chrono::duration<double>(limit_s)) {
        const std::string what = "out of touch with " + agent_.store().describe() + " for over " +
                                 std::to_string(static_cast<int>(limit_s)) + " s";
        return StopRequest{StopRequest::kAbort, durable ? what : "the rendezvous store is gone: " + what};
      }
      return std::nullopt;
    }
  };
  const Outcome r = supervisor_.run_once(placement_of(m, restarts_), token_, check);
  if (const int sig = stop_signal()) {
    agent_.request_restart("node " + std::to_string(m.node) + "'s launcher was stopped by signal " +
                           std::to_string(sig));
    return report_stop_signal(sig);
  }
  if (r.failed >= 0) {  // a failure; nodes coming or going are none
    const std::string what = supervisor_.report_failure(r.failed);
    agent_.request_restart("node " + std::to_string(m.node) + ": " + what);
    // The round's first reason stands. When another node had already
    // stopped its ranks for a node joining, this failure followed from it
    // (a peer stopped mid-collective before this node's agent looked): a
    // membership change, which counts against no --max-restarts.
    const auto reason = check();
    counts = !(reason && reason->kind == StopRequest::kMembership);
    if (!counts) std::fprintf(stderr, "tdist-run: the round was already stopped: %s\n", reason->why.c_str());
  } else if (r.stopped) {
    std::fprintf(stderr, "tdist-run: this node's ranks were stopped: %s\n", r.stopped->why.c_str());
    if (r.stopped->kind == StopRequest::kAbort) return 1;
    counts = r.stopped->kind == StopRequest::kRestart;
  } else if (const auto again = agent_.finish(interrupted)) {
    std::fprintf(stderr, "tdist-run: this node's ranks finished, but the job restarts: %s\n", again->why.c_str());
    counts = again->kind == StopRequest::kRestart;
  } else {
    return 0;
  }
  return std::nullopt;
}

}  // namespace

int run_elastic(const Options& o, TokenPlan token, Supervisor& supervisor) {
  const ElasticOptions eo = agent_options(o, token);
  std::unique_ptr<ElasticAgent> agent;
  try {
    agent = std::make_unique<ElasticAgent>(eo);  // before any other process or thread
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  supervisor.start_guardian();
  std::fprintf(stderr, "tdist-run: %s %s (%d to %d nodes)\n", agent->store().host_pid() > 0 ? "hosting" : "joined",
               agent->store().describe().c_str(), o.min_nodes, o.nnodes);
  try {
    return Rounds(o, std::move(token), *agent, supervisor).run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    const int sig = stop_signal();
    return sig ? 128 + sig : 1;
  }
}

}  // namespace tdist_run
