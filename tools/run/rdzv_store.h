// The store an elastic job's launchers meet in (run/elastic_agent.h has the
// protocol), behind one face, with two backends (--rdzv-backend):
//
//   c10d (the default; "tdist" and "static" are taken as it): a TCPStore at
//     the endpoint, hosted by the first launcher that can listen there, in a
//     process of its own forked before any thread. Nothing to install; the
//     host's node is the job's one fixed point: if it goes, the job ends.
//   etcd: an etcd cluster's members (--rdzv-endpoint h1:2379,h2:2379,...),
//     through its v3 JSON gateway (run/etcd_client.h). No node is special:
//     with a cluster of three or more members, any one node (its launcher,
//     its ranks, its etcd member) may go and the others go on. Every key of
//     the job lives under a lease of the job's (job_ttl, renewed by every
//     launcher while it runs), so a job's keys go some time after its last
//     launcher; a node's beat lives under the node's own lease (node_ttl),
//     so a dead node's entry expires by itself. With a token, every value
//     carries HMAC-SHA256(token, key | value): a value written without the
//     job's token (another job under the same --rdzv-id, or anyone else who
//     can reach etcd) is refused by name, never acted on.
//
// Keys are text; values are text (counters in decimal). Every call has a
// deadline; a store that cannot be reached raises tdist::Error.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tdist_run {

// How long a call may wait for the store unless set_call_timeout says
// otherwise (the built-in store: also how long joining waits for a host
// that starts late).
constexpr std::chrono::milliseconds kRdzvCallTimeout{60'000};

struct RdzvStoreOptions {
  enum Backend { kBuiltin, kEtcd } backend = kBuiltin;
  std::string endpoint;       // HOST:PORT (built-in) or a list of etcd members
  std::string endpoint_host;  // built-in: the parsed endpoint
  int endpoint_port = 0;
  std::string token;          // "": none
  std::string run_id = "none";
  // etcd: the leases' lifetimes.
  std::chrono::seconds node_ttl{10};
  std::chrono::seconds job_ttl{600};
};

class RdzvStore {
 public:
  virtual ~RdzvStore() = default;

  virtual std::optional<std::string> get(const std::string& key) = 0;
  bool has(const std::string& key) { return get(key).has_value(); }
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Adds delta to a counter (absent: 0) and returns the sum; add(key, 0)
  // reads it.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Sets `desired` if the key holds `expected` ("": the key is absent);
  // returns what the key holds afterwards.
  virtual std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) = 0;

  // This node is alive: bumps its beat counter at key (only this node
  // writes it). etcd: the key lives under this node's lease, and renewing
  // the leases is done here.
  virtual void beat(const std::string& key) = 0;
  // Another node's beat; nullopt when its key is absent (never written,
  // or, with etcd, expired with its node's lease: the node is gone).
  virtual std::optional<int64_t> read_beat(const std::string& key) = 0;

  // True when the store outlives any one node (etcd): losing touch with it
  // for a while is no reason to end the job.
  virtual bool durable() const = 0;
  // Bounds each call from now on: kRdzvCallTimeout unless set. The agent
  // bounds its calls to a few seconds while the ranks run (a launcher
  // blocked in a call relays no output and cannot stop its ranks) and
  // waits the longer bound otherwise. etcd: its client bounds every call
  // (run/etcd_client.h) and this changes nothing.
  virtual void set_call_timeout(std::chrono::milliseconds) {}
  // The launcher hosts the store (built-in), in the process host_pid().
  virtual pid_t host_pid() const { return -1; }
  // "the rendezvous at HOST:PORT" / "etcd at h1:2379,h2:2379".
  virtual std::string describe() const = 0;
};

// The built-in store: hosts it at the endpoint if it can listen there
// (call before the launcher starts any thread), else joins it. Throws
// tdist::Error naming the endpoint when neither works.
std::unique_ptr<RdzvStore> make_builtin_rdzv_store(const RdzvStoreOptions& o);
// The etcd backend: checks that a member answers and takes the job's and
// this node's leases. Throws tdist::Error naming every endpoint otherwise.
std::unique_ptr<RdzvStore> make_etcd_rdzv_store(const RdzvStoreOptions& o);

}  // namespace tdist_run
