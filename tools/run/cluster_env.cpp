#include "run/cluster_env.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>

#include "tdist/errors.h"
#include "util/env.h"
#include "util/hostlist.h"
#include "util/launch_env.h"
#include "util/printable.h"

namespace tdist_run {

namespace {

using tdist::detail::EnvValue;
using tdist::detail::first_set;
using tdist::detail::printable;

// torchrun's flags that tdist-run has, but --node-rank (read by hand: not
// for an elastic job).
const char* const kTorchrunFlags[] = {"nproc-per-node", "nnodes",        "master-addr", "master-port",
                                      "max-restarts",   "rdzv-backend",  "rdzv-endpoint", "rdzv-id",
                                      "rdzv-conf",      "local-addr"};

std::string pet_name(const std::string& dashed) {
  std::string name = "PET_";
  for (const char c : dashed) name += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// Whether the command line, before the program, names the option.
bool on_command_line(const CLI::App& app, int argc, char** argv, const std::string& dashed) {
  std::string under = dashed;
  for (auto& c : under) c = c == '-' ? '_' : c;
  const int end = argc - static_cast<int>(app.remaining_size());
  for (int i = 1; i < end; ++i) {
    const std::string arg = argv[i];
    for (const std::string& name : {"--" + dashed, "--" + under}) {
      if (arg == name || arg.rfind(name + "=", 0) == 0) return true;
    }
  }
  return false;
}

// A count or index Slurm gave, checked.
int64_t slurm_int(const EnvValue& v, int64_t lo) {
  const auto n = tdist::detail::parse_int(v.value);
  if (!n || *n < lo || *n > (1 << 20)) {
    usage(std::string(v.name) + " is '" + printable(v.value, 40) + "': Slurm's variables are not what srun sets");
  }
  return *n;
}

// --nnodes and --node-rank from an srun step with one task per node;
// whether the node rank is now known.
bool slurm_numbering(std::map<std::string, std::string>& v, ClusterValues& c, bool nnodes_given, bool rank_given) {
  const auto node = first_set(nullptr, {"SLURM_NODEID"});
  if ((nnodes_given && rank_given) || !node) return rank_given;
  const auto step_nodes = first_set(nullptr, {"SLURM_STEP_NUM_NODES"});
  if (!step_nodes) {
    // Slurm's batch script: it runs on the job's first node only.
    const auto job_nodes = first_set(nullptr, {"SLURM_NNODES", "SLURM_JOB_NUM_NODES"});
    if (job_nodes && slurm_int(*job_nodes, 1) > 1) {
      usage(std::string("Slurm's job has ") + job_nodes->value + " nodes (" + job_nodes->name +
            ") but this is no srun step (no SLURM_STEP_NUM_NODES), so tdist-run runs on its first node alone: "
            "start one tdist-run per node with srun --ntasks-per-node=1 tdist-run ..., or pass --nnodes and "
            "--node-rank yourself");
    }
    return rank_given;
  }
  const int64_t nodes = slurm_int(*step_nodes, 1);
  const auto tasks = first_set(nullptr, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"});
  if (!tasks || slurm_int(*tasks, 1) != nodes) {
    usage("Slurm started " + (tasks ? tasks->value + " tasks (" + tasks->name + ")" : std::string("an unknown number of tasks")) +
          " on " + std::to_string(nodes) + " nodes: tdist-run starts each node's ranks itself and needs one task "
          "per node (srun --ntasks-per-node=1 tdist-run --nproc-per-node N ...); or run the program as the ranks, "
          "srun --ntasks-per-node=N ./program, whose env:// reads SLURM_PROCID and SLURM_NTASKS");
  }
  const int64_t id = slurm_int(*node, 0);
  if (id >= nodes) usage("SLURM_NODEID " + node->value + " is not below SLURM_STEP_NUM_NODES " + step_nodes->value);
  if (!nnodes_given) {
    v["nnodes"] = std::to_string(nodes);
    c.from["nnodes"] = step_nodes->name;
  }
  if (!rank_given) {
    v["node-rank"] = std::to_string(id);
    c.from["node-rank"] = "SLURM_NODEID";
  }
  return true;
}

// --master-addr and --master-port of a Slurm job of several nodes.
void slurm_master(const CLI::App& app, std::map<std::string, std::string>& v, Options& o, ClusterValues& c,
                  const EnvValue& job) {
  if (app.get_option("--master-addr")->count() == 0) {
    if (const char* addr = env("MASTER_ADDR")) {
      o.master_addr = addr;
      c.from["master-addr"] = "MASTER_ADDR";
    } else if (const auto list = tdist::detail::slurm_node_list(nullptr)) {
      try {
        o.master_addr = tdist::detail::first_host(list->value);
      } catch (const tdist::UsageError& e) {
        usage(std::string(list->name) + ": " + e.what());
      }
      c.from["master-addr"] = std::string("the first host of ") + list->name;
    }
  }
  if (app.get_option("--master-port")->count() == 0) {
    if (const char* port = env("MASTER_PORT")) {
      v["master-port"] = port;
      c.from["master-port"] = "MASTER_PORT";
    } else {
      try {
        v["master-port"] = std::to_string(tdist::detail::slurm_default_port(job));
      } catch (const tdist::UsageError& e) {
        usage(e.what());
      }
      c.from["master-port"] = std::string(job.name) + ": 20000 + the job id mod 10000";
    }
    c.master_port = true;
  }
}

}  // namespace

void add_torchrun_env_names(CLI::App& app) {
  for (const char* flag : kTorchrunFlags) {
    if (CLI::Option* opt = app.get_option_no_throw(std::string("--") + flag)) opt->envname(pet_name(flag));
  }
}

std::string ClusterValues::name(const std::string& dashed) const {
  const auto it = from.find(dashed.substr(dashed.find_first_not_of('-')));
  return it == from.end() ? dashed : dashed + " (from " + it->second + ")";
}

ClusterValues take_from_cluster(const CLI::App& app, int argc, char** argv, std::map<std::string, std::string>& v,
                                Options& o) {
  ClusterValues c;
  for (const char* flag : kTorchrunFlags) {
    const CLI::Option* opt = app.get_option_no_throw(std::string("--") + flag);
    const std::string pet = pet_name(flag);
    if (opt && opt->count() > 0 && env(pet.c_str()) && !on_command_line(app, argc, argv, flag)) c.from[flag] = pet;
  }
  const std::string& nproc = v["nproc-per-node"];
  if (nproc == "auto" || nproc == "cpu" || nproc == "gpu" || nproc == "xpu") {
    usage(c.name("--nproc-per-node") + " is '" + nproc + "', torchrun's count of a device; tdist-run needs the "
          "number of ranks" + (c.from.count("nproc-per-node") ? ": in a PyTorchJob, set spec.nprocPerNode "
                                                                "(Kubeflow's default is auto)" : std::string()));
  }
  if (v["nnodes"].find(':') != std::string::npos) return c;  // elastic: the rendezvous numbers the nodes
  const bool nnodes_given = app.get_option("--nnodes")->count() > 0;
  bool rank_given = app.get_option("--node-rank")->count() > 0;
  if (const char* rank = env("PET_NODE_RANK"); rank && !rank_given) {
    v["node-rank"] = rank;
    c.from["node-rank"] = "PET_NODE_RANK";
    rank_given = true;
  }
  const auto job = tdist::detail::slurm_job_id(nullptr);
  if (job) rank_given = slurm_numbering(v, c, nnodes_given, rank_given);
  const auto nnodes = tdist::detail::parse_int(v["nnodes"]);
  if (!nnodes || *nnodes < 2) return c;
  if (job) slurm_master(app, v, o, c, *job);
  if (const char* rank = env("RANK"); rank && !rank_given && std::string(rank) != "0") {
    std::fprintf(stderr,
                 "tdist-run: no --node-rank (nor PET_NODE_RANK): this launcher is node 0 of %s, as torchrun's would "
                 "be. RANK=%s in its environment is not read as the node rank (Kubeflow's operator sets RANK to "
                 "the pod's index, and before v1.7 no PET_NODE_RANK): pass --node-rank \"$RANK\" if that is what "
                 "it is\n",
                 v["nnodes"].c_str(), printable(rank, 20).c_str());
  }
  return c;
}

}  // namespace tdist_run
