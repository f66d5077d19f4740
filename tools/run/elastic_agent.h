// tdist-run's elastic mode (--nnodes MIN:MAX, torchrun's meaning): the
// launchers of a job (one per node, "agents") meet in a rendezvous, agree
// on who is in, and start their ranks as one world; when a node's rank
// fails, or a node is gone, or a new node asks to join, every agent stops
// its ranks and they meet again, with whoever is there.
//
// The rendezvous store (run/rdzv_store.h): the built-in one, a TCPStore
// that the first agent able to listen at the endpoint hosts (in a process
// of its own forked before any thread, so the launcher itself stays
// single-threaded and can fork ranks safely) and whose node is the job's
// one fixed point (if it goes, the job ends, loudly, as with torchrun's
// c10d backend); or an etcd cluster, where no node is special.
//
// Keys live under tdist-run/<run id>/ (--rdzv-id, torchrun's), so jobs
// that share an endpoint by turns (or at once) do not meet.
//
// Rounds. Round g gathers agents by a counter (key g/joined: an agent's
// index in it is its node's group rank). Round g closes (g/closed = its
// node count, set once by compare-and-set) when MAX agents are in, or when
// at least MIN are in and the last call (last_call_timeout) has passed
// since an agent saw MIN; never while round g-1 still runs: it has ended
// when a restart was asked (or it finished) and every one of its nodes has
// stopped its ranks (g-1/stopped/<node>) or gone silent (its beat,
// g-1/beat/<node>, bumped every 200 ms while the node is in the round,
// unchanged for 10 s, or with etcd expired with the node's lease: a node
// lost for good). While a round runs, each node also watches the next
// node's beat (a ring) and restarts the round when that one goes silent,
// so that a node cut off or frozen is noticed in 10 s, not at its peers'
// collective timeout. An agent that comes too late
// for a round waits in the next: the running agents see it
// (g+1/joined > 0) and, below MAX nodes, restart to let it in. A restart
// is g/restart set (its first reason wins): a rank's failure, a node
// waiting ("membership: ..."), a node that joined a round and never came,
// or a node's launcher stopping; every agent then stops its ranks and
// joins round g+1. The agents of a finished job count themselves out
// (g/done) and the last sets g/finished; abort (set by an agent out of
// restarts) ends everyone.
//
// Round g's ranks: RANK from the nodes before this one in the round (their
// --nproc-per-node may differ), MASTER_ADDR:MASTER_PORT a free port on the
// round's node 0 (its --local-addr) for the ranks' own store.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "run/rdzv_store.h"
#include "tdist/errors.h"

namespace tdist_run {

struct ElasticOptions {
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc = 1;  // this node's ranks
  RdzvStoreOptions store;
  // The address of this node that the other nodes' ranks reach its ranks
  // at, when this node is a round's node 0.
  std::string local_addr;
  std::string run_id = "none";  // --rdzv-id
  // How long an agent waits for a round to close (torchrun's join_timeout),
  // and the last call: how long a round with at least MIN nodes stays open
  // for more.
  std::chrono::milliseconds join_timeout{900'000};
  std::chrono::milliseconds last_call{30'000};
  // How long a node whose ranks all finished waits for the other nodes'
  // (torchrun's exit barrier).
  std::chrono::milliseconds exit_barrier{300'000};
};

// Raised when interrupted() turned true.
class Interrupted : public tdist::Error {
 public:
  using tdist::Error::Error;
};

// This node's place in a round.
struct Membership {
  int64_t round = 0;
  int node = 0;         // GROUP_RANK
  int nodes = 0;        // GROUP_WORLD_SIZE
  int first_rank = 0;   // this node's local rank 0
  int world_size = 0;   // every node's ranks
  std::string master_addr;  // the ranks' store
  int master_port = 0;
};

// Why the ranks of a round must stop before they end.
struct StopRequest {
  enum Kind { kRestart, kMembership, kAbort } kind = kRestart;
  std::string why;
};

class ElasticAgent {
 public:
  // Opens the rendezvous store (the built-in one hosted here if it can
  // listen at the endpoint). Call before the launcher starts any thread or
  // rank. Throws tdist::Error with the endpoint named when it cannot.
  explicit ElasticAgent(ElasticOptions options);
  ~ElasticAgent();
  ElasticAgent(const ElasticAgent&) = delete;
  ElasticAgent& operator=(const ElasticAgent&) = delete;

  const RdzvStore& store() const { return *store_; }

  // Joins the next round and waits until it closes (this node's ranks of
  // any earlier round must be gone: it tells the others so). nullopt: the
  // job finished while this node waited to join it. Throws tdist::Error on
  // an abort, a job of this run id that had already finished, the join
  // timeout, or interrupted() turning true (checked every poll).
  std::optional<Membership> rendezvous(const std::function<bool()>& interrupted);

  // Called every ~200 ms while this node's ranks run or are being stopped:
  // says this node is alive, and why the ranks must stop, if they must.
  std::optional<StopRequest> poll();
  // The store answers again after an outage: no node could beat meanwhile,
  // so the watch on the next node's beat starts over (it is named silent
  // only if it stays so for the whole interval from now).
  void after_outage() { watched_ = BeatSeen{}; }

  // This node's ranks failed (or were stopped): every node restarts.
  void request_restart(const std::string& why);
  // Gives up the job: every agent stops and exits non-zero.
  void abort(const std::string& why);
  // This node's ranks all succeeded: waits until every node's did
  // (nullopt), or returns the restart asked meanwhile (rendezvous again).
  // Throws on the exit barrier's timeout or an abort.
  std::optional<StopRequest> finish(const std::function<bool()>& interrupted);

 private:
  std::string key(const std::string& name) const;
  std::string key(int64_t round, const std::string& name) const;
  std::optional<std::string> get_if(const std::string& key);
  void try_close(int64_t round, int64_t nodes);
  // Whether round r (closed, this node not in it) has ended; see above.
  struct Watch;
  bool round_over(int64_t r, Watch& w);
  // What this agent has seen of another node's beat.
  struct BeatSeen {
    bool looked = false;
    bool seen = false;  // its key was there once
    std::optional<int64_t> beat;
    std::chrono::steady_clock::time_point since;  // when it last changed
  };
  // Reads the beat of a node of a round; true when the node has gone
  // silent (see above).
  bool silent(int64_t round, int node, BeatSeen& b);
  // After round g closed with this node as `index`: its place, or nullopt
  // when a node of the round never came (the round is restarted).
  std::optional<Membership> take_place(int64_t g, int64_t index, int64_t nodes,
                                       const std::function<bool()>& interrupted);
  StopRequest restart_reason(const std::string& why) const;

  ElasticOptions o_;
  std::unique_ptr<RdzvStore> store_;
  BeatSeen watched_;  // the next node of round_
  int64_t round_ = -1;       // the round this node is in (running or done)
  int64_t next_round_ = 0;   // the lowest round to join next
  int nodes_ = 0;            // in round_
  int node_ = 0;             // this node's index in round_
};

}  // namespace tdist_run
