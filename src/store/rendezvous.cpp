#include "tdist/rendezvous.h"

#include <unistd.h>

#include <cstdlib>

#include "util/env.h"
#include "util/hostlist.h"
#include "util/launch_env.h"

namespace tdist {

namespace {

const char* lookup(const RendezvousOptions& o, const char* name) {
  const char* v = o.getenv ? o.getenv(name) : std::getenv(name);
  return (v && *v) ? v : nullptr;
}

int parse_number(const std::string& text, const std::string& what, int64_t lo, int64_t hi) {
  auto v = detail::parse_int(text);
  if (!v || *v < lo || *v > hi) {
    throw UsageError("rendezvous: " + what + " must be an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "], got '" + text + "'");
  }
  return static_cast<int>(*v);
}

// Combines a value given explicitly with one from the URL or environment.
void merge(int* slot, int value, const std::string& what, const std::string& source) {
  if (value < 0) return;
  if (*slot >= 0 && *slot != value) {
    throw UsageError("rendezvous: " + what + " is " + std::to_string(*slot) + " in the arguments but " +
                     std::to_string(value) + " in " + source);
  }
  *slot = value;
}

void parse_query(const std::string& url, const std::string& query, InitMethod* m) {
  size_t pos = 0;
  while (pos < query.size()) {
    size_t amp = query.find('&', pos);
    if (amp == std::string::npos) amp = query.size();
    const std::string item = query.substr(pos, amp - pos);
    pos = amp + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos) throw UsageError("init_method '" + url + "': '" + item + "' is not key=value");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "rank") {
      merge(&m->rank, parse_number(value, "rank in '" + url + "'", 0, INT32_MAX), "rank", url);
    } else if (key == "world_size") {
      merge(&m->world_size, parse_number(value, "world_size in '" + url + "'", 1, INT32_MAX), "world_size", url);
    } else {
      throw UsageError("init_method '" + url + "': unknown parameter '" + key +
                       "' (known: rank, world_size)");
    }
  }
}

void split_host_port(const std::string& url, const std::string& hostport, InitMethod* m) {
  std::string host, port;
  if (!hostport.empty() && hostport[0] == '[') {  // [ipv6]:port
    const size_t close = hostport.find(']');
    if (close == std::string::npos || close + 1 >= hostport.size() || hostport[close + 1] != ':') {
      throw UsageError("init_method '" + url + "': expected tcp://[ipv6-address]:port");
    }
    host = hostport.substr(1, close - 1);
    port = hostport.substr(close + 2);
  } else {
    const size_t colon = hostport.rfind(':');
    if (colon == std::string::npos) {
      throw UsageError("init_method '" + url + "': missing port; expected tcp://host:port");
    }
    host = hostport.substr(0, colon);
    port = hostport.substr(colon + 1);
  }
  if (host.empty()) throw UsageError("init_method '" + url + "': missing host; expected tcp://host:port");
  m->host = host;
  m->port = parse_number(port, "the port in '" + url + "'", 1, 65535);
}

// env://'s MASTER_ADDR and MASTER_PORT; under srun, where they may be
// unset, the first host of the step's node list and the port
// slurm_default_port derives from the job id (what tdist-run takes too).
void master_from_env(const RendezvousOptions& o, InitMethod* m) {
  const char* addr = lookup(o, "MASTER_ADDR");
  const char* port = lookup(o, "MASTER_PORT");
  if (addr) {
    m->host = addr;
  } else if (const auto nodes = detail::slurm_node_list(o.getenv)) {
    try {
      m->host = detail::first_host(nodes->value);
    } catch (const UsageError& e) {
      throw UsageError(std::string("rendezvous env://: MASTER_ADDR is not set, and ") + nodes->name + " is no host list: " + e.what());
    }
  } else {
    throw UsageError("rendezvous env://: environment variable MASTER_ADDR is not set (the master's host name or address)");
  }
  if (port) {
    m->port = parse_number(port, "MASTER_PORT", 1, 65535);
  } else if (const auto job = detail::slurm_job_id(o.getenv)) {
    try {
      m->port = detail::slurm_default_port(*job);
    } catch (const UsageError& e) {
      throw UsageError(std::string("rendezvous env://: MASTER_PORT is not set, and ") + e.what());
    }
  } else {
    throw UsageError("rendezvous env://: environment variable MASTER_PORT is not set (a free port on the master)");
  }
}

}  // namespace

InitMethod parse_init_method(const RendezvousOptions& o) {
  InitMethod m;
  const std::string url = o.init_method.empty() ? "env://" : o.init_method;
  const size_t sep = url.find("://");
  if (sep == std::string::npos) {
    throw UsageError("init_method '" + url + "' is not a URL; use env://, tcp://host:port or file:///path");
  }
  m.scheme = url.substr(0, sep);
  std::string rest = url.substr(sep + 3);
  std::string query;
  if (size_t q = rest.find('?'); q != std::string::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  parse_query(url, query, &m);
  merge(&m.rank, o.rank, "rank", url);
  merge(&m.world_size, o.world_size, "world_size", url);

  if (m.scheme == "env") {
    if (!rest.empty()) throw UsageError("init_method '" + url + "': env:// takes no host or path");
    master_from_env(o, &m);
    // Under torchrun, MASTER_PORT is its agent's own store (PyTorch's
    // TCPStore, another protocol): tdist's store listens on the next port,
    // on the same host, where every rank looks for it.
    if (const char* agent = lookup(o, "TORCHELASTIC_USE_AGENT_STORE");
        agent && (std::string(agent) == "True" || std::string(agent) == "true" || std::string(agent) == "1")) {
      if (m.port == 65535) throw UsageError("rendezvous env:// under torchrun: MASTER_PORT 65535 leaves no next port for tdist's store");
      m.port += 1;
    }
    // torchrun's names, else mpirun's, else srun's (a process per rank).
    if (m.rank < 0) {
      const auto v = detail::first_set(o.getenv, {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"});
      if (!v) throw UsageError("rendezvous env://: environment variable RANK is not set (nor OMPI_COMM_WORLD_RANK or SLURM_PROCID), and no rank was given");
      m.rank = parse_number(v->value, v->name, 0, INT32_MAX);
    }
    if (m.world_size < 0) {
      const auto v = detail::first_set(o.getenv, {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"});
      if (!v) throw UsageError("rendezvous env://: environment variable WORLD_SIZE is not set (nor OMPI_COMM_WORLD_SIZE or SLURM_NTASKS), and no world_size was given");
      m.world_size = parse_number(v->value, v->name, 1, INT32_MAX);
    }
  } else if (m.scheme == "tcp") {
    split_host_port(url, rest, &m);
  } else if (m.scheme == "file") {
    if (rest.empty() || rest[0] != '/') {
      throw UsageError("init_method '" + url + "': expected an absolute path, as in file:///tmp/tdist_store");
    }
    m.path = rest;
  } else {
    throw UsageError("init_method '" + url + "': unknown scheme '" + m.scheme + "'; use env://, tcp:// or file://");
  }
  if (m.rank < 0) throw UsageError("init_method '" + url + "': no rank given (add ?rank=R or pass rank)");
  if (m.world_size < 0) throw UsageError("init_method '" + url + "': no world_size given (add &world_size=N or pass world_size)");
  if (m.rank >= m.world_size) {
    throw UsageError("rendezvous: rank " + std::to_string(m.rank) + " is out of range for world_size " +
                     std::to_string(m.world_size) + " (ranks are 0.." + std::to_string(m.world_size - 1) + ")");
  }
  return m;
}

RendezvousResult rendezvous(const RendezvousOptions& o) {
  RendezvousResult r;
  if (o.store && !o.init_method.empty()) {
    throw UsageError("rendezvous: give either a store or an init_method, not both");
  }
  if (o.store) {
    if (o.world_size < 1) throw UsageError("rendezvous: with an explicit store, world_size must be given (>= 1)");
    if (o.rank < 0 || o.rank >= o.world_size) {
      throw UsageError("rendezvous: with an explicit store, rank must be given and in [0, " +
                       std::to_string(o.world_size - 1) + "], got " + std::to_string(o.rank));
    }
    r.store = o.store;
    r.rank = o.rank;
    r.world_size = o.world_size;
  } else {
    InitMethod m = parse_init_method(o);
    r.rank = m.rank;
    r.world_size = m.world_size;
    if (m.scheme == "file") {
      r.store = std::make_shared<FileStore>(m.path, o.timeout);
    } else {
      TCPStoreOptions so;
      so.port = static_cast<uint16_t>(m.port);
      so.is_server = m.rank == 0;
      so.num_workers = m.world_size;
      so.timeout = o.timeout;
      so.client_name = "rank " + std::to_string(m.rank) + ", pid " + std::to_string(getpid());
      const std::string who = "rendezvous: rank " + std::to_string(m.rank) +
                              (so.is_server ? " cannot host" : " cannot join") + " the store at " + m.host + ":" +
                              std::to_string(m.port) + ": ";
      try {
        r.store = std::make_shared<TCPStore>(m.host, so);
      } catch (const StoreError& e) {  // refused: another job's store, a wrong token
        throw StoreError(who + e.what());
      } catch (const NetworkError& e) {  // the port is taken, the address is not ours
        throw NetworkError(who + e.what());
      }
    }
  }

  // Claim this rank, so that two processes with the same rank are caught
  // here rather than corrupting every collective after.
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const std::string me = std::string(host) + ":" + std::to_string(getpid());
  const std::string rank_key = "tdist/rendezvous/rank/" + std::to_string(r.rank);
  const Bytes owner = r.store->compare_set(rank_key, {}, to_bytes(me));
  if (to_string(owner) != me) {
    throw UsageError("rendezvous: rank " + std::to_string(r.rank) + " is claimed twice: by " + to_string(owner) +
                     " and by " + me + ". Check RANK, or an old job is using the same store");
  }
  const int64_t joined = r.store->add("tdist/rendezvous/joined", 1);
  if (joined > r.world_size) {
    throw UsageError("rendezvous: " + std::to_string(joined) + " ranks joined a world of size " +
                     std::to_string(r.world_size) + "; is the store left over from an earlier job?");
  }
  if (joined == r.world_size) r.store->set("tdist/rendezvous/complete", "1");
  try {
    r.store->wait({"tdist/rendezvous/complete"}, o.timeout);
  } catch (const TimeoutError&) {
    std::string missing;
    for (int i = 0; i < r.world_size; ++i) {
      if (!r.store->check({"tdist/rendezvous/rank/" + std::to_string(i)})) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(i);
      }
    }
    std::string refused;
    if (auto* tcp = dynamic_cast<TCPStore*>(r.store.get()); tcp && tcp->server()) {
      for (const auto& who : tcp->server()->refused_clients()) refused += "; refused: " + who;
    }
    throw TimeoutError("rendezvous: rank " + std::to_string(r.rank) + " waited " +
                       detail::format_duration_ms(o.timeout.count()) + " but rank(s) " + missing +
                       " of " + std::to_string(r.world_size) + " never joined" + refused);
  }
  return r;
}

}  // namespace tdist
