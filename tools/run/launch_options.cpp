#include "run/launch_options.h"

#include <unistd.h>

#include <cstdlib>
#include <map>
#include <optional>

#include "run/cluster_env.h"
#include "run/etcd_client.h"
#include "store/auth.h"
#include "util/cli.h"
#include "util/env.h"

namespace tdist_run {

void usage(const std::string& why) { tdist::cli::usage_error("tdist-run", why); }

namespace {

int int_arg(const std::string& name, const std::string& value, int lo, int hi) {
  auto v = tdist::detail::parse_int(value);
  if (!v || *v < lo || *v > hi) {
    usage(name + " needs an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + value +
          "'");
  }
  return static_cast<int>(*v);
}

// --rdzv-endpoint: master_addr and master_port from it (etcd: from its
// first member, for --local-addr's default), after the backend is checked.
void parse_endpoint(Options& o) {
  if (o.rdzv_backend == "tdist" || o.rdzv_backend == "static") o.rdzv_backend = "c10d";
  if (o.rdzv_backend == "etcd-v2") o.rdzv_backend = "etcd";
  if (o.rdzv_backend != "c10d" && o.rdzv_backend != "etcd") {
    usage("--rdzv-backend: '" + o.rdzv_backend + "' is not one tdist-run has (c10d, etcd)");
  }
  std::string first = o.rdzv_endpoint;
  if (o.rdzv_backend == "etcd") {
    try {
      const auto members = parse_etcd_endpoints(o.rdzv_endpoint);
      o.master_addr = members[0].host;
      o.master_port = members[0].port;
      return;
    } catch (const tdist::UsageError& e) {
      usage(std::string("--rdzv-endpoint: ") + e.what());
    }
  }
  const size_t colon = first.rfind(':');
  if (colon == std::string::npos || colon == 0) usage("--rdzv-endpoint needs HOST:PORT, got '" + first + "'");
  o.master_addr = first.substr(0, colon);
  if (o.master_addr.size() > 2 && o.master_addr.front() == '[' && o.master_addr.back() == ']') {
    o.master_addr = o.master_addr.substr(1, o.master_addr.size() - 2);
  }
  o.master_port = int_arg("--rdzv-endpoint's port", first.substr(colon + 1), 1, 65535);
}

}  // namespace

Options parse(int argc, char** argv) {
  CLI::App app{"Starts one process per local rank, torchrun-style: sets RANK, LOCAL_RANK, WORLD_SIZE,\n"
               "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT and (unless set) OMP_NUM_THREADS,\n"
               "prefixes each output line with \"[rank N]: \", and when a rank fails stops the others and\n"
               "names it.",
               "tdist-run"};
  app.prefix_command();  // everything from the program on is the program's
  app.footer("Then: [--] program [args...], the command every rank runs.");
  // Integers are read as text and checked here, so that a bad value names
  // its option and the allowed range.
  std::map<std::string, std::string> v = {{"nproc-per-node", "1"}, {"nnodes", "1"}, {"node-rank", "0"},
                                          {"master-port", "0"}, {"max-restarts", "0"}, {"grace-seconds", "5"},
                                          {"peer-wait-seconds", "3"}};
  Options o;
  app.add_option(tdist::cli::both_spellings("nproc-per-node"), v["nproc-per-node"], "ranks to start on this node")
      ->type_name("N")->default_str("1");
  app.add_option(tdist::cli::both_spellings("nnodes"), v["nnodes"],
                 "nodes in the job; MIN:MAX: elastic, with --rdzv-endpoint")->type_name("M|MIN:MAX")->default_str("1");
  app.add_option(tdist::cli::both_spellings("node-rank"), v["node-rank"], "this node's index, below --nnodes")
      ->type_name("R")->default_str("0");
  app.add_option(tdist::cli::both_spellings("master-addr"), o.master_addr, "address of the node that hosts the store")
      ->type_name("HOST")->default_str(o.master_addr);
  app.add_option(tdist::cli::both_spellings("master-port"), v["master-port"],
                 "the store's port (default: a free one; required with --nnodes > 1)")->type_name("PORT");
  app.add_option(tdist::cli::both_spellings("max-restarts"), v["max-restarts"], "restart every rank up to K times after a failure")
      ->type_name("K")->default_str("0");
  app.add_option(tdist::cli::both_spellings("grace-seconds"), v["grace-seconds"],
                 "between SIGTERM and SIGKILL for the ranks left after a failure")->type_name("S")->default_str("5");
  app.add_option(tdist::cli::both_spellings("peer-wait-seconds"), v["peer-wait-seconds"],
                 "after a failure, how long the other ranks get to exit on their own")->type_name("S")->default_str("3");
  app.add_option(tdist::cli::both_spellings("token-file"), o.token_file,
                 "the job's store token, in a file only you can read (the same on every node); default: a "
                 "fresh random token for a single-node job")->type_name("FILE");
  app.add_option(tdist::cli::both_spellings("rdzv-backend"), o.rdzv_backend,
                 "elastic: c10d (the default; a store the first launcher hosts: its node must stay) or etcd "
                 "(an etcd cluster: any node may go)")
      ->type_name("NAME")->default_str("c10d");
  app.add_option(tdist::cli::both_spellings("rdzv-endpoint"), o.rdzv_endpoint,
                 "elastic: where the nodes' launchers meet (default: --master-addr:--master-port); c10d: the "
                 "first launcher that can listen there hosts it; etcd: its members, HOST:PORT,HOST:PORT,...")
      ->type_name("HOST:PORT");
  app.add_option(tdist::cli::both_spellings("rdzv-id"), o.rdzv_id,
                 "elastic: the job's name at the endpoint (default: none); jobs with different ids never meet")
      ->type_name("ID");
  std::string rdzv_conf;
  app.add_option(tdist::cli::both_spellings("rdzv-conf"), rdzv_conf,
                 "elastic: join_timeout=S (default 900), last_call_timeout=S (default 30)")->type_name("K=V,...");
  app.add_option(tdist::cli::both_spellings("local-addr"), o.local_addr,
                 "elastic: this node's address for the other nodes (default: 127.0.0.1 with a loopback "
                 "endpoint, else the host name)")->type_name("HOST");
  app.add_flag(tdist::cli::both_spellings("no-token"), o.no_token,
               "start the ranks without a store token: anyone who reaches the store's port can join the job");
  app.add_option(tdist::cli::both_spellings("stall-seconds"), o.stall_s,
                 "when some rank has waited in an op this long and no rank completed one meanwhile, every rank "
                 "dumps its flight recorder and the analysis is printed; 0: never (default: half the op's "
                 "timeout, at most 300)")
      ->type_name("S")->check(tdist::cli::in_range(0, 1e6));
  app.add_option(tdist::cli::both_spellings("status-interval"), o.status_interval_s,
                 "print a status line every S seconds: steps/s per rank, the slowest rank, the ranks behind")
      ->type_name("S")->check(tdist::cli::in_range(0.1, 1e6));
  add_torchrun_env_names(app);  // PET_NNODES for --nnodes, ... (run/cluster_env.h)
  tdist::cli::parse_or_exit(app, argc, argv);
  const ClusterValues cluster = take_from_cluster(app, argc, argv, v, o);  // PET_NODE_RANK, Slurm
  o.nproc = int_arg(cluster.name("--nproc-per-node"), v["nproc-per-node"], 1, 4096);
  if (const size_t colon = v["nnodes"].find(':'); colon != std::string::npos) {
    o.elastic = true;
    o.min_nodes = int_arg(cluster.name("--nnodes") + " MIN", v["nnodes"].substr(0, colon), 1, 1 << 20);
    o.nnodes = int_arg(cluster.name("--nnodes") + " MAX", v["nnodes"].substr(colon + 1), o.min_nodes, 1 << 20);
  } else {
    o.nnodes = int_arg(cluster.name("--nnodes"), v["nnodes"], 1, 1 << 20);
    o.min_nodes = o.nnodes;
    // torchrun's "--nnodes N" with a rendezvous endpoint or backend (as an
    // elastic PyTorchJob without min/max replicas sets them): a rendezvous
    // of exactly N nodes, numbered by it.
    o.elastic = !o.rdzv_endpoint.empty() || app.get_option("--rdzv-backend")->count() > 0;
  }
  o.node_rank = int_arg(cluster.name("--node-rank"), v["node-rank"], 0, 1 << 20);
  auto* port = app.get_option("--master-port");
  o.master_port = port->count() == 0 && !cluster.master_port
                      ? 0
                      : int_arg(cluster.name("--master-port"), v["master-port"], 1, 65535);
  o.max_restarts = int_arg(cluster.name("--max-restarts"), v["max-restarts"], 0, 1000);
  o.grace_s = int_arg("--grace-seconds", v["grace-seconds"], 0, 3600);
  o.peer_wait_s = int_arg("--peer-wait-seconds", v["peer-wait-seconds"], 0, 3600);
  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest[0] == "--") {
    rest.erase(rest.begin());
  } else if (!rest.empty() && rest[0].rfind("-", 0) == 0) {
    usage("unknown option " + rest[0]);
  }
  o.argv = std::move(rest);
  if (o.argv.empty()) usage("no program given");
  if (o.elastic) {
    if (app.get_option("--node-rank")->count() > 0) {
      usage("--node-rank is not for a rendezvous (--nnodes MIN:MAX, or --rdzv-endpoint): it numbers the nodes");
    }
    if (o.rdzv_endpoint.empty()) {
      if (o.master_port == 0) usage("--nnodes MIN:MAX needs --rdzv-endpoint HOST:PORT (or --master-addr and --master-port)");
      o.rdzv_endpoint = o.master_addr + ":" + std::to_string(o.master_port);
    }
    parse_endpoint(o);
    for (size_t at = 0; at < rdzv_conf.size();) {
      size_t end = rdzv_conf.find(',', at);
      if (end == std::string::npos) end = rdzv_conf.size();
      const std::string item = rdzv_conf.substr(at, end - at);
      at = end + 1;
      const size_t eq = item.find('=');
      const std::string name = item.substr(0, eq);
      if (eq == std::string::npos) usage("--rdzv-conf needs KEY=VALUE items, got '" + item + "'");
      if (name == "join_timeout") {
        o.join_timeout_s = int_arg("--rdzv-conf join_timeout", item.substr(eq + 1), 1, 86400);
      } else if (name == "last_call_timeout") {
        o.last_call_s = int_arg("--rdzv-conf last_call_timeout", item.substr(eq + 1), 0, 3600);
      } else if (name == "job_ttl" && o.rdzv_backend == "etcd") {
        o.job_ttl_s = int_arg("--rdzv-conf job_ttl", item.substr(eq + 1), 30, 7 * 86400);
      } else {
        usage("--rdzv-conf: unknown key '" + name + "' (known: join_timeout, last_call_timeout" +
              (o.rdzv_backend == "etcd" ? ", job_ttl)" : ")"));
      }
    }
    if (o.local_addr.empty()) {
      const std::string& h = o.master_addr;
      if (h == "localhost" || h == "::1" || h.rfind("127.", 0) == 0) {
        o.local_addr = h == "::1" ? "::1" : "127.0.0.1";
      } else {
        char name[256] = {};
        gethostname(name, sizeof name - 1);
        o.local_addr = name;
      }
    }
    if (o.rdzv_id.empty() || o.rdzv_id.size() > 128 ||
        o.rdzv_id.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") !=
            std::string::npos) {
      usage("--rdzv-id needs 1 to 128 letters, digits, '.', '_' or '-', got '" + o.rdzv_id + "'");
    }
  } else if (!rdzv_conf.empty() || !o.local_addr.empty() || app.get_option("--rdzv-id")->count() > 0) {
    usage("--rdzv-id, --rdzv-conf and --local-addr are for a rendezvous (--nnodes MIN:MAX, or --rdzv-endpoint)");
  }
  if (!o.elastic && o.node_rank >= o.nnodes) usage("--node-rank must be below --nnodes");
  if (!o.elastic && o.nnodes > 1 && o.master_port == 0) usage("--master-port is required with --nnodes > 1");
  if (o.no_token && !o.token_file.empty()) usage("--token-file and --no-token contradict each other");
  return o;
}

namespace {
bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && *v;
}

}  // namespace

TokenPlan plan_token(const Options& o) {
  TokenPlan p;
  try {
    if (o.no_token) {
      p.kind = TokenPlan::kNone;
    } else if (!o.token_file.empty()) {
      p.kind = TokenPlan::kGiven;
      p.token = tdist::detail::read_token_file(o.token_file);
    } else if (env_set("TDIST_STORE_TOKEN") || env_set("TDIST_STORE_TOKEN_FILE")) {
      p.kind = TokenPlan::kKeep;
      (void)tdist::detail::resolve_token(std::nullopt);  // a bad token file fails here, once
    } else if (o.nnodes > 1) {
      usage("a multi-node job needs a store token every node shares: pass --token-file FILE (the same secret on "
            "every node, mode 600) or set TDIST_STORE_TOKEN; or pass --no-token to run without one (then anyone "
            "who can reach the master's port can join the job)");
    }
  } catch (const tdist::UsageError& e) {
    usage(e.what());
  }
  return p;
}


}  // namespace tdist_run
